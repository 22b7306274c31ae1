"""The batched BM25 engine (retrievers.bm25_matrix) against Lucene itself, on the real bundled index."""

from __future__ import annotations

import numpy as np
import pytest

from envs.data import load_examples

# Queries where Lucene's details matter: one-term queries (many exact score ties, broken by doc id), a
# repeated term (Anserini boosts it by its count), stopwords only, an unknown word, non-ASCII, possessives.
EDGE_QUERIES = [
    "film",
    "American",
    "film film film director",
    "the of and",
    "zzqqxxunknownword",
    "Æthelred Ünïcode 東京 café",
    "Scott Derrickson's nationality",
    "Who was born first?",
    "",
]


@pytest.fixture(scope="module")
def questions():
    return [example.question for example in load_examples("hotpotqa", "dev")] + EDGE_QUERIES


@pytest.fixture(scope="module")
def matrix_bm25(hotpot_corpus):
    from retrievers.bm25 import BM25Retriever

    return BM25Retriever.for_corpus(hotpot_corpus, engine="matrix")


@pytest.mark.parametrize("k", [1, 5, 20])
def test_matrix_engine_ranks_exactly_as_lucene(bm25, matrix_bm25, questions, k):
    lucene = bm25.batch_search(questions, k)
    matrix = matrix_bm25.batch_search(questions, k)
    assert [[p.doc_id for p in hits] for hits in matrix] == [[p.doc_id for p in hits] for hits in lucene]
    pairs = [(a.score, b.score) for x, y in zip(lucene, matrix, strict=True) for a, b in zip(x, y, strict=True)]
    lucene_scores, matrix_scores = np.array(pairs).T
    # Pyserini reports scores rounded to 1e-4; ours differ at most by one such step (a raw score on a
    # rounding boundary, summed in another order), and are bit-equal almost always.
    assert np.abs(lucene_scores - matrix_scores).max() <= 1.02e-4
    assert (lucene_scores == matrix_scores).mean() >= 0.98
    assert sum(len(hits) for hits in lucene) > 0.9 * k * len(questions)


def test_single_search_equals_batch_and_lucene(bm25, matrix_bm25, questions):
    for query in questions[:20] + EDGE_QUERIES:
        single = matrix_bm25.search(query, 5)
        assert single == matrix_bm25.batch_search([query], 5)[0]
        assert [p.doc_id for p in single] == [p.doc_id for p in bm25.search(query, 5)]
    assert matrix_bm25.search("", 5) == [] and matrix_bm25.batch_search([], 5) == []


def test_batched_analysis_equals_one_query_at_a_time(matrix_bm25, questions):
    from retrievers.bm25_matrix import _SEPARATOR

    matrix = matrix_bm25.matrix
    one_by_one = [matrix.analyze(q) for q in questions]
    assert matrix.analyze_batch(questions) == one_by_one
    assert one_by_one[questions.index("film film film director")] == ["film", "film", "film", "director"]
    # A query holding the separator word itself falls back to one call per query, with the same answer.
    tricky = ["a film", f"the {_SEPARATOR} word", "Ed Wood"]
    assert matrix.analyze_batch(tricky) == [matrix.analyze(q) for q in tricky]


def test_matrix_is_built_from_the_index_and_cached_atomically(bm25, tmp_path, monkeypatch):
    from retrievers.bm25_matrix import BM25Matrix

    monkeypatch.setenv("REDCODA_CACHE", str(tmp_path))
    built = BM25Matrix.from_lucene(bm25.index_dir, 0.9, 0.4)
    files = list((tmp_path / "bm25_matrix").iterdir())
    assert len(files) == 1 and files[0].suffix == ".npz"  # no temporary file left behind
    loaded = BM25Matrix.from_lucene(bm25.index_dir, 0.9, 0.4)
    assert loaded.doc_ids == built.doc_ids and loaded.vocab == built.vocab
    assert (loaded.weights != built.weights).nnz == 0
    assert sorted(built.doc_ids) == sorted(bm25.corpus.doc_ids)
    # Another (k1, b) is another matrix: higher b punishes long paragraphs more, so weights change.
    other = BM25Matrix.from_lucene(bm25.index_dir, 1.2, 0.75)
    assert len(list((tmp_path / "bm25_matrix").iterdir())) == 2
    assert not np.allclose(other.weights.data, built.weights.data)


def test_bad_arguments_are_clear_errors(hotpot_corpus, matrix_bm25, tmp_path):
    from retrievers.bm25 import BM25Retriever
    from retrievers.bm25_matrix import BM25Matrix

    with pytest.raises(ValueError, match="unknown BM25 engine"):
        BM25Retriever(hotpot_corpus, engine="faiss")
    with pytest.raises(ValueError, match="k must be >= 1"):
        matrix_bm25.batch_search(["film"], 0)
    with pytest.raises(FileNotFoundError, match="no Lucene index"):
        BM25Matrix.from_lucene(tmp_path)


def test_env_searches_with_the_matrix_engine_as_with_lucene(bm25):
    import gymnasium as gym

    import envs  # noqa: F401

    observations = []
    for retriever in ("bm25", "bm25-matrix"):
        env = gym.make("RedCoda-HotpotQA-v0", retriever=retriever)
        env.reset(seed=0, options={"index": 3})
        obs, *_ = env.step("<search>Scott Derrickson nationality</search>")
        observations.append(obs)
        env.close()
    assert "<information>" in observations[0] and observations[0] == observations[1]


def test_threaded_batch_equals_one_thread(matrix_bm25, questions):
    matrix = matrix_bm25.matrix
    assert matrix.top_k(questions, 5, threads=3) == matrix.top_k(questions, 5, threads=1)


@pytest.mark.parametrize("share", [1.01, 0.9, 0.05])
def test_vectorized_ranking_equals_one_query_at_a_time(matrix_bm25, questions, share, monkeypatch):
    """The candidate pass (share of the best score) and the per-query fallback rank alike, whatever the share."""
    import retrievers.bm25_matrix as bm25_matrix

    matrix = matrix_bm25.matrix
    expected = matrix.top_k(questions, 7)
    monkeypatch.setattr(bm25_matrix, "CANDIDATE_SHARE", share)
    matrix.redone = 0
    assert matrix.top_k(questions, 7) == expected
    matched = sum(1 for q in questions if matrix.analyze(q) and any(t in matrix.vocab for t in matrix.analyze(q)))
    if share > 1:  # no candidate at all: every query that matches something goes through the fallback
        assert matrix.redone == matched
    elif share < 0.1:  # nearly every match is a candidate: no fallback needed
        assert matrix.redone == 0


def test_server_builds_the_matrix_engine_when_asked(bm25):
    import argparse

    from retrievers.server import BUNDLED_CORPUS, build_retriever

    args = argparse.Namespace(
        corpus=str(BUNDLED_CORPUS), kind="bm25", index=None, bm25_index=None, bm25_engine="matrix", cache_size=0
    )
    retriever = build_retriever(args)
    assert retriever.engine == "matrix"
    query = "What citizen was the author of Bimbos of the Death Sun?"
    assert [p.doc_id for p in retriever.search(query, 5)] == [p.doc_id for p in bm25.search(query, 5)]
