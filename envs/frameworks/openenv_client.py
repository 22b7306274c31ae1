"""The client of RedCoda's OpenEnv server, in openenv-core's own style (an `EnvClient` over one WebSocket session).

    from envs.frameworks.openenv_client import RedCodaAction, RedCodaEnv

    with RedCodaEnv(base_url="http://127.0.0.1:8000").sync() as env:   # or `async with RedCodaEnv(...)`
        result = env.reset(index=3)              # question 3 of the server's split
        result = env.step(RedCodaAction(text="<search>Qazi Touqeer</search>"))
        result = env.step(RedCodaAction(text="<answer>Kolkata</answer>"))
        result.reward, result.done, result.observation.info["f1"]    # 3.1, True, 1.0

Start the server with ``python -m envs.frameworks.openenv_server``. Each client is its own session on the server
(its own env, episode and query cache). A server-side error (an unknown question, a step after the episode ended,
an action over the length bound) raises openenv-core's ``RuntimeError("Server error: ... (code: ...)")`` here and
leaves the session open for the next reset.
"""

from __future__ import annotations

from typing import Any

from envs.frameworks import require

require("openenv", "openenv")

from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_client import EnvClient  # noqa: E402

from envs.frameworks.openenv_models import RedCodaAction, RedCodaObservation, RedCodaState  # noqa: E402


class RedCodaEnv(EnvClient[RedCodaAction, RedCodaObservation, RedCodaState]):
    """One session on a RedCoda OpenEnv server (async; ``.sync()`` for a synchronous wrapper).

    ``reset(index=i, seed=s)`` starts an episode; ``step(RedCodaAction(text=...))`` acts; ``state()`` is the
    session's `RedCodaState` (its question, role, actions and cache size).
    """

    def _step_payload(self, action: RedCodaAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[RedCodaObservation]:
        observation = RedCodaObservation(
            **payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward")
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> RedCodaState:
        return RedCodaState(**payload)


__all__ = ["RedCodaAction", "RedCodaEnv", "RedCodaObservation", "RedCodaState"]
