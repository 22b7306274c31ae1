"""RedCoda's env for verifiers (prime-rl, the Environments Hub): a taskset whose tools are ``search`` and
``answer`` over the env's retriever and whose reward is the env's (``6*F1 - 3 + ...``; EM, F1, format as metrics).

    pip install 'redcoda[verifiers]'
    from envs.frameworks.verifiers_env import load_environment
    env = load_environment(split="dev", indices=[0, 1, 2])           # a verifiers Env, loaded as the Hub loads one
    async with env.serving():                                        # the shared tool server comes up once
        episode = await env.run_episode(task, ctx)                   # task from env.taskset; ctx: model + endpoint

Every rollout plays one RAGEnv episode in the tool server (one process for the run, one index, one env per rollout,
none shared): ``search(query)`` is the env's ``<search>``, ``answer(answer)`` its ``<answer>``, which ends the
episode. The rollout's state carries the question, the actions and, once it ends, the env's reward and terminal
info, which the task's ``@vf.reward`` and ``@vf.metric`` read. A rollout that never answers is scored as the env
scores it (its actions replayed, then ended unanswered). The bundled harness (the default for this taskset) runs
verifiers' own chat loop with this interpreter, so an eval runs offline; pin ``--env.agent.harness.id null`` (it
needs ``uv``) or any other for remote runtimes. Flat protocol: a chat with tools is one context.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import uuid
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)
from envs.frameworks import jsonable, require
from envs.metrics import episode_metrics
from envs.rag_env import question_index

require("verifiers", "verifiers", __name__)

import verifiers.v1 as vf  # noqa: E402
from pydantic import Field  # noqa: E402
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program  # noqa: E402

TASKSET_ID = "redcoda"
"""The taskset id `load_environment` registers this module under (verifiers imports a taskset as a top-level module)."""
TOOL_GUIDE = (
    "Answer the question. Call the search tool to find passages about what you need to know (as often as you "
    "need), then call the answer tool once with a short answer (a few words).\n\nQuestion: "
)
LIVE_EPISODES = 4096
"""Episodes the tool server keeps in memory; beyond it the oldest unfinished one is dropped (a rollout that calls a
tool again gets it back by replaying its actions)."""


class RedCodaToolsConfig(vf.SharedToolsetConfig):
    env_id: str = "RedCoda-HotpotQA-v0"
    """The registered RedCoda id every rollout's env is made from (flat protocol)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """`gym.make` arguments (split, top_k, max_turns, retriever, ...)."""


class RedCodaConfig(vf.TasksetConfig):
    env_id: str = "RedCoda-HotpotQA-v0"
    """The registered RedCoda id (flat protocol)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """`gym.make` arguments (split, top_k, max_turns, retriever, ...)."""
    indices: list[int] | None = None
    """The questions, by index in the split (None: all)."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the tool server runs (a subprocess by default)."""


class RedCodaData(vf.TaskData):
    index: int
    """The question's index in the split."""
    answers: list[str]
    """The gold answers (for reading traces; the env scores)."""


class RedCodaState(vf.State):
    index: int = -1
    episode: str = ""
    """The rollout's episode in the tool server."""
    actions: list[str] = Field(default_factory=list)
    """The env actions the tool calls became, in order."""
    reward: float | None = None
    """The env's episode reward, once the episode has ended."""
    info: dict[str, Any] = Field(default_factory=dict)
    """The env's terminal info (JSON-safe), once the episode has ended."""


def make_env(env_id: str, env_kwargs: dict[str, Any]) -> gym.Env:
    env = gym.make(env_id, disable_env_checker=True, **env_kwargs)
    if env.unwrapped.protocol != "flat":
        raise ValueError("verifiers plays one chat with tools per rollout: the flat protocol only")
    return env


class RedCodaTools(vf.Toolset[RedCodaToolsConfig, RedCodaState]):
    """The ``search`` and ``answer`` tools: one RAGEnv episode per rollout, all searching one index."""

    TOOL_PREFIX = None  # the model calls `search` and `answer`, as in TRL's environment mode

    def __init__(self, config: RedCodaToolsConfig) -> None:
        super().__init__(config)
        self._episodes: collections.OrderedDict[str, gym.Env] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._retriever: Any = None

    async def setup(self) -> None:
        first = make_env(self.config.env_id, self.config.env_kwargs)  # builds the index before the first call
        self._retriever = first.unwrapped.retriever

    @vf.tool
    async def search(self, query: str) -> str:
        """Search the corpus for passages about a query (an entity, a title or a short question)."""
        return await asyncio.to_thread(self.play, self.state, f"<search>{query}</search>")

    @vf.tool
    async def answer(self, answer: str) -> str:
        """Give the final answer to the question (a few words), which ends the episode."""
        reply = await asyncio.to_thread(self.play, self.state, f"<answer>{answer}</answer>")
        return reply or "The answer is recorded; the episode is over."

    def play(self, state: RedCodaState, action: str) -> str:
        """Step the rollout's episode (the one `state` names; made and reset on its first action) with `action`;
        the env's observation. `state` records the action and, when the episode ends, its reward and info."""
        if state.index < 0 or not state.episode:
            raise ValueError("this rollout carries no RedCoda question (its task did not set up)")
        if state.reward is not None:
            return "The episode is over: no more tool calls are needed."
        with self._lock:
            env = self._episodes.get(state.episode)
            if env is None:
                kwargs = {
                    **self.config.env_kwargs,
                    **({"retriever": self._retriever} if self._retriever is not None else {}),
                }
                env = self._episodes[state.episode] = make_env(self.config.env_id, kwargs)
                env.reset(options={"index": state.index})
                for earlier in state.actions:  # an episode dropped from memory comes back as it was (deterministic)
                    env.step(earlier)
                while len(self._episodes) > LIVE_EPISODES:
                    self._episodes.popitem(last=False)[1].close()
        obs, reward, terminated, truncated, info = env.step(action)
        state.actions = [*state.actions, action]
        if terminated or truncated:
            state.reward, state.info = float(reward), jsonable(info)
            with self._lock:
                self._episodes.pop(state.episode, None)
            return obs + ("\nThe episode is over: no more tool calls are needed." if truncated else "")
        return obs


class RedCodaTask(vf.Task[RedCodaData, RedCodaState, vf.TaskConfig]):
    """One question; its rewards read the episode the tool calls played."""

    env_id: str = "RedCoda-HotpotQA-v0"
    env_kwargs: dict[str, Any] = {}

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        trace.state.index, trace.state.episode = self.data.index, uuid.uuid4().hex

    def outcome(self, state: RedCodaState) -> tuple[float, dict[str, Any]]:
        """The episode's reward and terminal info: as the tools left them, or (never answered) the env's score of
        the same actions ended unanswered."""
        if state.reward is not None:
            return state.reward, state.info
        env = make_env(self.env_id, self.env_kwargs)
        env.reset(options={"index": self.data.index})
        for action in state.actions:
            env.step(action)
        reward, info = env.unwrapped.end_episode("the model stopped calling tools")
        state.reward, state.info = float(reward), jsonable(info)
        return state.reward, state.info

    @vf.reward(weight=1.0)
    async def redcoda(self, trace: vf.Trace) -> float:
        """The env's episode reward: ``6*F1 - 3 + 0.1*format + 0.1*refine`` (envs/rewards.py)."""
        return (await asyncio.to_thread(self.outcome, trace.state))[0]

    @vf.metric
    async def episode(self, trace: vf.Trace) -> dict[str, float]:
        """The env's episode metrics (em, f1, format, refine, recall, num_searches, ...: `envs.episode_metrics`)."""
        return episode_metrics((await asyncio.to_thread(self.outcome, trace.state))[1])


class RedCodaTaskset(vf.Taskset[RedCodaTask, RedCodaConfig]):
    """The env's questions as verifiers tasks: a user prompt (the tool guide and the question), one per index."""

    def load(self):
        env = make_env(self.config.env_id, self.config.env_kwargs).unwrapped
        chosen = range(env.num_examples) if self.config.indices is None else self.config.indices
        for index in chosen:
            index = question_index({"index": index}, env.num_examples)  # a clear error for an unknown question
            example = env.examples[index]
            task = RedCodaTask(
                RedCodaData(
                    id=example.id,
                    name=f"{env.dataset}-{env.split}#{int(index)}",
                    prompt=TOOL_GUIDE + example.question,
                    index=int(index),
                    answers=list(example.answers),
                ),
                self.config.task,
            )
            task.env_id, task.env_kwargs = self.config.env_id, dict(self.config.env_kwargs)
            yield task

    @classmethod
    def toolsets(cls, config: RedCodaConfig) -> list[vf.Toolset]:
        tools = RedCodaToolsConfig(
            env_id=config.env_id, env_kwargs=config.env_kwargs, runtime=config.tools.runtime, url=config.tools.url
        )
        return [RedCodaTools(tools)]


class LocalChatHarnessConfig(vf.HarnessConfig):
    pass


class LocalChatHarness(vf.Harness[LocalChatHarnessConfig]):
    """verifiers' own tool-calling chat loop (the ``null`` harness's program), run by this interpreter instead of a
    ``uv`` script environment: its packages (openai, mcp, httpx) are verifiers' own dependencies, so a local eval
    needs no network. Subprocess runtime only."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE,
            self.config,
            ctx,
            trace,
            _ThisInterpreter(runtime),
            endpoint,
            secret,
            mcp_urls,
            system_prompt,
            prompt,
        )


class _ThisInterpreter:
    """`runtime`, except that a PEP 723 script runs with this interpreter (its packages, no uv)."""

    def __init__(self, runtime: vf.Runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate: bool = True) -> list[str]:
        path = f".vf-redcoda-chat-{uuid.uuid4().hex}.py"
        await self._runtime.write(path, script.encode() if isinstance(script, str) else script)
        return [sys.executable, path]


def load_environment(
    env_id: str = "RedCoda-HotpotQA-v0", indices: list[int] | None = None, runtime: str = "subprocess", **env_kwargs
) -> vf.Env:
    """The verifiers env of RedCoda's questions, built by verifiers' own loader (`vf.load_environment`).

    Args:
        env_id: A flat RedCoda id.
        indices: Which questions (default: all of the split).
        runtime: Where the harness and the tool server run (``subprocess``: this machine).
        **env_kwargs: `gym.make` arguments (split, top_k, max_turns, retriever, corpus, ...).
    """
    sys.modules.setdefault(TASKSET_ID, sys.modules[__name__])  # verifiers imports a taskset id as a module
    taskset = {"id": TASKSET_ID, "env_id": env_id, "env_kwargs": env_kwargs, "indices": indices}
    taskset["tools"] = {"runtime": {"type": runtime}}
    agent = {"runtime": {"type": runtime}}
    return vf.load_environment(vf.resolve_env_config({"taskset": taskset, "agent": agent}))


__all__ = ["LocalChatHarness", "RedCodaTaskset", "load_environment"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m envs.frameworks.verifiers_env`
    RedCodaTools.run()
