"""Episode metrics: the numbers an episode's terminal info reports, the one list the trainer and benchmarks read.

Each env puts its own components into the terminal ``info`` (`RAGEnv`: em, f1, format, refine, searches,
recall, ...; `QueryRewriteEnv`: recall@k and MRR; `TaskEnv`: its score); `episode_metrics` picks the ones
present, so a caller never lists them again nor special-cases an env:

    obs, reward, terminated, truncated, info = env.step("<answer>Kolkata</answer>")
    episode_metrics(info)   # {"answered": 1.0, "em": 1.0, "f1": 1.0, "format": 0.75, ..., "invalid_action_share": 0.0}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["EPISODE_METRICS", "episode_metrics"]

EPISODE_METRICS: tuple[str, ...] = (
    "answered",
    "em",
    "f1",
    "cover_em",
    "format",
    "refine",
    "num_searches",
    "num_tasks",
    "recall",
    "recall_at_k",
    "mrr",
    "score",
    "invalid_actions",
    "retrieval_errors",
)
"""Terminal-info keys that are episode metrics: answered (1 when the episode ended with a valid answer),
answer EM/F1/cover-EM, format and refine scores, searches (that returned results), CoDA planner tasks,
recall of gold titles, recall@k and MRR of a query rewrite, a task's score, invalid actions (a count) and
retrieval errors (searches the retriever failed)."""


def episode_metrics(info: Mapping[str, Any]) -> dict[str, float]:
    """The metrics of one finished episode, from its terminal info.

    Args:
        info: The env's info on the episode's last step.

    Returns:
        Each key of `EPISODE_METRICS` the info holds, as a float (booleans as 0/1), plus
        ``invalid_action_share`` (invalid actions over all actions) when the env counted its actions
        (``num_actions``).
    """
    out = {name: float(info[name]) for name in EPISODE_METRICS if info.get(name) is not None}
    actions = info.get("num_actions")
    if actions is not None and "invalid_actions" in out:
        out["invalid_action_share"] = out["invalid_actions"] / actions if actions else 0.0
    return out
