"""Batched searches for envs that step together: one `batch_search` per shared retriever per turn.

Each env's `step` searches on its own (one call, one HTTP request to a server, per env per turn). Envs built
from a retriever name or URL share one retriever behind an LRU cache (``query_cache``, on by default), so an
agent that steps many envs at once first sends the searches they are about to make in one batch, and each
env's own search is then answered from the cache::

    import gymnasium as gym, envs
    from envs.batching import prefetch_searches

    vec = gym.make_vec("RedCoda-HotpotQA-v0", num_envs=8, vectorization_mode="sync")
    ...
    prefetch_searches(vec.envs, actions)      # one batch_search for the 8 envs' searches
    obs, rewards, terminated, truncated, infos = vec.step(actions)

The env's contract is untouched (`step` does what it always did; a failed batch is ignored, and each env's own
search then meets the fault and reports it as its observation). The agents' batched rollouts
(`agents.search_agents.ContextAgent`, and through them the rollout collector's G envs per question) call this
every turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrievers.cached import CachedRetriever


def prefetch_searches(envs: Sequence[Any], actions: Sequence[str]) -> int:
    """Send the searches that ``env.step(action)`` is about to make, for every pair, to their retrievers in one
    `batch_search` per (cached retriever, k).

    Envs that would not search, search their own paragraphs (corpus="distractor"), or whose retriever keeps no
    cache (its env would search again) are left to their own `step`.

    Args:
        envs: the envs about to step (Gymnasium wrappers or not).
        actions: the action each env is about to be stepped with.

    Returns:
        The number of `batch_search` calls made.
    """
    pending: dict[tuple[int, int], tuple[CachedRetriever, int, list[str]]] = {}
    for env, action in zip(envs, actions, strict=True):
        request = getattr(getattr(env, "unwrapped", env), "search_request", None)
        found = request(action) if callable(request) else None
        if found is None or not isinstance(found[0], CachedRetriever):
            continue
        retriever, query, k = found
        pending.setdefault((id(retriever), k), (retriever, k, []))[2].append(query)
    for retriever, k, queries in pending.values():
        try:
            retriever.batch_search(queries, k)
        except Exception:  # each env's own search meets the same fault and reports it to its agent
            pass
    return len(pending)
