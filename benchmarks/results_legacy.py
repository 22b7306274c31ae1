"""Records of the runs whose committed files predate the results store: what their tables and logs state.

    python -m benchmarks.report ingest benchmarks/results/compare-cpu-flat-84
    python -m benchmarks.report ingest benchmarks/results/main-job-cpu-coda-validation-seed1 \
        --name main-job-validation-seed1

A comparison folder (``compare-*``) kept ``table.md`` (and ``table.csv``): every table in it becomes ``row`` records
(``table``: systems, paired, runs), and the header's command and machine the run's provenance. A main job folder
(``main-job-*``) kept ``eval.md`` and ``run.log``: the before/after rows, the steps, the validation scores and the
chosen step; one without ``run.log`` (older main jobs, restored whole from the git history) counts its steps from
its metrics rows, one a step. Their commits and data hashes were never recorded (``provenance.missing``).
Their metrics rows and per-question results left the tree but not the git history; restored beside the folder's
files (a comparison's ``runs/<run>/metrics.jsonl`` and ``evals/<system>-seed<s>.json``, a main job's
``metrics.jsonl`` and ``eval.json``), they are stored too: the pages' figures are drawn from the metrics rows, and
`benchmarks.report stats` pairs the runs by question:

    git archive dfe5c88^ benchmarks/results/compare-cpu-flat-84 | tar -x   # the last commit that held them
    python -m benchmarks.report ingest benchmarks/results/compare-cpu-flat-84
    git clean -fdx benchmarks/results/compare-cpu-flat-84                    # the restored files stay in history

A lever's run records the preset's command unless told its own: ``ingest FOLDER --name N --command "python -m ..."``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.results_questions import question_records

LEGACY = ("compare-", "main-job-")
"""The folder name prefixes this module reads."""
MISSING = ["per-question results", "metrics rows", "code commit", "package versions", "data and model hashes"]
"""What the store lacks of a run that predates it (its metrics rows aside, where they are restored)."""
_INTERVAL = re.compile(r"^([+-]?[\d.]+(?:e-?\d+)?) \[([+-]?[\d.]+), ([+-]?[\d.]+)\]$")


def number(cell: str) -> Any:
    """A table cell as a number, ``{"mean", "low", "high"}`` for ``x [l, h]``, else the text (bold marks removed)."""
    cell = cell.replace("**", "").strip()
    found = _INTERVAL.match(cell)
    if found:
        return {"mean": float(found[1]), "low": float(found[2]), "high": float(found[3])}
    try:
        return float(cell)
    except ValueError:
        return cell


def markdown_tables(text: str) -> list[list[dict[str, Any]]]:
    """Every Markdown table in `text`, as a list of rows (dicts by header cell), cells parsed by `number`."""
    tables, header = [], None
    for line in text.replace(" \n", " ").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append([])
        elif not line.startswith("|---"):
            tables[-1].append({h: number(c) for h, c in zip(header, cells, strict=False)})
    return tables


def _table_kind(rows: list[dict[str, Any]]) -> str:
    keys = set(rows[0]) if rows else set()
    return "paired" if "comparison" in keys else "runs" if "run" in keys else "systems"


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A run directory's restored metrics.jsonl as ``metrics`` records (none when it has none)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [{"record": "metrics", **json.loads(line)} for line in lines if line.strip()]


def _missing(metrics: list[dict[str, Any]], questions: list[dict[str, Any]]) -> list[str]:
    restored = {"metrics rows": bool(metrics), "per-question results": bool(questions)}
    return [m for m in MISSING if not restored.get(m)]


def _questions(result: dict[str, Any], part: str) -> list[dict[str, Any]]:
    """A restored evaluation's ``question`` records (no first-search class: these evaluations kept no settings)."""
    return question_records(result, part, first_search=False)


def _stated(text: str, label: str) -> str | None:
    found = re.search(rf"{label}: `?(.+?)`?\. ", text)
    return found[1] if found else None


def comparison_records(folder: Path) -> list[dict[str, Any]]:
    """A committed comparison folder's records: its header and every row of table.md."""
    text = (folder / "table.md").read_text(encoding="utf-8")
    first = text.split("\n\n", 1)[0]
    runs = sorted(p.parent for p in folder.glob("runs/*/metrics.jsonl"))
    metrics = [{**row, "run": run.name} for run in runs for row in metrics_rows(run)]
    evals = sorted(folder.glob("evals/*.json"))
    questions = [q for path in evals for q in _questions(json.loads(path.read_text(encoding="utf-8")), path.stem)]
    header = {
        "record": "run",
        "kind": "comparison",
        "recorded": first,
        "provenance": {
            "command": _stated(first, "Command"),
            "machine": _stated(first, "Machine"),
            "seeds": _stated(first, "seeds"),
            "missing": _missing(metrics, questions),
        },
        "files": [str(p.name) for p in sorted(folder.iterdir()) if p.suffix in (".md", ".csv")]
        + [f"runs/{run.name}/metrics.jsonl" for run in runs]
        + [f"evals/{path.name}" for path in evals],
    }
    rows = []
    for table in markdown_tables(text):
        kind = _table_kind(table)
        rows += [{"record": "row", "table": kind, **row} for row in table]
    return [header, *rows, *questions, *metrics]


def main_job_records(folder: Path) -> list[dict[str, Any]]:
    """A committed main job folder's records: eval.md's before/after rows, run.log's steps and validation (F1 and
    valid answers by step), and the metrics rows where ``metrics.jsonl`` is restored. Without run.log the steps are
    the metrics rows' (`_without_log`)."""
    has_log = (folder / "run.log").exists()
    log = (folder / "run.log").read_text(encoding="utf-8", errors="replace") if has_log else ""
    evaluation = (folder / "eval.md").read_text(encoding="utf-8")
    steps = re.search(r"│ steps\s+│ (\d+)", log)
    chosen = re.search(r"final model's step \(F1 on (\d+)\s+│ (\d+) \(", log)
    scored = re.findall(r"validation: step_0*(\d+) F1 ([\d.]+)(?:, valid answers ([\d.]+))?", log)
    validation = {int(s): float(f) for s, f, _ in scored}
    answered = {int(s): float(a) for s, _, a in scored if a}
    metrics = metrics_rows(folder)
    questions = []
    if (folder / "eval.json").exists():
        restored = json.loads((folder / "eval.json").read_text(encoding="utf-8"))
        questions = _questions(restored["after"], "after") + _questions(restored["before"], "before")
    seed = re.search(r"seed(\d+)$", folder.name)
    header = {
        "record": "run",
        "kind": "main-job",
        "recorded": evaluation.splitlines()[0],
        "provenance": {
            "command": f"python -m algos.red_grpo --seed {seed[1] if seed else 0}",
            "command_source": "docs/results/main-job.md (run.log does not print it; the folder name gives the seed)",
            "seed": int(seed[1]) if seed else 0,
            "missing": _missing(metrics, questions),
        },
        "summary": {
            "steps": int(steps[1]) if steps else None,
            "validation_questions": int(chosen[1]) if chosen else None,
            "chosen_step": int(chosen[2]) if chosen else None,
            "validation_f1": {str(k): v for k, v in sorted(validation.items())},
        },
        "files": ["eval.md"]
        + (["run.log"] if has_log else [])
        + (["metrics.jsonl"] if metrics else [])
        + (["eval.json"] if questions else []),
    }
    if not has_log:
        _without_log(header, evaluation, metrics)
    if answered:
        header["summary"]["validation_answered"] = {str(k): v for k, v in sorted(answered.items())}
    table = markdown_tables(evaluation)[0]
    return [header, *({"record": "row", "table": "before_after", **row} for row in table), *questions, *metrics]


def _without_log(header: dict[str, Any], evaluation: str, metrics: list[dict[str, Any]]) -> None:
    """A main job folder without run.log: its steps are its metrics rows (one a step; none stored: unknown), its
    validation fields stay empty (only run.log printed them), and its command is the cpu preset of the commit that
    added the folder, with the agent eval.md names (``--protocol coda`` for CoDA, flat was once the default)."""
    summary, provenance = header["summary"], header["provenance"]
    summary["steps"] = len(metrics) if metrics else None
    summary["steps_from"] = "metrics rows"
    if " coda agent" in evaluation.splitlines()[0]:
        provenance["command"] += " --protocol coda"
    provenance["command_source"] = (
        "the cpu preset of the commit that added the folder (no run.log: eval.md names the agent, the folder name "
        "gives the seed)"
    )


def is_legacy(folder: Path) -> bool:
    """Whether `folder` is one of the committed folders that predate the store: its name says so, and it has none of
    the files the store's own ingest reads first (a comparison's report.json, a trainer run's summary.json)."""
    return (
        folder.is_dir()
        and folder.name.startswith(LEGACY)
        and not (folder / "report.json").exists()
        and not (folder / "summary.json").exists()
    )


def stated(records: list[dict[str, Any]], command: str | None) -> list[dict[str, Any]]:
    """`records` with the command given at ingest as the run's, where one is given: a lever's run was started with
    flags that its files do not name, and the header's command would otherwise be the preset's."""
    if command is not None:
        records[0]["provenance"].update(command=command, command_source="given at ingest")
    return records


def legacy_records(folder: Path) -> list[dict[str, Any]]:
    """The records of a committed folder that predates the store (comparison or main job)."""
    if folder.name.startswith("compare-"):
        return comparison_records(folder)
    return main_job_records(folder)
