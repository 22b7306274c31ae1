"""Hybrid retrieval: reciprocal-rank fusion (RRF, Cormack et al. 2009) of several retrievers, BM25 + dense by default.

A passage's fused score is `sum_r weight_r / (rrf_k + rank_r)` over the retrievers r that return it within
their top `depth` (rank 1 is best); ties keep the order of first appearance. Scores are therefore rank-based
and comparable only within one query::

    from retrievers.hybrid import HybridRetriever
    hybrid = HybridRetriever.for_corpus(corpus)            # shared BM25 + shared dense (MiniLM), equal weights
    hybrid = HybridRetriever([bm25, dense], weights=[1.0, 0.5], rrf_k=60, depth=50)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from retrievers.base import Passage, Retriever, SharedIndex
from retrievers.corpus import Corpus

_SHARED: dict[str, HybridRetriever] = {}
_SHARED_LOCK = threading.Lock()


def rrf_fuse(rankings: Sequence[list[Passage]], weights: Sequence[float], rrf_k: float, k: int) -> list[Passage]:
    """Fuse ranked lists by weighted reciprocal rank; returns the top `k` with their fused scores."""
    scores: dict[str, float] = {}
    first: dict[str, Passage] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        if weight == 0:  # a switched-off retriever adds no candidates either
            continue
        for rank, passage in enumerate(ranking, 1):
            scores[passage.doc_id] = scores.get(passage.doc_id, 0.0) + weight / (rrf_k + rank)
            first.setdefault(passage.doc_id, passage)
    best = sorted(scores, key=scores.__getitem__, reverse=True)[:k]  # stable: ties keep first appearance
    return [Passage(doc_id, first[doc_id].title, first[doc_id].text, scores[doc_id]) for doc_id in best]


class HybridRetriever(SharedIndex):
    """Reciprocal-rank fusion of retrievers over the same corpus (doc ids must agree).

    Args:
        retrievers: the retrievers to fuse, e.g. `[bm25, dense]`.
        weights: one non-negative weight per retriever (default all 1).
        rrf_k: the RRF constant; larger values flatten the bonus of top ranks (60 in the RRF paper).
        depth: how many hits each retriever contributes before fusion (at least k is always used).
    """

    def __init__(
        self,
        retrievers: Sequence[Retriever],
        weights: Sequence[float] | None = None,
        rrf_k: float = 60.0,
        depth: int = 50,
    ) -> None:
        if not retrievers:
            raise ValueError("HybridRetriever needs at least one retriever")
        weights = [1.0] * len(retrievers) if weights is None else [float(w) for w in weights]
        if len(weights) != len(retrievers) or any(w < 0 for w in weights) or not any(weights):
            raise ValueError(
                f"need one non-negative weight per retriever (not all 0), got {weights} for {len(retrievers)}"
            )
        if rrf_k < 0 or depth < 1:
            raise ValueError(f"rrf_k must be >= 0 and depth >= 1, got {rrf_k}, {depth}")
        self.retrievers = list(retrievers)
        self.weights = weights
        self.rrf_k = rrf_k
        self.depth = depth

    @classmethod
    def for_corpus(cls, corpus: Corpus) -> HybridRetriever:
        """The process-wide shared BM25 + dense (all-MiniLM-L6-v2, flat) fusion for this corpus."""
        from retrievers.bm25 import BM25Retriever
        from retrievers.dense import DenseRetriever

        with _SHARED_LOCK:
            if corpus.fingerprint not in _SHARED:
                _SHARED[corpus.fingerprint] = cls([BM25Retriever.for_corpus(corpus), DenseRetriever.for_corpus(corpus)])
            return _SHARED[corpus.fingerprint]

    def search(self, query: str, k: int) -> list[Passage]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        depth = max(self.depth, k)
        active = [(r, w) for r, w in zip(self.retrievers, self.weights, strict=True) if w > 0]
        per_retriever = [r.batch_search(queries, depth) for r, _ in active]  # each (len(queries), <=depth)
        weights = [w for _, w in active]
        return [rrf_fuse([hits[q] for hits in per_retriever], weights, self.rrf_k, k) for q in range(len(queries))]
