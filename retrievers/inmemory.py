"""A small exact BM25 over a handful of passages, in pure Python.

Used for the env's "distractor" setting, where each question is searched only against its own ten
paragraphs: building a Lucene index per question would cost more than the episode. Same scoring as
Lucene's BM25 (Robertson IDF with +1, k1=0.9, b=0.4 by default), simple lower-case word tokens.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from retrievers.base import Passage
from retrievers.corpus import Corpus

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset("a an and are as at be by for from has he in is it its of on that the to was were will with".split())


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without common English stopwords."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class InMemoryBM25:
    """BM25 over passages held in memory.

    Each term's postings hold the passages with the term and their BM25 contributions, so a query costs the
    length of its terms' postings (one numpy `bincount`), not a pass over the corpus: fast enough to search a
    pooled corpus of tens of thousands of paragraphs where no JVM is at hand (`retriever="bm25-python"`). Its
    ranking is not Lucene's: words are not stemmed and the stopword list is shorter.

    Args:
        passages: (doc_id, title, text) triples; the title is indexed with the text.
        k1, b: BM25 parameters.
    """

    def __init__(self, passages: Sequence[tuple[str, str, str]], k1: float = 0.9, b: float = 0.4) -> None:
        self.passages = list(passages)
        self.k1, self.b = k1, b
        tfs = [Counter(tokenize(f"{title} {text}")) for _, title, text in self.passages]
        lengths = [sum(tf.values()) for tf in tfs]
        avg = (sum(lengths) / len(lengths)) if lengths else 0.0
        norm = np.array([k1 * (1 - b + b * n / (avg or 1.0)) for n in lengths])  # (passages,)
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for i, tf in enumerate(tfs):
            for term, count in tf.items():
                rows, counts = postings.setdefault(term, ([], []))
                rows.append(i)
                counts.append(count)
        n = len(self.passages)
        # per term: the passages that hold it and each one's BM25 contribution, idf * tf * (k1 + 1) / (tf + norm)
        self._postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for term, (rows, counts) in postings.items():
            idf = math.log(1 + (n - len(rows) + 0.5) / (len(rows) + 0.5))
            tf, at = np.array(counts, dtype=np.float64), np.array(rows, dtype=np.int64)
            self._postings[term] = (at, idf * tf * (k1 + 1) / (tf + norm[at]))

    @classmethod
    def for_corpus(cls, corpus: Corpus, k1: float = 0.9, b: float = 0.4) -> InMemoryBM25:
        """The process-wide shared index of this corpus (built on first use: seconds for the bundled one)."""
        key = (corpus.fingerprint, k1, b)
        if key not in _SHARED:
            _SHARED[key] = cls(list(zip(corpus.doc_ids, corpus.titles, corpus.texts, strict=True)), k1=k1, b=b)
        return _SHARED[key]

    def search(self, query: str, k: int) -> list[Passage]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        # a repeated query term counts again, as in the sum over query terms; bincount adds each passage's
        # contributions in query-term order, in float64
        hits = [self._postings[t] for t in tokenize(query) if t in self._postings]
        if not hits:
            return []
        scores = np.bincount(
            np.concatenate([at for at, _ in hits]), np.concatenate([w for _, w in hits]), minlength=len(self.passages)
        )
        found = np.flatnonzero(scores > 0)
        best = found[np.lexsort((found, -scores[found]))[:k]]  # highest score first, ties by passage order
        return [Passage(*self.passages[i], float(scores[i])) for i in best.tolist()]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]


_SHARED: dict[tuple[str, float, float], InMemoryBM25] = {}
