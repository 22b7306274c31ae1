"""Batched LLM agents in the real env: one trajectory per env, exact loss masks, CoDA context routing.

A tiny random model built from a config (real SmolLM2 tokenizer) does the sampling; the envs search the
real BM25 index. A random model never writes protocol tags, so where a test needs tool calls a
`RecordingSampler` appends a scripted tool call to the model's own sampled text: the agent then sees real
model tokens followed by a tool call, and every protocol path (search, task, executor answer, executor
out of turns) runs through the agent's routing code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.models import tiny_model
from agents.records import Completion, Generation, SamplingParams, Trajectory
from agents.samplers import HFSampler, encode_chat, overflow
from envs.protocol import EXECUTOR_INSTRUCTIONS, FLAT_INSTRUCTIONS, INSTRUCTIONS, PLANNER_INSTRUCTIONS
from envs.rewards import episode_reward, f1_score

ENV_IDS = {"flat": "RedCoda-HotpotQA-v0", "coda": "RedCoda-HotpotQA-CoDA-v0"}
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingEnv(gym.Wrapper):
    """Records every observation and info the env gives, so tests can find them in the contexts."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.observations = [(obs, info)]
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.observations.append((obs, info))
        return obs, reward, terminated, truncated, info


class RecordingSampler:
    """Wraps a sampler: records each call's prompts and completions; optionally scripts tool calls.

    Args:
        inner: the real sampler.
        script: maps a prompt's decoded text to a tool call appended to the model's sampled text (None:
            keep the model's text as it is).
        poison_first_row: on the first call, give the inner sampler an out-of-vocabulary id in row 0.
    """

    def __init__(self, inner: HFSampler, script: Callable[[str], str | None] | None = None, poison_first_row=False):
        self.inner, self.script, self.poison = inner, script, poison_first_row
        self.calls: list[tuple[list[list[int]], list[Completion]]] = []

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        sent = [list(p) for p in prompts]
        if self.poison and not self.calls:
            sent[0] = sent[0] + [self.inner.vocab_size + 7]
        completions = self.inner.generate(sent, params)
        if self.script is not None:
            completions = [self._scripted(p, c) for p, c in zip(prompts, completions, strict=True)]
        self.calls.append(([list(p) for p in prompts], completions))
        return completions

    def _scripted(self, prompt: Sequence[int], completion: Completion) -> Completion:
        call = self.script(self.tokenizer.decode(prompt))
        if call is None or completion.finish_reason == "error":
            return completion
        ids = self.tokenizer(call, add_special_tokens=False)["input_ids"]
        return Completion(
            completion.text + call,
            completion.token_ids + tuple(ids),
            completion.logprobs + (0.0,) * len(ids),
            "stop",
        )


def coda_script(executor_searches: int = 1, tasks: int = 2) -> Callable[[str], str]:
    """Planner: `tasks` tasks then an answer; executor: `executor_searches` searches then an answer."""

    def script(prompt: str) -> str:
        if EXECUTOR_INSTRUCTIONS in prompt:
            if prompt.count("<information>") - EXECUTOR_INSTRUCTIONS.count("<information>") < executor_searches:
                return "<search>Scott Derrickson</search>"
            return "<refine>He is American.</refine><answer>American</answer>"
        done = prompt.count("<result>") - PLANNER_INSTRUCTIONS.count("<result>")
        if done < tasks:
            return f"<think>next</think><task>sub-question {done + 1}</task>"
        return "<answer>yes</answer>"

    return script


def flat_script(prompt: str) -> str:
    """Search once, then answer."""
    searched = prompt.count("<information>") - FLAT_INSTRUCTIONS.count("<information>")
    return "<search>Ed Wood</search>" if searched < 1 else "<answer>Ed Wood</answer>"


def make_envs(protocol: str, n: int, retriever, **kwargs) -> list[RecordingEnv]:
    kwargs = {"split": "dev", "max_passage_words": 30, "retriever": retriever, **kwargs}
    return [RecordingEnv(gym.make(ENV_IDS[protocol], **kwargs)) for _ in range(n)]


def runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each maximal run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def chat_prompt(tokenizer, role: str, user: str) -> list[int]:
    return encode_chat(
        tokenizer, [{"role": "system", "content": INSTRUCTIONS[role]}, {"role": "user", "content": user}]
    )


def check_masks(trajectories: Sequence[Trajectory], sampler: RecordingSampler, env_list: Sequence[RecordingEnv]):
    """Masked tokens are exactly the sampled completions; prompts and observations are never masked."""
    tokenizer = sampler.tokenizer
    calls = [
        (prompt, c, k) for k, (prompts, cs) in enumerate(sampler.calls) for prompt, c in zip(prompts, cs, strict=True)
    ]
    used: set[int] = set()
    for trajectory, env in zip(trajectories, env_list, strict=True):
        observations = set()
        for obs, info in env.observations[1:]:
            if not info.get("new_context"):
                observations.add(obs)
                observations.add("\n<result>" + obs.rpartition("\n<result>")[2])  # a planner's share of it
        mine = []
        for generation in trajectory.generations:
            ids = list(generation.token_ids)
            segments = runs(generation.loss_mask)
            start, end, value = segments[0]
            assert value == 0, "the prompt is never masked"
            assert any(ids[:end] == chat_prompt(tokenizer, generation.role, user) for user in _users(env))
            for start, end, value in segments[1:]:
                if value == 1:
                    found = [
                        j
                        for j, (prompt, c, _) in enumerate(calls)
                        if j not in used and prompt == ids[:start] and list(c.token_ids) == ids[start:end]
                    ]
                    assert found, "a masked run that no generate call sampled after exactly this context"
                    used.add(found[0])
                    mine.append(found[0])
                    assert list(generation.sample_logprobs[start:end]) == list(calls[found[0]][1].logprobs)
                    text = tokenizer.decode(ids[start:end], skip_special_tokens=True)
                    assert text.startswith(calls[found[0]][1].text)
                else:
                    assert any(ids[start:end] == _ids(tokenizer, obs) for obs in observations), (
                        f"an unmasked run that is no env observation: {tokenizer.decode(ids[start:end])!r}"
                    )
                    assert not any(generation.sample_logprobs[start:end])
            assert sum(generation.loss_mask) == generation.num_sampled
        # the model's turns of this episode, in sampling order, are exactly the actions the env got
        assert [calls[j][1].text for j in sorted(mine)] == list(trajectory.actions)
    sampled = [j for j, (_, c, _) in enumerate(calls) if c.token_ids]
    assert sorted(used) == sampled, "every sampled completion lands in exactly one context"


def _users(env: RecordingEnv) -> list[str]:
    return [info["user_message"] for _, info in env.observations if info.get("new_context")]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_coda_contexts(trajectory: Trajectory, tokenizer) -> None:
    """Executor contexts are fresh; the planner sees tasks and results, never search results."""
    planners = [g for g in trajectory.generations if g.role == "planner"]
    executors = [g for g in trajectory.generations if g.role == "executor"]
    assert len(planners) == 1 and len(executors) == trajectory.info["num_tasks"]
    planner = planners[0]
    planner_text = tokenizer.decode(planner.token_ids)
    assert "<information>" not in planner_text and "Doc 1 (Title:" not in planner_text
    assert EXECUTOR_INSTRUCTIONS not in planner_text
    observed = [tokenizer.decode(planner.token_ids[a:b]) for a, b, v in runs(planner.loss_mask)[1:] if not v]
    assert sum(text.count("<result>") for text in observed) == len(executors)
    tasks = re.findall(r"<task>(.*?)</task>", " ".join(trajectory.actions))
    for executor, task in zip(executors, tasks, strict=True):
        prompt = chat_prompt(tokenizer, "executor", f"Task: {task.strip()}")
        assert list(executor.token_ids[: len(prompt)]) == prompt, "an executor context starts fresh"
        text = tokenizer.decode(executor.token_ids)
        assert PLANNER_INSTRUCTIONS not in text and "Question:" not in text and "<result>" not in text
        assert all(t not in text for t in tasks if t != task)


# -- flat -----------------------------------------------------------------------------------------------------


def test_flat_rollout_gives_one_trajectory_per_env(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    env_list = make_envs("flat", 4, bm25, max_turns=2)
    agent = SearchR1Agent(HFSampler(model, tokenizer, max_context=2048), PARAMS)
    trajectories = agent.rollout(env_list, indices=[5, 5, 9, 11], group_ids=[0, 0, 1, 2], seed=0)
    assert [(t.example_index, t.group_id) for t in trajectories] == [(5, 0), (5, 0), (9, 1), (11, 2)]
    for trajectory in trajectories:
        assert isinstance(trajectory, Trajectory) and len(trajectory.generations) == 1
        (generation,) = trajectory.generations
        assert isinstance(generation, Generation) and generation.role == "agent"
        assert len(trajectory.actions) == 2 and 0 < generation.num_sampled <= 2 * PARAMS.max_new_tokens
        info = trajectory.info
        assert {"em", "f1", "format", "refine", "num_searches", "recall", "invalid_actions"} <= set(info)
        assert trajectory.reward == pytest.approx(episode_reward(info["f1"], info["format"], info["refine"]))


def test_finished_episodes_stop_generating(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048))
    env_list = [make_envs("flat", 1, bm25, max_turns=t)[0] for t in (1, 3, 2)]
    trajectories = SearchR1Agent(sampler, PARAMS).rollout(env_list, [0, 1, 2], seed=1)
    assert [len(prompts) for prompts, _ in sampler.calls] == [3, 2, 1]
    assert [len(t.actions) for t in trajectories] == [1, 3, 2]
    assert all(t.info["invalid_actions"] == len(t.actions) for t in trajectories)  # a random model writes no tags


def test_flat_masks_are_exactly_the_sampled_tokens(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), script=flat_script)
    env_list = make_envs("flat", 3, bm25, max_turns=3)
    trajectories = SearchR1Agent(sampler, PARAMS).rollout(env_list, [0, 1, 2], seed=2)
    assert all(t.info["num_searches"] == 1 and t.info["answered"] for t in trajectories)
    check_masks(trajectories, sampler, env_list)
    # the observations really are in the context: search results, unmasked
    text = tokenizer.decode(trajectories[0].generations[0].token_ids)
    assert "<information>Doc 1 (Title:" in text


def test_raw_model_masks_with_invalid_action_observations(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048))
    env_list = make_envs("flat", 2, bm25, max_turns=3)
    trajectories = SearchR1Agent(sampler, PARAMS).rollout(env_list, [3, 4], seed=3)
    check_masks(trajectories, sampler, env_list)
    assert "Invalid action" in tokenizer.decode(trajectories[0].generations[0].token_ids)


def test_rollouts_are_reproducible_from_the_seed(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    agent = SearchR1Agent(HFSampler(model, tokenizer, max_context=2048), PARAMS)
    env_list = make_envs("flat", 2, bm25, max_turns=2)
    first = agent.rollout(env_list, [0, 1], seed=4)
    again = agent.rollout(env_list, [0, 1], seed=4)
    other = agent.rollout(env_list, [0, 1], seed=5)
    assert [t.generations for t in first] == [t.generations for t in again]
    assert [t.generations for t in first] != [t.generations for t in other]


def test_agents_refuse_the_other_protocol(tiny, bm25):
    from agents.search_agents import CodaAgent, SearchR1Agent

    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer)
    with pytest.raises(ValueError, match="protocol"):
        SearchR1Agent(sampler).rollout(make_envs("coda", 1, bm25), [0])
    with pytest.raises(ValueError, match="protocol"):
        CodaAgent(sampler).rollout(make_envs("flat", 1, bm25), [0])


# -- CoDA -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor_searches", [1, 5], ids=["executor-answers", "executor-out-of-turns"])
def test_coda_contexts_are_decoupled_and_masks_exact(tiny, bm25, executor_searches):
    from agents.search_agents import CodaAgent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), script=coda_script(executor_searches))
    env_list = make_envs("coda", 3, bm25, max_executor_turns=2, max_planner_turns=4)
    trajectories = CodaAgent(sampler, PARAMS).rollout(env_list, [0, 1, 2], group_ids=[7, 7, 8], seed=5)
    assert [t.group_id for t in trajectories] == [7, 7, 8]
    for trajectory in trajectories:
        assert [g.role for g in trajectory.generations] == ["executor", "executor", "planner"]
        assert trajectory.info["num_tasks"] == 2 and trajectory.info["answered"]
        check_coda_contexts(trajectory, tokenizer)
    check_masks(trajectories, sampler, env_list)
    if executor_searches > 1:  # the worker ran out of turns: "no answer" came back, its documents did not
        planner_text = tokenizer.decode(trajectories[0].generations[-1].token_ids)
        assert "<result>no answer" in planner_text


def test_coda_raw_tiny_model_keeps_search_results_out_of_the_planner(tiny, bm25):
    from agents.search_agents import CodaAgent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048))
    env_list = make_envs("coda", 3, bm25, max_planner_turns=2)
    trajectories = CodaAgent(sampler, PARAMS).rollout(env_list, [0, 1, 2], seed=6)
    for trajectory in trajectories:
        check_coda_contexts(trajectory, tokenizer)
        assert trajectory.generations[-1].role == "planner"
    check_masks(trajectories, sampler, env_list)


def test_coda_with_a_separate_executor_sampler(tiny, bm25):
    from agents.search_agents import CodaAgent

    model, tokenizer = tiny
    planner = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), script=coda_script(1, tasks=1))
    executor = RecordingSampler(HFSampler(tiny_model(seed=1)[0], tokenizer, max_context=2048), script=coda_script(1))
    agent = CodaAgent(planner, PARAMS, executor_sampler=executor, executor_params=SamplingParams(max_new_tokens=5))
    env_list = make_envs("coda", 2, bm25)
    trajectories = agent.rollout(env_list, [0, 1], seed=7)
    assert all(EXECUTOR_INSTRUCTIONS not in tokenizer.decode(p) for prompts, _ in planner.calls for p in prompts)
    assert all(EXECUTOR_INSTRUCTIONS in tokenizer.decode(p) for prompts, _ in executor.calls for p in prompts)
    for trajectory in trajectories:
        check_coda_contexts(trajectory, tokenizer)


# -- faults are recorded, never raised ------------------------------------------------------------------------


def test_sampler_context_overflow_is_recorded(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer, max_context=96)  # shorter than the instructions alone
    env_list = make_envs("flat", 2, bm25, max_turns=2)
    trajectories = SearchR1Agent(sampler, PARAMS).rollout(env_list, [0, 1], seed=8)
    for trajectory in trajectories:
        (generation,) = trajectory.generations
        last_turn = runs(generation.loss_mask)[-1][0]  # the context the last turn was sampled from
        assert generation.truncated_tokens == overflow(last_turn, PARAMS.max_new_tokens, 96) > 0
        assert len(trajectory.actions) == 2


def test_agent_context_limit_ends_the_episode_as_unanswered(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), script=flat_script)
    env_list = make_envs("flat", 2, bm25, max_turns=3, max_passage_words=80)
    agent = SearchR1Agent(sampler, PARAMS, max_context_tokens=300)  # one search result overflows it
    trajectories = agent.rollout(env_list, [0, 1], seed=9)
    for trajectory in trajectories:
        info = trajectory.info
        assert info["context_overflow"] and info["ended_by"] and not info["answered"] and info["f1"] == 0
        assert len(trajectory.actions) == 1 and len(trajectory.generations) == 1
        assert trajectory.reward == pytest.approx(episode_reward(0.0, info["format"], info["refine"]))


def test_a_sampler_error_row_does_not_crash_the_batch(tiny, bm25):
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny
    sampler = RecordingSampler(HFSampler(model, tokenizer, max_context=2048), poison_first_row=True)
    env_list = make_envs("flat", 3, bm25, max_turns=2)
    trajectories = SearchR1Agent(sampler, PARAMS).rollout(env_list, [0, 1, 2], seed=10)
    first_call = sampler.calls[0][1]
    assert first_call[0].finish_reason == "error" and "vocabulary" in first_call[0].error
    assert all(c.finish_reason != "error" for c in first_call[1:])
    assert [t.info["sampler_errors"] for t in trajectories] == [1, 0, 0]
    assert trajectories[0].actions[0] == "" and len(trajectories[0].actions) == 2  # the episode went on
    assert trajectories[0].generations[0].num_sampled == len(sampler.calls[1][1][0].token_ids)


# -- the real model ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_flat_rollout(bm25):
    from agents.models import load_model
    from agents.search_agents import SearchR1Agent

    model, tokenizer = load_model(device="cpu")
    sampler = RecordingSampler(HFSampler(model, tokenizer))
    env_list = make_envs("flat", 2, bm25, max_turns=2)
    agent = SearchR1Agent(sampler, SamplingParams(max_new_tokens=48, temperature=0.0))
    trajectories = agent.rollout(env_list, [0, 1], seed=0)
    assert len(trajectories) == 2 and all(len(t.generations) == 1 for t in trajectories)
    check_masks(trajectories, sampler, env_list)
    for t in trajectories:  # the terminal info scores the answer this episode gave (none: F1 0)
        answer = t.info["answer"]
        assert t.info["f1"] == (f1_score(answer, t.info["gold_answers"]) if answer is not None else 0.0)
        assert t.info["answered"] == (answer is not None)
