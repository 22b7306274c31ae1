"""BM25 held in memory, without a JVM: the `bm25s` package behind the `Retriever` protocol.

Two uses: the env's `retriever="bm25-python"` over a pooled corpus where no JDK is at hand (a GPU image), and
the env's "distractor" setting, where each question is searched only against its own ten paragraphs (a Lucene
index per question would cost more than the episode). Scoring is Lucene's BM25 (`bm25s` method "lucene":
idf = log(1 + (N - df + 0.5) / (df + 0.5)), tf / (tf + k1 * (1 - b + b * len / avglen)); k1=0.9, b=0.4 as
Pyserini's defaults) over Lucene's English analysis as `bm25s` ships it: lower-cased word tokens, Lucene's 33
English stopwords, and the Snowball English stemmer (PyStemmer) where it is installed (Lucene's
EnglishAnalyzer stems with Porter's; without PyStemmer words are not stemmed).
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np

from retrievers.base import Passage
from retrievers.corpus import Corpus


def _import_bm25s() -> ModuleType:
    """`bm25s`, imported without starting JAX.

    Where JAX is installed, bm25s's top-k module imports it and runs one `jax.lax.top_k` at import time. That starts
    JAX's default backend, and on a GPU JAX then takes 75% of the GPU's memory for itself: a trainer that searched
    with this retriever ran out of memory with 25 GiB in PyTorch's hands and over 100 in JAX's. This class ranks with
    numpy and never calls that top-k, so JAX stays hidden while bm25s is imported (and importable afterwards).
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hidden = {name: sys.modules.get(name) for name in ("jax", "jax.lax")}
    sys.modules.update(dict.fromkeys(hidden))  # None in sys.modules: `import jax.lax` raises ImportError
    try:
        return importlib.import_module("bm25s")
    finally:
        for name, module in hidden.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


bm25s = _import_bm25s()
STOPWORDS_EN = bm25s.stopwords.STOPWORDS_EN

_WORD = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(STOPWORDS_EN)


@functools.cache
def _stemmer() -> Callable[[str], str] | None:
    try:
        import Stemmer
    except ImportError:
        return None
    return functools.lru_cache(maxsize=1 << 20)(Stemmer.Stemmer("english").stemWord)


def tokenize(text: str) -> list[str]:
    """The index's terms of a text: lower-cased word tokens without Lucene's English stopwords, stemmed."""
    stem = _stemmer()
    words = [w for w in _WORD.findall(text.lower()) if w not in _STOP]
    return [stem(w) for w in words] if stem is not None else words


class InMemoryBM25:
    """BM25 over passages held in memory (`bm25s`: a sparse matrix of each term's precomputed scores).

    A query costs its terms' postings, not a pass over the corpus: tens of thousands of questions a second over
    the bundled corpus. Only passages that hold a query term are returned, best first, ties in passage order.

    Args:
        passages: (doc_id, title, text) triples; the title is indexed with the text.
        k1, b: BM25 parameters.
    """

    def __init__(self, passages: Sequence[tuple[str, str, str]], k1: float = 0.9, b: float = 0.4) -> None:
        self.passages = list(passages)
        self.k1, self.b = k1, b
        self._bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
        if self.passages:
            self._bm25.index([tokenize(f"{title} {text}") for _, title, text in self.passages], show_progress=False)

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
        terms = [t for t in tokenize(query) if t in self._bm25.vocab_dict] if self.passages else []
        if not terms:
            return []
        scores = self._bm25.get_scores(terms)  # (passages,); a repeated query term counts again
        found = np.flatnonzero(scores > 0)
        best = found[np.lexsort((found, -scores[found]))[:k]]  # highest score first, ties by passage order
        return [Passage(*self.passages[i], float(scores[i])) for i in best.tolist()]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]


_SHARED: dict[tuple[str, float, float], InMemoryBM25] = {}
