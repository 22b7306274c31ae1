"""The first-search split of an evaluation (reading or searching), as the main job writes it under its table.

The code is `envs.first_search`: it needs only the env's dependencies, so that ``redcoda-first-search`` reads an
evaluation on an install without the `train` extra. This module names it where the run's code looks for it.
"""

from __future__ import annotations

from envs.first_search import (
    KINDS,
    by_kind,
    kinds_table,
    main,
    question_kinds,
    results_in,
    searches_show,
    shows_answer,
    split,
    split_tables,
    table,
)

__all__ = [
    "KINDS",
    "by_kind",
    "kinds_table",
    "main",
    "question_kinds",
    "results_in",
    "searches_show",
    "shows_answer",
    "split",
    "split_tables",
    "table",
]
