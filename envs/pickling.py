"""Envs that are built where they run, never pickled: what pickling one says instead.

An env holds live resources: its retriever (a Lucene searcher in a JVM, a FAISS index, an HTTP client), locks and
caches shared with the other envs of the process. None of them crosses a process boundary, so a worker builds its own
env from the id and arguments, as ``gym.make_vec(..., vectorization_mode="async")`` and ``AsyncVectorEnv`` do (they
send the function that makes the env, not the env).
"""

from __future__ import annotations

from typing import Any, NoReturn


class BuiltInWorker:
    """A mixin for env classes: pickling (or deep-copying) one raises a one-line TypeError that says how to build the
    env in a worker instead of Python's message about a searcher's ``__cinit__`` or a thread lock."""

    def __getstate__(self) -> NoReturn:
        spec: Any = getattr(self, "spec", None)
        env_id = spec.id if spec is not None else "RedCoda-HotpotQA-v0"
        raise TypeError(
            f"{type(self).__name__} holds live resources (its retriever, locks, caches) and is not pickled: build the "
            f'env in the worker, e.g. send `lambda: gym.make("{env_id}", **kwargs)` (what gym.make_vec(..., '
            'vectorization_mode="async") and AsyncVectorEnv do)'
        )
