"""Lucene's BM25, scored for a whole batch of queries at once as one sparse matrix product.

Lucene scores a query one posting list at a time; its CPU cost per query is the same whether the queries
come one by one or in a `batch_search` (the threads of a batch only help when cores are free). Here the
same scores are computed for many queries in one sparse product: every posting of a Lucene index is
turned once into its BM25 contribution, laid out as a (terms x documents) CSR matrix `W`, and a batch of
analyzed queries becomes a (queries x terms) matrix `Q` of term counts, so `Q @ W` holds every query's
score for every document it matches (the approach of the bm25s library, here fed from Lucene's own
index so the numbers are Lucene's).

`BM25Matrix` says what makes the numbers Lucene's, and not just "a BM25";
`tests/test_retrievers_bm25_matrix.py` checks top-k lists and scores against `LuceneSearcher.search`.

Memory: 12 bytes per posting (float64 value, int32 column; the sizes for the bundled corpus and for wiki-18 are in
docs/results/retrieval.md), and a batch's score matrix holds one entry per (query, matching document). It is
meant for corpora up to a few million passages; over wiki-18 use the Lucene engine.
The matrix is cached on disk beside the other indexes, keyed by the index and (k1, b).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from retrievers.corpus import cache_root
from retrievers.files import atomic_file
from retrievers.jvm import JAVA_LOCK, start_jvm

_NO_MORE_DOCS = 2**31 - 1  # Lucene's DocIdSetIterator.NO_MORE_DOCS
_FIELD = "contents"


class BM25Matrix:
    """Every posting of a Lucene index as its BM25 contribution, for batched scoring.

    Build with `BM25Matrix.from_lucene(index_dir)` (cached on disk).

    What makes the numbers Lucene's, and not just "a BM25":
    - term frequencies, document frequencies, the field's document count and total length, and each
      document's length norm are read from the Lucene index itself (its postings and norms);
    - a length norm is the one-byte value Lucene stores, decoded with Lucene's own `SmallFloat.byte4ToInt`,
      so long documents get the same lossy length Lucene uses;
    - the per-posting contribution follows `BM25Similarity` (Lucene 9): idf = ln(1 + (N - df + 0.5) / (df +
      0.5)), contribution = idf - idf / (1 + tf / (k1 * (1 - b + b * dl / avgdl))), in float32 as Lucene
      computes it, summed over query terms in float64 and rounded to float32 (as Lucene's disjunction
      scorers sum);
    - a query is analyzed by the same Lucene analyzer Pyserini's `LuceneSearcher` uses by default (English,
      Porter stemming, stopwords), and a term that occurs n times weighs n, as Anserini's bag-of-words
      query builder boosts it;
    - ties are broken by the document's collection id, ascending, as Anserini sorts hits, and scores are
      rounded and tie-adjusted as Anserini reports them.
    `tests/test_retrievers_bm25_matrix.py` checks them on the bundled dev questions and on queries where these
    details matter.

    Attributes:
        doc_ids: collection id of each column, in Lucene's internal document order.
        vocab: analyzed term -> row of `weights`.
        weights: (terms x documents) CSR matrix of BM25 contributions of one query-term occurrence.
    """

    def __init__(self, doc_ids: Sequence[str], vocab: dict[str, int], weights) -> None:
        import scipy.sparse as sp

        if weights.shape != (len(vocab), len(doc_ids)):
            raise ValueError(f"weights shape {weights.shape} != ({len(vocab)} terms, {len(doc_ids)} documents)")
        self.doc_ids = list(doc_ids)
        self.vocab = vocab
        self.weights = sp.csr_matrix(weights, dtype=np.float64)
        # Rank of each column's collection id, to break score ties as Anserini does (by id, ascending).
        self._id_rank = np.empty(len(self.doc_ids), np.int64)
        self._id_rank[np.argsort(np.array(self.doc_ids, dtype=object), kind="stable")] = np.arange(len(self.doc_ids))
        self._analyzer = None
        self._separator = ""
        self.redone = 0
        """Queries whose candidates did not suffice and were ranked one by one (for tuning and tests)."""

    @classmethod
    def from_lucene(cls, index_dir: str | os.PathLike, k1: float = 0.9, b: float = 0.4, cache: bool = True):
        """Read `index_dir`'s postings and norms and compute BM25(k1, b) contributions (cached on disk)."""
        index_dir = Path(index_dir).resolve()
        segments = sorted(p.name for p in index_dir.glob("segments_*"))
        if not segments:
            raise FileNotFoundError(f"no Lucene index at {index_dir}")
        key = hashlib.sha1(f"{index_dir}|{segments[-1]}|{k1!r}|{b!r}".encode()).hexdigest()[:16]
        cached = cache_root() / "bm25_matrix" / f"{key}.npz"
        if cache and cached.exists():
            return cls._load(cached)
        start_jvm()
        with JAVA_LOCK:
            doc_ids, vocab, weights = _read_lucene(index_dir, k1, b)
        matrix = cls(doc_ids, vocab, weights)
        if cache:
            matrix._save(cached)
        return matrix

    def _save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        terms = sorted(self.vocab, key=self.vocab.__getitem__)
        with atomic_file(path) as tmp:  # readers see the old file or the whole new one, never half of it
            np.savez(
                tmp,
                doc_ids=np.array(self.doc_ids, dtype=str),
                terms=np.array(terms, dtype=str),
                data=self.weights.data,
                indices=self.weights.indices,
                indptr=self.weights.indptr,
            )

    @classmethod
    def _load(cls, path: Path) -> BM25Matrix:
        import scipy.sparse as sp

        with np.load(path, allow_pickle=False) as f:
            doc_ids, terms = f["doc_ids"].tolist(), f["terms"].tolist()
            weights = sp.csr_matrix((f["data"], f["indices"], f["indptr"]), shape=(len(terms), len(doc_ids)))
        return cls(doc_ids, {term: i for i, term in enumerate(terms)}, weights)

    def analyze(self, query: str) -> list[str]:
        """The query's terms as Pyserini's default `LuceneSearcher` analyzes them."""
        return self.analyze_batch([query])[0]

    def analyze_batch(self, queries: Sequence[str]) -> list[list[str]]:
        """Analyze many queries with one call into Java: joined by a separator word, split after.

        The analyzer's tokenizer never joins words across whitespace and its filters see one token at a
        time, so the joined text's tokens are the queries' tokens in order. If a query itself contains the
        separator, the count does not add up and each query is analyzed on its own.
        """
        if self._analyzer is None:
            start_jvm()  # once, before the lock (start_jvm's own lock is always taken first)
        with JAVA_LOCK:
            if self._analyzer is None:
                from pyserini.analysis import Analyzer, get_lucene_analyzer

                self._analyzer = Analyzer(get_lucene_analyzer())
                (self._separator,) = self._analyzer.analyze(_SEPARATOR)
            if len(queries) == 1:
                return [list(self._analyzer.analyze(queries[0]))]
            tokens = self._analyzer.analyze(f" {_SEPARATOR} ".join(queries))
        out: list[list[str]] = [[]]
        for token in tokens:
            if token == self._separator:
                out.append([])
            else:
                out[-1].append(token)
        if len(out) != len(queries):
            with JAVA_LOCK:
                return [list(self._analyzer.analyze(query)) for query in queries]
        return out

    def query_matrix(self, queries: Sequence[str]):
        """(queries x terms) CSR matrix of term counts; terms the index lacks are dropped (they score 0)."""
        import scipy.sparse as sp

        rows, cols, counts = [], [], []
        for row, terms in enumerate(self.analyze_batch(queries)):
            seen: dict[int, int] = {}
            for term in terms:
                col = self.vocab.get(term)
                if col is not None:
                    seen[col] = seen.get(col, 0) + 1
            rows.extend([row] * len(seen))
            cols.extend(seen)
            counts.extend(seen.values())
        return sp.csr_matrix(
            (np.asarray(counts, np.float64), (np.asarray(rows, np.int64), np.asarray(cols, np.int64))),
            shape=(len(queries), len(self.vocab)),
        )

    def top_k(self, queries: Sequence[str], k: int, threads: int = 1) -> list[list[tuple[int, float]]]:
        """For each query, up to k (column, score) pairs, best first; documents matching no term are left out.

        Scores are reported as Pyserini reports them (Anserini's tie adjuster: rounded to 1e-4, and a tie
        with the previous hit lowered by 1e-6 per tied rank), so both engines return the same numbers.
        With `threads` > 1 a big batch is cut into that many parts scored in parallel (the sparse product
        and the partial sorts release the GIL).
        """
        if not queries:
            return []
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = self.query_matrix(queries)  # one call into Java for the whole batch
        parts = min(threads, len(queries) // _MIN_PART)
        if parts <= 1:
            return self._top_k(terms, k)
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, len(queries), parts + 1).astype(int)
        with ThreadPoolExecutor(parts) as pool:
            chunks = pool.map(lambda lo, hi: self._top_k(terms[lo:hi], k), bounds[:-1], bounds[1:])
            return [hits for chunk in chunks for hits in chunk]

    def _top_k(self, terms, k: int) -> list[list[tuple[int, float]]]:
        """Top k of each row of a (queries x terms) count matrix."""
        scores = terms @ self.weights  # (queries x documents), CSR, float64 sums
        n = terms.shape[0]
        lengths = np.diff(scores.indptr)  # documents each query matches
        row_of = np.repeat(np.arange(n), lengths)
        # Candidates, for all queries at once: scores at least a share of the query's best. Where at least k
        # are, the top k are among them; the other queries (rare) are ranked one by one below.
        best = np.zeros(n)
        best[lengths > 0] = np.maximum.reduceat(scores.data, scores.indptr[:-1][lengths > 0])
        threshold = best * CANDIDATE_SHARE
        picked = np.flatnonzero(scores.data >= threshold[row_of])
        rows, columns = row_of[picked], scores.indices[picked]
        values = scores.data[picked].astype(np.float32)  # Lucene ranks the float32 value of its double sum
        order = np.lexsort((self._id_rank[columns], -values, rows))  # by query, score, then id as Anserini
        rows, columns, values = rows[order], columns[order], values[order]
        counts = np.bincount(rows, minlength=n)
        rank = np.arange(len(rows)) - (np.cumsum(counts) - counts)[rows]
        first = rank < k
        top_cols = np.zeros((n, k), np.int64)
        top_values = np.zeros((n, k), np.float32)
        top_cols[rows[first], rank[first]] = columns[first]
        top_values[rows[first], rank[first]] = values[first]
        found = np.minimum(counts, k)
        # Redo a query if it has too few candidates, or if a non-candidate could round to a float32 tie with
        # its k-th (scores are positive; 1e-6 is far above float32 rounding).
        kth = top_values[np.arange(n), np.maximum(found - 1, 0)]
        redo = (counts < np.minimum(lengths, k)) | ((lengths > counts) & (kth <= threshold * (1 + 1e-6)))
        for row in np.flatnonzero(redo):
            lo, hi = scores.indptr[row], scores.indptr[row + 1]
            values, columns = scores.data[lo:hi], scores.indices[lo:hi]
            if hi - lo > k:
                kth_row = np.partition(values, hi - lo - k)[hi - lo - k]
                keep = np.flatnonzero(values >= kth_row * (1 - 1e-6))  # float32 ties with the k-th stay in
                values, columns = values[keep], columns[keep]
            values = values.astype(np.float32)
            order = np.lexsort((self._id_rank[columns], -values))[:k]
            found[row] = len(order)
            top_cols[row, : len(order)] = columns[order]
            top_values[row, : len(order)] = values[order]
        self.redone += int(redo.sum())
        reported = _adjust_ties(top_values).tolist()
        cols = top_cols.tolist()
        return [list(zip(cols[row][:m], reported[row][:m], strict=True)) for row, m in enumerate(found.tolist())]


CANDIDATE_SHARE = 0.3
"""Share of a query's best score above which documents are ranked in the vectorized pass."""
_MIN_PART = 32  # queries per thread below which a thread costs more than it saves
_SEPARATOR = "redcodaqueryseparator"  # one token under the English analyzer, not an English word


def _adjust_ties(scores: np.ndarray) -> np.ndarray:
    """Anserini's ScoreTiesAdjusterReranker in float32 on (queries x k) ranked scores: round to 1e-4, then
    lower a score tied (within 1e-4) with the previous, already adjusted, one by 1e-6 per tied rank."""
    f32 = np.float32
    rounded = np.floor(scores * f32(1e4) + f32(0.5)) / f32(1e4)  # Java's Math.round(float) / 1e4f
    out = rounded.copy()
    dup = np.zeros(len(scores), np.float32)
    for j in range(1, scores.shape[1]):
        tied = ~(out[:, j - 1] - rounded[:, j] > f32(1e-4))
        dup = np.where(tied, dup + f32(1), f32(0))
        out[:, j] = np.where(tied, rounded[:, j] - f32(1e-6) * dup, rounded[:, j])
    return out


def _read_lucene(index_dir: Path, k1: float, b: float):
    """Postings, norms and ids of the `contents` field of a Lucene index -> (doc_ids, vocab, weights)."""
    import scipy.sparse as sp
    from jnius import autoclass

    path = autoclass("java.nio.file.Paths").get(str(index_dir))
    directory = autoclass("org.apache.lucene.store.FSDirectory").open(path)
    reader = autoclass("org.apache.lucene.index.DirectoryReader").open(directory)
    freqs_flag = autoclass("org.apache.lucene.index.PostingsEnum").FREQS
    small_float = autoclass("org.apache.lucene.util.SmallFloat")
    try:
        n_docs = reader.maxDoc()
        doc_count = reader.getDocCount(_FIELD)
        total_length = reader.getSumTotalTermFreq(_FIELD)
        if reader.numDocs() != n_docs:  # deleted documents still sit in the postings until a merge
            raise ValueError(f"the Lucene index at {index_dir} has deleted documents; use engine='lucene'")
        if doc_count <= 0:
            raise ValueError(f"the Lucene index at {index_dir} has no '{_FIELD}' field to score")
        doc_ids: list[str] = [""] * n_docs
        norm_bytes = np.zeros(n_docs, np.int64)
        vocab: dict[str, int] = {}
        term_rows: list[int] = []
        doc_cols: list[int] = []
        tfs: list[int] = []
        for context in reader.leaves().toArray():
            leaf, base = context.reader(), context.docBase
            stored = leaf.storedFields()
            for doc in range(leaf.maxDoc()):
                doc_id = stored.document(doc).get("id")
                if doc_id is None:
                    raise ValueError(f"the Lucene index at {index_dir} stores no 'id' field (Anserini's layout)")
                doc_ids[base + doc] = doc_id
            norms = leaf.getNormValues(_FIELD)
            doc = norms.nextDoc() if norms is not None else _NO_MORE_DOCS
            while doc != _NO_MORE_DOCS:
                norm_bytes[base + doc] = norms.longValue() & 0xFF
                doc = norms.nextDoc()
            terms = leaf.terms(_FIELD)
            if terms is None:
                continue
            term_iter, postings = terms.iterator(), None
            term = term_iter.next()
            while term is not None:
                row = vocab.setdefault(term.utf8ToString(), len(vocab))
                postings = term_iter.postings(postings, freqs_flag)
                doc = postings.nextDoc()
                while doc != _NO_MORE_DOCS:
                    term_rows.append(row)
                    doc_cols.append(base + doc)
                    tfs.append(postings.freq())
                    doc = postings.nextDoc()
                term = term_iter.next()
        # BM25Similarity, in float32 as Lucene computes it.
        f32 = np.float32
        length_table = np.array([small_float.byte4ToInt(i - 256 if i > 127 else i) for i in range(256)], f32)
        avgdl = f32(total_length / doc_count)
        norm_inverse = f32(1) / (f32(k1) * (f32(1 - b) + f32(b) * length_table / avgdl))  # indexed by norm byte
        rows = np.asarray(term_rows, np.int64)
        cols = np.asarray(doc_cols, np.int64)
        doc_freq = np.bincount(rows, minlength=len(vocab))
        idf = np.log(1 + (doc_count - doc_freq + 0.5) / (doc_freq + 0.5)).astype(f32)
        weight = idf[rows]
        contribution = weight - weight / (f32(1) + np.asarray(tfs, f32) * norm_inverse[norm_bytes[cols]])
        weights = sp.csr_matrix((contribution.astype(np.float64), (rows, cols)), shape=(len(vocab), n_docs))
        return doc_ids, vocab, weights
    finally:
        reader.close()
