"""A run's per-question outcomes as the results store keeps them: scores and flags, no passage or answer text.

Shared by the store (`benchmarks.results_store`) and the reader of the folders that predate it
(`benchmarks.results_legacy`).
"""

from __future__ import annotations

from typing import Any

QUESTION_FIELDS = {
    "em": "em",
    "f1": "f1",
    "answered": "answered",
    "format": "format",
    "searches": "num_searches",
    "tasks": "num_tasks",
    "invalid_actions": "invalid_actions",
    "sampler_errors": "sampler_errors",
    "retrieval_errors": "retrieval_errors",
}
"""A stored question's fields and the prediction keys they come from."""


def first_search_class(prediction: dict[str, Any], shown: dict[int, bool] | None) -> str | None:
    """``yes/no``, ``shown`` (the question as the first query shows a gold answer) or ``not shown``; None unknown."""
    from envs.first_search import is_yes_no

    if prediction.get("gold_answers") and is_yes_no(prediction["gold_answers"][0]):
        return "yes/no"
    if shown is None or prediction.get("index") not in shown:
        return None
    return "shown" if shown[prediction["index"]] else "not shown"


def question_records(result: dict[str, Any], part: str, first_search: bool) -> list[dict[str, Any]]:
    """The ``question`` records of one evaluation result (its per-question predictions), answer text left out."""
    shown = None
    if first_search and result.get("settings", {}).get("env_kwargs") is not None:
        from envs.first_search import searches_show

        shown = searches_show(result)[0]
    records = []
    for p in result["predictions"]:
        record = {"record": "question", "part": part, "id": str(p.get("id", p.get("index"))), "index": p.get("index")}
        record.update({name: p[key] for name, key in QUESTION_FIELDS.items() if key in p})
        record["first_search"] = first_search_class(p, shown)
        records.append(record)
    return records
