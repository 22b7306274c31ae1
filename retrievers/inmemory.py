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

from retrievers.base import Passage

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset("a an and are as at be by for from has he in is it its of on that the to was were will with".split())


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without common English stopwords."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class InMemoryBM25:
    """BM25 over passages held in memory.

    Args:
        passages: (doc_id, title, text) triples; the title is indexed with the text.
        k1, b: BM25 parameters.
    """

    def __init__(self, passages: Sequence[tuple[str, str, str]], k1: float = 0.9, b: float = 0.4) -> None:
        self.passages = list(passages)
        self.k1, self.b = k1, b
        self._tf = [Counter(tokenize(f"{title} {text}")) for _, title, text in self.passages]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = (sum(self._len) / len(self._len)) if self._len else 0.0
        df = Counter(term for tf in self._tf for term in tf)
        n = len(self.passages)
        self._idf = {term: math.log(1 + (n - d + 0.5) / (d + 0.5)) for term, d in df.items()}

    def search(self, query: str, k: int) -> list[Passage]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = [t for t in tokenize(query) if t in self._idf]
        scored = []
        for i, tf in enumerate(self._tf):
            norm = self.k1 * (1 - self.b + self.b * self._len[i] / (self._avg or 1.0))
            score = sum(self._idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in terms if t in tf)
            if score > 0:
                scored.append((score, i))
        scored.sort(key=lambda pair: (-pair[0], pair[1]))
        return [Passage(self.passages[i][0], self.passages[i][1], self.passages[i][2], s) for s, i in scored[:k]]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]
