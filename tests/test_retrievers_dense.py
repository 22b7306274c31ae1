"""Dense (FAISS + MiniLM), hybrid (RRF), cached retrievers and the index builder, on real paragraphs.

Everything runs over a 260-paragraph subset of the bundled HotpotQA corpus (encoded once per session,
~20 s on 2 CPU cores) with a temporary REDCODA_CACHE, plus the shipped embeddings of the full corpus.
"""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from retrievers.base import Passage, Retriever
from retrievers.corpus import Corpus

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "envs" / "data" / "hotpotqa" / "corpus.jsonl.gz"
DEV_FILE = ROOT / "envs" / "data" / "hotpotqa" / "dev.jsonl.gz"


def dev_questions(n: int) -> list[tuple[str, set[str]]]:
    """The first n dev questions with their gold (supporting-fact) titles."""
    out = []
    with gzip.open(DEV_FILE, "rt") as handle:
        for line in handle:
            row = json.loads(line)
            out.append((row["question"], {title for title, _ in row["supporting_facts"]}))
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="session")
def full_corpus() -> Corpus:
    return Corpus.from_jsonl(CORPUS_FILE, name="hotpotqa")


@pytest.fixture(scope="session")
def subset(full_corpus) -> Corpus:
    """Gold paragraphs of the first 20 dev questions plus the first 220 corpus rows (~260 real paragraphs)."""
    gold = set().union(*(titles for _, titles in dev_questions(20)))
    rows = [i for i, title in enumerate(full_corpus.titles) if title in gold or i < 220]
    return Corpus.from_passages(
        [(full_corpus.doc_ids[i], full_corpus.titles[i], full_corpus.texts[i]) for i in rows], name="subset"
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("redcoda-cache")


@pytest.fixture(scope="session")
def encoder():
    from retrievers.encoders import HFEncoder

    return HFEncoder(device="cpu", batch_size=32)


@pytest.fixture(scope="session")
def dense(subset, encoder, cache_dir):
    from retrievers.dense import DenseRetriever

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        return DenseRetriever(subset, encoder)


@pytest.fixture(scope="session")
def bm25_subset(subset, cache_dir):
    from retrievers.bm25 import BM25Retriever

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        return BM25Retriever(subset)


def test_encoder_vectors_are_unit_norm_and_order_independent(encoder, subset):
    texts = [subset.contents(i) for i in range(6)]
    vecs = encoder.encode_passages(texts, progress=False)
    assert vecs.shape == (6, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    # Length sorting inside a batch must not change which vector belongs to which text.
    np.testing.assert_allclose(encoder.encode_passages(texts[::-1], progress=False)[::-1], vecs, atol=1e-5)


def test_encoder_prefixes_change_the_key_and_vectors(encoder):
    from retrievers.encoders import HFEncoder

    e5_style = HFEncoder(device="cpu", query_prefix="query: ", passage_prefix="passage: ")
    assert e5_style.key != encoder.key
    a, b = encoder.encode_queries(["Ed Wood"]), e5_style.encode_queries(["Ed Wood"])
    assert not np.allclose(a, b)


def test_dense_is_a_retriever_and_finds_a_paragraph_from_its_own_text(dense, subset, check_retriever):
    check_retriever(dense, [subset.texts[0][:100], "Ed Wood film director"], 3)
    for i in (0, 57, 200):
        hits = dense.search(subset.texts[i][:300], k=3)
        assert hits[0].doc_id == subset.doc_ids[i]
        assert hits[0].title == subset.titles[i] and hits[0].text == subset.texts[i]
        assert hits[0].score >= hits[1].score >= hits[2].score


def test_dense_cache_is_written_and_reused(dense, subset, encoder, cache_dir):
    from retrievers.dense import DenseRetriever

    entry = cache_dir / "dense" / f"{subset.fingerprint}-{encoder.key}"
    assert (entry / "embeddings.npy").exists() and (entry / "index-flat.faiss").exists()
    assert not list(entry.glob(".*"))  # no temp files left behind by the atomic writes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        again = DenseRetriever(subset, encoder)
    assert again.build_seconds == 0.0
    query = "American biographical period comedy-drama film"
    assert [p.doc_id for p in again.search(query, 5)] == [p.doc_id for p in dense.search(query, 5)]


def test_dense_batch_matches_single_and_handles_blank_queries(dense):
    queries = ["Who directed Ed Wood?", "", "Sharyn McCrumb novels", "   "]
    batched = dense.batch_search(queries, k=4)
    assert batched[1] == [] and batched[3] == []
    for query, hits in zip(queries, batched, strict=True):
        if query.strip():
            single = dense.search(query, 4)
            assert [p.doc_id for p in hits] == [p.doc_id for p in single]
            assert [p.score for p in hits] == pytest.approx([p.score for p in single], abs=1e-5)
    with pytest.raises(ValueError):
        dense.search("x", 0)


def test_hnsw_agrees_with_flat_and_never_leaks_minus_one(subset, encoder, cache_dir, dense):
    from retrievers.dense import DenseRetriever

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        hnsw = DenseRetriever(subset, encoder, kind="hnsw", hnsw_m=16)
        tiny = DenseRetriever(
            Corpus.from_passages([(subset.doc_ids[i], subset.titles[i], subset.texts[i]) for i in range(3)]),
            encoder,
            kind="hnsw",
        )
    assert hnsw.build_seconds < dense.build_seconds  # embeddings came from the flat index's cache
    overlap = [
        len({p.doc_id for p in hnsw.search(q, 5)} & {p.doc_id for p in dense.search(q, 5)}) / 5
        for q, _ in dev_questions(20)
    ]
    assert np.mean(overlap) >= 0.9
    hits = tiny.search("film", k=10)  # more than the corpus holds: FAISS pads with -1
    assert len(hits) == 3 and all(isinstance(p, Passage) and p.doc_id in subset.doc_ids[:3] for p in hits)


def test_bundled_embeddings_match_the_bundled_corpus(full_corpus, encoder):
    """The shipped fp16 vectors belong to this corpus and encoder, and a CPU re-encode reproduces them."""
    from retrievers.dense import bundled_embeddings

    path = bundled_embeddings(full_corpus.fingerprint, encoder.key)
    assert path is not None, "retrievers/data embeddings do not match the bundled corpus: rebuild them"
    shipped = np.load(path, mmap_mode="r")
    assert shipped.shape == (len(full_corpus), 384) and shipped.dtype == np.float16
    rows = [0, 4321, 17644]
    fresh = encoder.encode_passages([full_corpus.contents(i) for i in rows], progress=False)
    np.testing.assert_allclose(shipped[rows].astype(np.float32), fresh, atol=2e-4)


def test_dense_over_the_full_corpus_uses_shipped_embeddings(full_corpus, encoder, cache_dir):
    from retrievers.dense import DenseRetriever

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        full = DenseRetriever(full_corpus, encoder)
    assert not (full.cache_dir / "embeddings.npy").exists()  # nothing was encoded
    found = [bool({p.title for p in full.search(q, 5)} & gold) for q, gold in dev_questions(20)]
    assert np.mean(found) >= 0.7


def test_hybrid_fuses_by_reciprocal_rank(bm25_subset, dense, subset, check_retriever):
    from retrievers.hybrid import HybridRetriever, rrf_fuse

    a, b, c = (Passage(x, x, x, 0.0) for x in "abc")
    fused = rrf_fuse([[a, b], [b, c]], weights=[1.0, 1.0], rrf_k=60, k=3)
    assert [p.doc_id for p in fused] == ["b", "a", "c"]
    assert fused[0].score == pytest.approx(1 / 62 + 1 / 61)
    assert [p.doc_id for p in rrf_fuse([[a, b], [b, c]], [1.0, 0.0], 60, 3)] == ["a", "b"]

    hybrid = HybridRetriever([bm25_subset, dense], weights=[1.0, 1.0], rrf_k=60, depth=20)
    check_retriever(hybrid, ["Sharyn McCrumb", "Ed Wood"], 5)
    query = "Sharyn McCrumb"
    hits = hybrid.search(query, 5)
    assert len(hits) == 5 and len({p.doc_id for p in hits}) == 5
    assert [p.score for p in hits] == sorted((p.score for p in hits), reverse=True)
    top_bm25, top_dense = bm25_subset.search(query, 1)[0], dense.search(query, 1)[0]
    assert top_bm25.doc_id == top_dense.doc_id == hits[0].doc_id  # first in both lists: first when fused
    only_bm25 = HybridRetriever([bm25_subset, dense], weights=[1.0, 0.0]).search(query, 5)
    assert [p.doc_id for p in only_bm25] == [p.doc_id for p in bm25_subset.search(query, 5)]
    assert hybrid.batch_search([query, "Sharyn McCrumb"], 5)[0] == hits


class CountingRetriever:
    """A real retriever wrapped to count the queries that reach it."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[Passage]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries, k):
        with self._lock:
            self.seen.extend(queries)
        return self.inner.batch_search(queries, k)


def test_cached_retriever_sends_only_misses(bm25_subset):
    from retrievers.cached import CachedRetriever

    counting = CountingRetriever(bm25_subset)
    cached = CachedRetriever(counting, maxsize=3)
    group = ["Ed Wood film", "Ed Wood film", "Tim Burton", "Ed Wood film"]  # a GRPO group repeating a query
    first = cached.batch_search(group, 3)
    assert counting.seen == ["Ed Wood film", "Tim Burton"]
    assert first[0] == first[1] == bm25_subset.search("Ed Wood film", 3)
    assert cached.batch_search(["Tim Burton", "Johnny Depp"], 3)[0] == first[2]
    assert counting.seen[-1:] == ["Johnny Depp"] and (cached.hits, cached.misses) == (3, 3)
    cached.search("Ed Wood film", 5)  # another k is another entry; the LRU entry ("Ed Wood film", 3) goes
    assert len(cached) == 3
    cached.search("Ed Wood film", 3)
    assert counting.seen[-1] == "Ed Wood film"


def test_cached_retriever_is_thread_safe(bm25_subset):
    from concurrent.futures import ThreadPoolExecutor

    from retrievers.cached import CachedRetriever

    cached = CachedRetriever(bm25_subset, maxsize=8)
    queries = [subset_title for subset_title in bm25_subset.corpus.titles[:16]] * 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda q: cached.search(q, 2), queries))
    assert results[:16] == results[16:32] == results[48:]
    assert len(cached) <= 8 and cached.hits + cached.misses == len(queries)


@pytest.mark.parametrize("engine", ["lucene", "matrix"])
def test_bm25_is_safe_to_call_from_many_threads(bm25_subset, engine):
    """Concurrent search and batch_search on one shared searcher give the single-threaded answers."""
    from concurrent.futures import ThreadPoolExecutor

    from retrievers.bm25 import BM25Retriever

    retriever = BM25Retriever(bm25_subset.corpus, index_dir=bm25_subset.index_dir, engine=engine)
    queries = list(bm25_subset.corpus.titles[:24])
    expected = [retriever.search(q, 3) for q in queries]

    def call(i: int):
        if i % 2:
            return [retriever.search(queries[i % 24], 3)]
        return retriever.batch_search([queries[i % 24], queries[(i + 1) % 24]], 3)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(3000)))
    for i, result in enumerate(results):
        want = [expected[i % 24]] if i % 2 else [expected[i % 24], expected[(i + 1) % 24]]
        assert result == want


def test_build_index_cli_streams_bm25_and_dense(tmp_path, subset, encoder, capsys):
    from retrievers.bm25 import BM25Retriever
    from retrievers.build_index import main
    from retrievers.dense import DenseRetriever

    corpus_file = tmp_path / "corpus.jsonl"
    with open(corpus_file, "w") as handle:
        for i in range(40):
            handle.write(json.dumps({"id": subset.doc_ids[i], "contents": subset.contents(i)}) + "\n")
    small = Corpus.from_jsonl(corpus_file)
    main(["--corpus", str(corpus_file), "--kind", "bm25", "--out", str(tmp_path / "bm25")])
    main(["--corpus", str(corpus_file), "--kind", "dense", "--out", str(tmp_path / "dense"), "--chunk", "16"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # an existing output is refused at start, in one line
        main(["--corpus", str(corpus_file), "--kind", "bm25", "--out", str(tmp_path / "bm25")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'bm25'} exists; pass --overwrite to replace it\n"
    meta = json.loads((tmp_path / "dense" / "meta.json").read_text())
    assert meta["count"] == 40 and meta["corpus_fingerprint"] == small.fingerprint
    assert meta["encoder_key"] == encoder.key

    bm25 = BM25Retriever(small, index_dir=tmp_path / "bm25")
    assert bm25.search(subset.titles[7], 1)[0].title == subset.titles[7]
    for index in (tmp_path / "dense", tmp_path / "dense" / "index.faiss"):  # our dir, or a bare index file
        dense = DenseRetriever(small, encoder, index=index)
        assert dense.search(subset.texts[7][:200], 1)[0].doc_id == subset.doc_ids[7]
    with pytest.warns(UserWarning, match="another corpus"), pytest.raises(ValueError, match="vectors"):
        DenseRetriever(Corpus.from_passages([("x", "", "y")]), encoder, index=tmp_path / "dense")


@pytest.mark.gpu
def test_flat_index_on_the_gpu_matches_the_cpu(dense, subset, encoder, cache_dir):
    from retrievers.dense import DenseRetriever, gpu_available

    if not gpu_available():
        pytest.skip("needs faiss with GPU support and a CUDA device")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(cache_dir))
        on_gpu = DenseRetriever(subset, encoder, use_gpu=True)
    for query, _ in dev_questions(5):
        assert [p.doc_id for p in on_gpu.search(query, 5)] == [p.doc_id for p in dense.search(query, 5)]
