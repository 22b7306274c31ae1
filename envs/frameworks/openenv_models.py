"""The Action, Observation and State types of RedCoda's OpenEnv server, as openenv-core defines them (pydantic).

One action is the model's text for one turn, in the env's tag protocol; one observation is what the env says back,
with whose turn is next (``role``) and whether that turn starts a fresh context (``new_context``: CoDA's executor).
"""

from __future__ import annotations

from typing import Any

from envs.frameworks import require

require("openenv", "openenv")

from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

MAX_ACTION_CHARS = 1 << 20
"""The longest action text the server accepts (the env's action space); a longer one is a validation error. Actions
up to this bound but over the env's ``max_action_chars`` are the env's business: an invalid-action observation."""


class RedCodaAction(Action):
    """The model's text for one turn: ``<think>..</think><search>query</search>``, ``<answer>..</answer>``, a CoDA
    planner's ``<task>sub-question</task>``."""

    text: str = Field(..., max_length=MAX_ACTION_CHARS, description="The action text, in the env's tag protocol")


class RedCodaObservation(Observation):
    """What the env said this turn (``done`` and ``reward`` as OpenEnv has them: the episode reward on the last step).

    ``info`` is the env's info dict as JSON carries it: on the last step every reward component (em, f1, format,
    refine, recall, num_searches, ...), the same keys and values as ``gym.make`` gives.
    """

    text: str = Field(default="", description="The env's reply: instructions and question, search results, a result")
    role: str = Field(default="agent", description="Whose turn is next: agent (flat), planner or executor (coda)")
    new_context: bool = Field(default=False, description="The next turn starts a fresh context (reset, an executor)")
    terminated: bool = Field(default=False, description="The agent or planner answered")
    truncated: bool = Field(default=False, description="A turn limit ended the episode")
    info: dict[str, Any] = Field(default_factory=dict, description="The env's info dict (JSON-safe)")


class RedCodaState(State):
    """One session's episode: its question, whose turn it is, and what the session did (nothing of other sessions)."""

    env_id: str = Field(default="", description="The registered id the session's env was made from")
    protocol: str = Field(default="flat", description="flat or coda")
    index: int | None = Field(default=None, description="The question's index in the split (None before a reset)")
    question: str = Field(default="", description="The episode's question")
    role: str = Field(default="agent", description="Whose turn is next")
    done: bool = Field(default=False, description="The episode has ended")
    actions: list[str] = Field(default_factory=list, description="This episode's actions, in order")
    cache_entries: int = Field(default=0, description="Search results in this session's own query cache")


__all__ = ["MAX_ACTION_CHARS", "RedCodaAction", "RedCodaObservation", "RedCodaState"]
