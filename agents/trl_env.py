"""Our env in TRL's environment mode: `GRPOTrainer(environment_factory=...)` plays RAGEnv episodes by tool calls.

TRL's environment mode (``environment_factory``, an experimental `GRPOTrainer` argument) gives every rollout an
object that keeps its state across the turns of the conversation: TRL calls its ``reset(**row)`` with the dataset
row, offers its public methods to the model as tools (the chat template's tool calling), feeds each tool's return
back as a tool message, and, when the model stops calling tools, asks its ``get_reward()`` for the episode's reward.
`RedCodaToolEnv` is that object around one RAGEnv (flat protocol): the model's ``search(query)`` and
``answer(answer)`` calls become the env's ``<search>`` and ``<answer>`` actions, so the env retrieves, counts the
turns and scores the episode, and its terminal reward (the same ``6*F1 - 3 + ...`` as every other trainer's) is
the reward TRL trains on.

    from trl import GRPOConfig, GRPOTrainer
    from agents.trl_env import environment_factory, tool_dataset

    make_env = environment_factory("RedCoda-HotpotQA-v0", max_turns=4)
    trainer = GRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",  # a chat template with tool calling that TRL parses
        args=GRPOConfig(output_dir="out", max_tool_calling_iterations=4),
        train_dataset=tool_dataset(make_env().env),
        environment_factory=make_env,
    )
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)

__all__ = ["TOOL_GUIDE", "RedCodaToolEnv", "environment_factory", "tool_dataset"]

TOOL_GUIDE = (
    "Answer the question. Call the search tool to find passages about what you need to know (as often as you "
    "need), then call the answer tool once with a short answer (a few words).\n\nQuestion: "
)
"""What the user message says before the question: the tools themselves are described by the chat template."""
OVER = "The episode is over: no more tool calls are needed."
"""A tool's reply once the episode has ended (an answer was given, or the turn limit was reached)."""


class RedCodaToolEnv:
    """One RAGEnv episode at a time, driven by tool calls; TRL makes one per concurrent rollout and resets it.

    Public methods other than ``reset`` and ``get_reward`` are the model's tools, so everything else is private.
    ``info`` holds the terminal info of the last finished episode (`envs.episode_metrics` reads it).

    Args:
        env: A RAGEnv of the flat protocol (wrapped or not); its settings (retriever, top-k, turn limits, reward
            weights) are the episode's.

    Raises:
        ValueError: the env plays the CoDA protocol, whose executors need contexts of their own (use
            `agents.trl_interop.EnvRollout` for it).
    """

    def __init__(self, env: gym.Env) -> None:
        if env.unwrapped.protocol != "flat":
            raise ValueError(
                "TRL's environment mode plays one conversation per episode: the flat protocol only; for CoDA use "
                "agents.trl_interop.EnvRollout as GRPOTrainer's rollout_func"
            )
        self.env = env
        self.info: dict[str, Any] | None = None
        self._reward: float | None = None

    def reset(self, index: int, **row: Any) -> None:
        """Start the episode of the dataset row's question (TRL passes the row's columns as keyword arguments).

        Returns:
            None: the row's prompt already holds the question (`tool_dataset`).
        """
        self.env.reset(options={"index": int(index)})
        self.info, self._reward = None, None

    def search(self, query: str) -> str:
        """Search the corpus for passages about a query.

        Args:
            query: What to look for: an entity, a title or a short question.

        Returns:
            The passages found, each with its title.
        """
        return self._act(f"<search>{query}</search>")

    def answer(self, answer: str) -> str:
        """Give the final answer to the question, which ends the episode.

        Args:
            answer: The answer, a few words.

        Returns:
            A confirmation that the answer was recorded.
        """
        reply = self._act(f"<answer>{answer}</answer>")
        return "The answer is recorded; the episode is over." if reply == "" else reply

    def get_reward(self) -> float:
        """The episode's reward, as the env scored it; an episode the model left without an answer is ended now and
        scored as unanswered (`envs.rag_env.RAGEnv.end_episode`)."""
        if self._reward is None:
            self._reward, self.info = self.env.unwrapped.end_episode("the model stopped calling tools")
        return float(self._reward)

    def _act(self, action: str) -> str:
        """Step the env with `action` unless the episode is over; the observation (empty once it ends)."""
        if self._reward is not None:
            return OVER
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            self._reward, self.info = float(reward), info
            return obs + ("\n" + OVER if truncated else "")
        return obs


def environment_factory(env_id: str = "RedCoda-HotpotQA-v0", **env_kwargs: Any) -> Callable[[], RedCodaToolEnv]:
    """A factory for `GRPOTrainer(environment_factory=...)`: each call a `RedCodaToolEnv` over a new env of `env_id`,
    all of them searching through the first env's retriever (one index and query cache for every rollout).

    Args:
        env_id: A registered RedCoda id of the flat protocol.
        **env_kwargs: The env's arguments (``split``, ``retriever``, ``top_k``, ``max_turns``, ...).
    """
    first = gym.make(env_id, **env_kwargs)
    shared = {**env_kwargs, "retriever": first.unwrapped.retriever}
    made: list[gym.Env] = []

    def make() -> RedCodaToolEnv:
        env = first if not made else gym.make(env_id, **shared)
        made.append(env)
        return RedCodaToolEnv(env)

    return make


def tool_dataset(env: gym.Env, indices: Sequence[int] | None = None) -> Any:
    """A `datasets.Dataset` of the env's questions for environment mode: ``prompt`` (one user message: `TOOL_GUIDE`
    and the question), ``index`` (the question `RedCodaToolEnv.reset` plays) and ``golden_answers``.

    Args:
        env: A RAGEnv (wrapped or not).
        indices: Which questions (default: all).
    """
    from datasets import Dataset

    examples = env.unwrapped.examples
    chosen = [int(i) for i in (range(len(examples)) if indices is None else indices)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": TOOL_GUIDE + examples[i].question}] for i in chosen],
            "index": chosen,
            "golden_answers": [list(examples[i].answers) for i in chosen],
        }
    )
