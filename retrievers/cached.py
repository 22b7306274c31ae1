"""An LRU query cache in front of any retriever.

GRPO samples G rollouts of one question, which often issue the same search; `CachedRetriever` answers the
repeats from memory and sends only the misses (deduplicated) to the wrapped retriever in one batch::

    from retrievers.cached import CachedRetriever
    retriever = CachedRetriever(BM25Retriever.for_corpus(corpus), maxsize=100_000)

Entries are keyed by (query, k). Thread-safe: the cache is guarded by a lock that is never held while the
wrapped retriever runs, so two threads missing the same query at once may both compute it (same answer).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from retrievers.base import Passage, Retriever, SharedIndex


class CachedRetriever(SharedIndex):
    """A thread-safe LRU cache of `inner`'s results.

    Args:
        inner: the retriever to wrap.
        maxsize: how many (query, k) results to keep; the least recently used is evicted first.
    """

    def __init__(self, inner: Retriever, maxsize: int = 100_000) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.inner = inner
        self.maxsize = maxsize
        self.hits = 0
        """Queries answered without calling `inner` (repeats inside one batch included)."""
        self.misses = 0
        """Queries sent to `inner`."""
        self._entries: OrderedDict[tuple[str, int], tuple[Passage, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry and reset the hit/miss counters."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def search(self, query: str, k: int) -> list[Passage]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        found: dict[str, tuple[Passage, ...]] = {}
        with self._lock:
            for query in queries:
                entry = self._entries.get((query, k))
                if entry is not None:
                    self._entries.move_to_end((query, k))
                    found[query] = entry
            misses = list(dict.fromkeys(q for q in queries if q not in found))  # unique, in order
            self.misses += len(misses)  # queries sent to `inner`; everything else was answered from memory
            self.hits += len(queries) - len(misses)
        if misses:
            fresh = self.inner.batch_search(misses, k)
            if len(fresh) != len(misses):
                raise RuntimeError(
                    f"{type(self.inner).__name__} returned {len(fresh)} results for {len(misses)} queries"
                )
            with self._lock:
                for query, passages in zip(misses, fresh, strict=True):
                    found[query] = self._entries[(query, k)] = tuple(passages)
                    self._entries.move_to_end((query, k))
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
        return [list(found[query]) for query in queries]
