"""The same oracle actions give the same rewards and info through `gym.make` and through every framework adapter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from envs.frameworks import json_roundtrip

INDICES = [3, 17]


def oracle_actions(example, protocol: str) -> list[str]:
    """Search each gold title, then answer the gold answer (CoDA: one task per title, then the planner answers)."""
    if protocol == "flat":
        return [*(f"<search>{title}</search>" for title in example.gold_titles), f"<answer>{example.answer}</answer>"]
    actions = []
    for title in example.gold_titles:
        actions += [f"<task>What does {title} say?</task>", f"<search>{title}</search>", f"<answer>{title}</answer>"]
    return [*actions, f"<answer>{example.answer}</answer>"]


def through_gym(protocol: str, index: int, actions: list[str]):
    env = gym.make("RedCoda-HotpotQA-v0", protocol=protocol)
    env.reset(options={"index": index})
    return [(reward, json_roundtrip(info)) for _, reward, _, _, info in (env.step(a) for a in actions)]


def through_openenv(url: str, index: int, actions: list[str]):
    from envs.frameworks.openenv_client import RedCodaAction, RedCodaEnv

    with RedCodaEnv(base_url=url).sync() as env:
        env.reset(index=index)
        results = [env.step(RedCodaAction(text=action)) for action in actions]
    return [(r.reward, r.observation.info) for r in results]


def through_skyrl(index: int, actions: list[str]):
    import skyrl_gym

    import envs.frameworks.skyrl  # noqa: F401  (registers "redcoda")

    env = skyrl_gym.make("redcoda", env_config={}, extras={"extra_info": {"index": index}})
    env.init([])
    return [(out["reward"], out["metadata"]) for out in (env.step(a) for a in actions)]


def through_verifiers(index: int, actions: list[str]):
    """The verifiers adapter's tool server and task scoring, in process (the MCP transport is the rollout test's)."""
    from envs.frameworks.verifiers_env import RedCodaState, RedCodaTask, RedCodaTools, RedCodaToolsConfig

    tools = RedCodaTools(RedCodaToolsConfig())
    asyncio.run(tools.setup())
    state = RedCodaState(index=index, episode="parity")
    for action in actions:
        tools.play(state, action)
    task = RedCodaTask.__new__(RedCodaTask)
    trace = SimpleNamespace(state=state)
    reward = asyncio.run(task.redcoda(trace))
    metrics = asyncio.run(task.episode(trace))
    assert metrics == envs.episode_metrics(state.info)
    return [(reward, state.info)]


@pytest.fixture(scope="module")
def openenv_urls(serve_app):
    from envs.frameworks.openenv_server import ServerSettings, create_redcoda_app

    return {p: serve_app(create_redcoda_app(ServerSettings(env_kwargs={"protocol": p})))[0] for p in ("flat", "coda")}


@pytest.mark.parametrize(
    "adapter, protocol",
    [("openenv", "flat"), ("openenv", "coda"), ("skyrl", "flat"), ("verifiers", "flat")],
)
@pytest.mark.parametrize("index", INDICES)
def test_the_same_actions_score_the_same_through_every_adapter(adapter, protocol, index, openenv_urls):
    example = gym.make("RedCoda-HotpotQA-v0").unwrapped.examples[index]
    actions = oracle_actions(example, protocol)
    expected = through_gym(protocol, index, actions)
    if adapter == "openenv":
        seen = through_openenv(openenv_urls[protocol], index, actions)
    elif adapter == "skyrl":
        seen = through_skyrl(index, actions)
    else:
        seen, expected = through_verifiers(index, actions), expected[-1:]  # a rollout's score is its last step's
    assert seen == expected
    assert expected[-1][1]["f1"] == 1.0 and expected[-1][0] > 3 - 1e-9 and len(seen) >= 1


def test_the_adapters_import_without_torch_or_a_jvm():
    """Importing an adapter loads its framework, not torch, and starts no JVM (the index starts with the first env)."""
    import subprocess
    import sys
    from pathlib import Path

    modules = ["openenv_server", "openenv_client", "verifiers_env", "skyrl"]
    code = "; ".join(f"import envs.frameworks.{m}" for m in modules)
    code += "; import sys, jnius_config; assert 'torch' not in sys.modules and not jnius_config.vm_running"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
