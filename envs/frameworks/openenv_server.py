"""RedCoda's env as an OpenEnv server: reset/step/state over openenv-core's HTTP and WebSocket protocol.

    pip install 'redcoda[openenv]'
    python -m envs.frameworks.openenv_server                      # flat protocol, 127.0.0.1:8000
    python -m envs.frameworks.openenv_server --protocol coda --port 8001 --split dev

Each WebSocket session (one `envs.frameworks.openenv_client.RedCodaEnv`) gets its own RAGEnv, episode and query
cache; every session searches one shared index (built once per server). ``reset(index=i)`` asks question i (omit
it to draw one with the seed); a step's observation carries the env's text, reward, ``role``, ``new_context`` and
info, so the CoDA protocol's roles and executor contexts are visible to the client. Bad input is answered in
openenv-core's style (a validation or execution error on that session; the client raises it) and the server keeps
serving: an action over the env's action space, an unknown question, a step after the episode ended. A dropped
client's session is closed with its connection. ``--host`` defaults to 127.0.0.1: pass 0.0.0.0 only on a network
you trust (nothing authenticates a client).
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)
from envs.frameworks import jsonable, require

require("openenv", "openenv", __name__)

from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import EnvironmentMetadata  # noqa: E402

from envs.frameworks.openenv_models import RedCodaAction, RedCodaObservation, RedCodaState  # noqa: E402

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServerSettings:
    """What every session's env is made with."""

    env_id: str = "RedCoda-HotpotQA-v0"
    """A registered RAGEnv id."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of `gym.make` (protocol, split, top_k, max_turns, ...)."""
    session_cache: int = 1024
    """Size of each session's own LRU query cache (0: none); sessions never share cache entries."""


@functools.lru_cache(maxsize=4)
def shared_index(env_id: str, kwargs_json: str) -> Any:
    """The index every session of a server searches: the env's retriever without a query cache, built once."""
    kwargs = {**json.loads(kwargs_json), "query_cache": 0}
    return gym.make(env_id, **kwargs).unwrapped.retriever


class RedCodaEnvironment(Environment[RedCodaAction, RedCodaObservation, RedCodaState]):
    """One session: a RAGEnv of `settings` over the shared index, behind the session's own query cache.

    Args:
        settings: The env every session plays (id, arguments, cache size).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # no mutable state is shared: each session its own env, episode and cache

    def __init__(self, settings: ServerSettings = ServerSettings()) -> None:
        super().__init__()
        self.settings = settings
        kwargs = dict(settings.env_kwargs)
        retriever = kwargs.pop("retriever", None)
        if kwargs.get("corpus") != "distractor" and (retriever is None or isinstance(retriever, str)):
            index_kwargs = {**kwargs, **({"retriever": retriever} if retriever is not None else {})}
            retriever = shared_index(settings.env_id, json.dumps(index_kwargs, sort_keys=True))
            if settings.session_cache > 0:
                from retrievers.cached import CachedRetriever

                retriever = CachedRetriever(retriever, maxsize=settings.session_cache)
        self._cache = retriever if hasattr(retriever, "hits") else None  # a CachedRetriever: the session's own
        # no passive checker: gymnasium 1.4's fails every later step of an env whose first step raised (a client's
        # step before its reset), and a server must outlive its clients' mistakes
        shared = {"retriever": retriever} if retriever is not None else {}
        self.env = gym.make(settings.env_id, disable_env_checker=True, **kwargs, **shared)
        self._state = RedCodaState(env_id=settings.env_id, protocol=self.env.unwrapped.protocol)
        self._lock = threading.Lock()  # the HTTP routes and a session's executor may call one env from two threads

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, index: int | None = None, **kwargs: Any
    ) -> RedCodaObservation:
        """Start an episode on question `index` (or one drawn with `seed`).

        Raises:
            TypeError: `index` is not an integer; ValueError: unknown reset arguments.
            IndexError: `index` is outside the split.
        """
        if kwargs:
            raise ValueError(f"unknown reset arguments {sorted(kwargs)}; RedCoda's reset takes seed, episode_id, index")
        with self._lock:
            obs, info = self.env.reset(seed=seed, options=None if index is None else {"index": index})
            self._state = RedCodaState(
                episode_id=episode_id or str(uuid.uuid4()),
                step_count=0,
                env_id=self.settings.env_id,
                protocol=self.env.unwrapped.protocol,
                index=info["index"],
                question=info["question"],
                role=info["role"],
                cache_entries=self._cache_entries(),
            )
            return RedCodaObservation(text=obs, role=info["role"], new_context=True, info=jsonable(info), reward=None)

    def step(self, action: RedCodaAction, timeout_s: float | None = None, **kwargs: Any) -> RedCodaObservation:
        """Act for the role whose turn it is (the env's own rules: a malformed action is an observation).

        Raises:
            gymnasium.error.ResetNeeded: No episode is running (before a reset, or after the episode ended).
        """
        with self._lock:
            obs, reward, terminated, truncated, info = self.env.step(action.text)
            state = self._state
            state.step_count += 1
            state.actions = [*state.actions, action.text]
            state.role, state.done = info["role"], bool(terminated or truncated)
            state.cache_entries = self._cache_entries()
            return RedCodaObservation(
                text=obs,
                role=info["role"],
                new_context=bool(info.get("new_context", False)),
                terminated=bool(terminated),
                truncated=bool(truncated),
                info=jsonable(info),
                reward=float(reward),
                done=bool(terminated or truncated),
            )

    @property
    def state(self) -> RedCodaState:
        return self._state

    def _cache_entries(self) -> int:
        return len(self._cache) if self._cache is not None else 0

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name=self.settings.env_id,
            description="Multi-hop question answering by search (RedCoda's RAGEnv): text actions in a tag protocol, "
            "the official HotpotQA F1/EM reward.",
            version="0.1.0",
        )

    def close(self) -> None:
        self.env.close()


def create_redcoda_app(settings: ServerSettings = ServerSettings(), max_sessions: int = 64) -> Any:
    """The FastAPI app of the server (openenv-core's `create_app` over `RedCodaEnvironment`); run it with uvicorn."""
    RedCodaEnvironment(settings).close()  # builds the shared index now, not on the first client's reset
    factory = functools.partial(RedCodaEnvironment, settings)
    return create_app(factory, RedCodaAction, RedCodaObservation, env_name="redcoda", max_concurrent_envs=max_sessions)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m envs.frameworks.openenv_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--env-id", default="RedCoda-HotpotQA-v0", help="a registered RAGEnv id")
    parser.add_argument("--protocol", choices=("flat", "coda"), default=None, help="the id's protocol unless given")
    parser.add_argument("--split", default=None, help="the bundled split (default: the id's)")
    parser.add_argument("--env-kwargs", default="{}", help="other gym.make arguments as JSON, e.g. '{\"top_k\": 5}'")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent WebSocket sessions")
    parser.add_argument("--session-cache", type=int, default=1024, help="each session's query cache size (0: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until interrupted."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        env_kwargs = json.loads(args.env_kwargs)
        if not isinstance(env_kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        parser.error(f"--env-kwargs: {err}")
    for name in ("protocol", "split"):
        if getattr(args, name) is not None:
            env_kwargs[name] = getattr(args, name)
    if args.max_sessions < 1 or args.session_cache < 0:
        parser.error("--max-sessions must be >= 1 and --session-cache >= 0")
    import uvicorn

    settings = ServerSettings(args.env_id, env_kwargs, args.session_cache)
    app = create_redcoda_app(settings, args.max_sessions)
    print(f"RedCoda OpenEnv server ({args.env_id}, {env_kwargs}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
