"""Batched searches: an agent's rollout sends each turn's searches to a retrieval server as one request."""

from __future__ import annotations

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.oracle import OracleAgent
from envs.batching import prefetch_searches
from retrievers import factory
from retrievers.server import create_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUESTIONS = [0, 0, 1, 1, 2, 2]
"""Three questions, two rollouts each: a GRPO step of group size 2."""


class CountingApp:
    """The server's app behind a counter of the /retrieve requests it answers (a pass-through ASGI layer)."""

    def __init__(self, app) -> None:
        self.app = app
        self.retrieves = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/retrieve":
            self.retrieves += 1
        await self.app(scope, receive, send)


@pytest.fixture(autouse=True)
def close_server_clients():
    """Close the shared clients of this test's servers: the next test's server may get a freed port."""
    yield
    for client in factory._SERVERS.values():
        getattr(client, "inner", client).close()
    factory._SERVERS.clear()


@pytest.fixture(scope="module")
def tokenizer():
    from agents.models import smollm2_tokenizer

    return smollm2_tokenizer()


def _rollout(bm25, serve_app, tokenizer, protocol: str, query_cache: int):
    app = CountingApp(create_app(bm25))
    url, stop = serve_app(app)
    env_id = "RedCoda-HotpotQA-v0" if protocol == "flat" else "RedCoda-HotpotQA-CoDA-v0"
    kwargs = {"split": "dev", "retriever": url, "query_cache": query_cache, "max_turns": 6, "max_planner_turns": 6}
    env_list = [gym.make(env_id, **kwargs) for _ in QUESTIONS]
    try:
        trajectories = OracleAgent(tokenizer, seed=0).rollout(env_list, QUESTIONS, seed=0)
    finally:
        stop()
    return trajectories, app.retrieves


@pytest.mark.parametrize("protocol", ["flat", "coda"])
def test_a_rollout_sends_one_request_per_turn_that_searches(bm25, serve_app, tokenizer, protocol):
    trajectories, requests = _rollout(bm25, serve_app, tokenizer, protocol, query_cache=4096)
    # every live env acts once per turn, so an episode's n-th action is the rollout's n-th turn
    searching_turns = {n for t in trajectories for n, action in enumerate(t.actions) if "<search>" in action}
    searches = sum(t.info["num_searches"] for t in trajectories)
    assert all(t.info["f1"] == 1.0 for t in trajectories)
    assert requests == len(searching_turns) < searches


def test_without_a_cache_each_env_searches_on_its_own(bm25, serve_app, tokenizer):
    trajectories, requests = _rollout(bm25, serve_app, tokenizer, "flat", query_cache=0)
    assert requests == sum(t.info["num_searches"] for t in trajectories)
    batched, _ = _rollout(bm25, serve_app, tokenizer, "flat", query_cache=4096)
    assert [t.actions for t in batched] == [t.actions for t in trajectories]  # the same episodes either way


def test_prefetch_skips_envs_that_will_not_search(bm25, serve_app):
    app = CountingApp(create_app(bm25))
    url, stop = serve_app(app)
    env_list = [gym.make("RedCoda-HotpotQA-v0", split="dev", retriever=url) for _ in range(3)]
    for i, env in enumerate(env_list):
        env.reset(options={"index": i})
    actions = ["<answer>x</answer>", "no tags at all", "<search>Scott Derrickson</search>"]
    try:
        assert prefetch_searches(env_list, actions) == 1
        requests = app.retrieves
        _, _, _, _, info = env_list[2].step(actions[2])  # answered from the cache the prefetch filled
    finally:
        stop()
    assert requests == 1 and app.retrieves == 1 and len(info["doc_ids"]) == 3
