"""RedCoda's env in SkyRL-gym: registered as ``"redcoda"`` in skyrl_gym's registry, with SkyRL's ``init``/``step``.

    pip install 'redcoda[skyrl]'
    import skyrl_gym
    import envs.frameworks.skyrl  # registers "redcoda" (import it where SkyRL builds its envs: your entry point)

    env = skyrl_gym.make("redcoda", env_config={"env_kwargs": {"split": "dev"}}, extras={"extra_info": {"index": 3}})
    chat, _ = env.init([])                                   # [system, user]: the env's instructions and question
    out = env.step("<search>Qazi Touqeer</search>")          # {"observations": [{"role": "user", ...}], ...}
    out = env.step("<answer>Kolkata</answer>")               # out["reward"] is the env's: 6*F1 - 3 + ...

One env is one episode (SkyRL makes one per trajectory): ``extras`` is the dataset row (``skyrl_rows`` writes rows
in SkyRL's layout), its ``extra_info.index`` the question; ``env_config`` (SkyRL's ``environment.skyrl_gym.redcoda``)
holds ``env_id`` and the `gym.make` arguments in ``env_kwargs``. Unlike skyrl-gym's own ``search`` env it needs no
retrieval server: the search runs on the env's retriever (BM25 over the bundled corpus; one index per process).
Flat protocol only: SkyRL keeps one conversation per trajectory, and a CoDA executor needs a context of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)
from envs.frameworks import jsonable, require
from envs.metrics import episode_metrics

require("skyrl_gym", "skyrl", __name__)

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from skyrl_gym.envs.registration import register, registry  # noqa: E402
from skyrl_gym.error import Error  # noqa: E402

SKYRL_ENV_ID = "redcoda"
"""The env_class SkyRL's dataset rows name."""


class EpisodeOver(Error):
    """A step on an env whose episode has ended (or never began): SkyRL makes a new env per trajectory."""


class RedCodaSkyRLEnv(BaseTextEnv):
    """One RAGEnv episode behind SkyRL-gym's text env interface.

    Args:
        env_config: ``env_id`` (a flat RedCoda id, default ``"RedCoda-HotpotQA-v0"``) and ``env_kwargs`` (`gym.make`
            arguments); a dict or SkyRL's DictConfig.
        extras: The dataset row: the question index at ``extra_info.index`` (or ``index``).

    Raises:
        ValueError: The env plays the CoDA protocol, or the row names no question.
        IndexError, TypeError: The question index is outside the split, or not an integer.
    """

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        config = dict(env_config or {})
        env_kwargs = dict(config.get("env_kwargs") or {})
        self.env = gym.make(config.get("env_id", "RedCoda-HotpotQA-v0"), disable_env_checker=True, **env_kwargs)
        if self.env.unwrapped.protocol != "flat":
            raise ValueError(
                "SkyRL keeps one conversation per trajectory: the flat protocol only (CoDA's executors "
                "need contexts of their own; use the OpenEnv server or agents.trl_interop for CoDA)"
            )
        extras = dict(extras or {})
        index = dict(extras.get("extra_info") or {}).get("index", extras.get("index"))
        if index is None:
            raise ValueError("the row names no question: give extras={'extra_info': {'index': i}} (see skyrl_rows)")
        from envs.rag_env import question_index

        self.index = question_index({"index": index}, self.env.unwrapped.num_examples)
        self.max_turns = self.env.unwrapped.max_turns
        self.chat_history: list[dict[str, str]] = []
        self.info: dict[str, Any] | None = None
        """The terminal info of the episode once it has ended (`get_metrics` reads it)."""
        self._started = self._done = False

    def init(self, prompt: Sequence[Mapping[str, str]] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Start the episode: the env's own system prompt and question replace the row's prompt (which SkyRL's data
        loader needs), so the model sees exactly what ``gym.make`` shows. Returns the messages and the reset info."""
        obs, info = self.env.reset(options={"index": self.index})
        self._started, self._done = True, False
        self.chat_history = [
            {"role": "system", "content": info["system_prompt"]},
            {"role": "user", "content": info["user_message"]},
        ]
        return list(self.chat_history), jsonable(info)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One turn: the env parses, searches and scores (a malformed action is an observation, as in ``gym.make``).

        Raises:
            EpisodeOver: `init` was not called, or the episode has ended.
        """
        if not self._started or self._done:
            raise EpisodeOver("the episode has ended; skyrl_gym.make a new env" if self._done else "call init() first")
        self.turns += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._done = bool(terminated or truncated)
        self.chat_history.append({"role": "assistant", "content": action})
        observations = [] if terminated else [{"role": "user", "content": obs}]
        self.chat_history.extend(observations)
        if self._done:
            self.info = info
        return BaseTextEnvStepOutput(
            observations=observations, reward=float(reward), done=self._done, metadata=jsonable(info)
        )

    def get_metrics(self) -> dict[str, Any]:
        """The episode's metrics (`envs.episode_metrics`), once it has ended."""
        return episode_metrics(self.info) if self.info is not None else {}

    def close(self) -> None:
        self.env.close()


def skyrl_rows(env_id: str = "RedCoda-HotpotQA-v0", indices: Sequence[int] | None = None, **env_kwargs: Any):
    """Dataset rows in SkyRL's layout (``prompt``, ``env_class``, ``reward_spec``, ``extra_info``), one per question;
    write them to parquet for SkyRL's data loader. The prompt is the env's (``init`` shows the same)."""
    env = gym.make(env_id, **env_kwargs).unwrapped
    chosen = range(env.num_examples) if indices is None else indices
    rows = []
    for index in chosen:
        _, info = env.reset(options={"index": int(index)})
        rows.append(
            {
                "data_source": f"redcoda/{env.dataset}",
                "prompt": [
                    {"role": "system", "content": info["system_prompt"]},
                    {"role": "user", "content": info["user_message"]},
                ],
                "env_class": SKYRL_ENV_ID,
                "reward_spec": {"method": "rule", "ground_truth": {"target": list(env.examples[int(index)].answers)}},
                "extra_info": {"index": int(index), "split": env.split, "id": info["id"]},
            }
        )
    return rows


if SKYRL_ENV_ID not in registry:
    register(id=SKYRL_ENV_ID, entry_point="envs.frameworks.skyrl:RedCodaSkyRLEnv")

__all__ = ["SKYRL_ENV_ID", "EpisodeOver", "RedCodaSkyRLEnv", "skyrl_rows"]
