"""Reward functions: pure functions shared by the env, the trainers and the benchmarks.

Answer metrics reproduce the official HotpotQA evaluation script (hotpot_evaluate_v1.py):
`normalize_answer` lower-cases, drops punctuation and the articles a/an/the and collapses whitespace;
`f1_score` is token-level F1 with the special rule that when either side normalizes to yes, no or
noanswer, the two must match exactly (else F1 = 0). With several gold answers (aliases) every metric
takes the max over them.

The episode reward (all weights in `RewardWeights`) is

    reward = answer * F1 + offset + format * format_score + refine * refine_score + recall * evidence_recall
             (seed: 6*F1 - 3 + 0.1 + 0.1 + 0)

where format_score is graduated (0.25 per protocol tag the episode used, always well-formed, capped at
1), refine_score is the share of <refine> blocks that contain a normalized gold answer, and evidence_recall
the share of gold titles among the passages the episode's searches returned (`title_recall`; off by default, a
credit for the search itself). No answer scores as F1 = 0.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Official HotpotQA/SQuAD normalization: lower, strip punctuation, drop articles, fix whitespace."""
    text = text.lower().translate(_DROP_PUNCTUATION)  # the official per-character filter, in one C pass
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_yes_no(answer: str) -> bool:
    """Whether a (gold) answer is yes or no after normalization: a comparison question's, never read off a passage."""
    return normalize_answer(answer) in ("yes", "no")


def _f1_single(prediction: str, gold: str) -> float:
    pred, truth = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or truth in _SPECIAL) and pred != truth:
        return 0.0
    pred_tokens, truth_tokens = pred.split(), truth.split()
    same = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _golds(answers: str | Iterable[str]) -> list[str]:
    golds = [answers] if isinstance(answers, str) else list(answers)
    if not golds:
        raise ValueError("at least one gold answer is needed")
    return golds


def f1_score(prediction: str, answers: str | Iterable[str]) -> float:
    """Token F1 of the official HotpotQA script, max over gold answers."""
    return max(_f1_single(prediction, gold) for gold in _golds(answers))


def exact_match(prediction: str, answers: str | Iterable[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in _golds(answers)))


def cover_exact_match(prediction: str, answers: str | Iterable[str]) -> float:
    """1.0 when a normalized gold answer appears as a whole-token span of the normalized prediction."""
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {gold} " in pred for gold in map(normalize_answer, _golds(answers)) if gold))


def refine_score(refines: Sequence[str], answers: str | Iterable[str]) -> float:
    """Share of <refine> blocks whose normalized text contains a normalized gold answer (0 when none)."""
    if not refines:
        return 0.0
    return sum(cover_exact_match(text, answers) for text in refines) / len(refines)


FORMAT_STEP = 0.25
"""Format credit per protocol tag used correctly."""


def format_score(used_tags: Iterable[str], malformed_tags: Iterable[str]) -> float:
    """Graduated format score: 0.25 per distinct protocol tag used and never malformed, capped at 1.

    Args:
        used_tags: names of tags that appeared as complete, paired, non-nested blocks in the episode.
        malformed_tags: names of tags that appeared unclosed, unopened or nested at least once.
    """
    good = set(used_tags) - set(malformed_tags)
    return min(1.0, FORMAT_STEP * len(good))


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the episode reward `answer*F1 + offset + format*format_score + refine*refine_score`."""

    answer: float = 6.0
    """Weight of the answer F1."""
    offset: float = -3.0
    """Constant added to every episode (so a wrong answer is negative)."""
    format: float = 0.1
    """Weight of the graduated format score."""
    refine: float = 0.1
    """Weight of the refine score."""
    recall: float = 0.0
    """Weight of the evidence recall: the share of gold titles the episode's searches returned."""

    def __post_init__(self) -> None:
        for name in ("answer", "offset", "format", "refine", "recall"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"reward weight {name} must be a finite number, got {value!r}")

    @property
    def maximum(self) -> float:
        """The best reward an episode can get (F1, format, refine and recall all 1)."""
        return self.answer + self.offset + self.format + self.refine + self.recall


def episode_reward(
    f1: float, fmt: float, refine: float, weights: RewardWeights = RewardWeights(), recall: float = 0.0
) -> float:
    """The scalar episode reward from its components (pass f1=0 when the agent never answered)."""
    return (
        weights.answer * f1 + weights.offset + weights.format * fmt + weights.refine * refine + weights.recall * recall
    )


def title_recall(retrieved_titles: Iterable[str], gold_titles: Sequence[str]) -> float:
    """Share of gold titles among the retrieved titles (case-insensitive); 0 when there is no gold title."""
    if not gold_titles:
        return 0.0
    seen = {t.strip().lower() for t in retrieved_titles}
    return sum(t.strip().lower() in seen for t in gold_titles) / len(gold_titles)
