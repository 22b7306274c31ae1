"""The results store: every run a results page cites, as gzip JSON lines in ``benchmarks/results/store/``.

    python -m benchmarks.report ingest runs/red_grpo-cpu-seed0            # a trainer run directory
    python -m benchmarks.report ingest runs/compare-flat                  # a comparison's --out
    python -m benchmarks.report ingest result.json --name coda-dev       # evaluate --result, env_overhead --json

One file per run, ``<name>.jsonl.gz``, one JSON object a line, each with a ``record`` field: ``run`` first (name, kind,
the files it was read from, the provenance of `envs.provenance` or, for a run that predates it, what its files
state, and its summary figures), then ``question`` (per question: id, index, EM, F1, answered, searches, planner
tasks, invalid actions, error flags, first-search class), ``metrics`` (the run's metrics.jsonl rows) and ``row``
(a recorded table row, for runs whose per-question results were never kept). No passage or answer text. The files
are written byte for byte the same for the same records (gzip without a time stamp), so git sees only real changes.
`tests/test_report.py` holds the store to `BUDGET_BYTES`.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.results_questions import question_records

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STORE = RESULTS / "store"
BUDGET_BYTES = 20 * 2**20
"""The most the whole store may hold (20 MiB)."""


@dataclass
class StoredRun:
    """One stored run: its ``run`` record and its other records by kind."""

    name: str
    header: dict[str, Any]
    questions: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def question_scores(self, metric: str, part: str = "after") -> dict[str, float]:
        """`metric` by question id for one part of the run (``after``: the trained model; ``before``; a system)."""
        return {q["id"]: float(q[metric]) for q in self.questions if q.get("part", "after") == part}


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write `records` as gzip JSON lines, the same bytes for the same records."""
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False, allow_nan=True) + "\n" for r in records)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as handle:
        handle.write(text.encode("utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one store file."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def names(store: Path = STORE) -> list[str]:
    """The stored runs' names."""
    return sorted(p.name.removesuffix(".jsonl.gz") for p in store.glob("*.jsonl.gz"))


def load(name: str, store: Path = STORE) -> StoredRun:
    """One stored run by name; a missing one is a one-line error naming the runs there are."""
    path = store / f"{name}.jsonl.gz"
    if not path.exists():
        raise SystemExit(f"no stored run {name!r} in {store}; stored: {', '.join(names(store)) or 'none'}")
    records = read_records(path)
    run = StoredRun(name, records[0])
    kinds = {"question": run.questions, "metrics": run.metrics, "row": run.rows}
    for record in records[1:]:
        kinds[record["record"]].append(record)
    return run


def store_bytes(store: Path = STORE) -> int:
    """The store's size on disk."""
    return sum(p.stat().st_size for p in store.glob("*.jsonl.gz"))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"record": "metrics", **row} for row in rows]


def _summary_metrics(result: dict[str, Any]) -> dict[str, Any]:
    return {name: value.get("mean") for name, value in result.get("metrics", {}).items()}


def _provenance(run_dir: Path, *sources: dict[str, Any]) -> dict[str, Any] | None:
    """The run's provenance: its provenance.json, else the one its eval.json or summary holds (None: none)."""
    path = run_dir / "provenance.json"
    if path.exists():
        return _read_json(path)
    return next((s["provenance"] for s in sources if s.get("provenance")), None)


def ingest_trainer_run(run_dir: Path, first_search: bool = True) -> list[dict[str, Any]]:
    """The records of a trainer's run directory: eval.json (both models, per question), metrics.jsonl, and the
    provenance and summary it wrote (summary.json; final/'s redcoda_config.json)."""
    evaluation = _read_json(run_dir / "eval.json")
    summary = _read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else {}
    config_path = run_dir / "redcoda_config.json"
    header = {
        "record": "run",
        "kind": "training",
        "provenance": _provenance(run_dir, evaluation, summary),
        "config": _read_json(config_path) if config_path.exists() else None,
        "summary": {k: v for k, v in summary.items() if k != "provenance"},
        "held_out": {part: _summary_metrics(evaluation[part]) for part in ("before", "after")},
        "settings": evaluation.get("settings"),
    }
    questions = question_records(evaluation["after"], "after", first_search)
    questions += question_records(evaluation["before"], "before", False)
    return [header, *questions, *_metrics_rows(run_dir)]


def ingest_comparison(out: Path, first_search: bool = True) -> list[dict[str, Any]]:
    """The records of a `benchmarks.compare` --out: report.json, every evaluation's per-question results (each run
    a part named ``<system>-seed<s>``) and every run's metrics rows (with a ``run`` field)."""
    report = _read_json(out / "report.json")
    header = {"record": "run", "kind": "comparison", **{k: v for k, v in report.items() if k != "plots"}}
    records: list[dict[str, Any]] = [header]
    for path in sorted((out / "evals").glob("*.json")):
        records += question_records(_read_json(path), path.stem, first_search)
    if (out / "table.md").exists():  # its tables too, as the report's blocks read a committed comparison's
        from benchmarks.results_legacy import comparison_records

        records += comparison_records(out)[1:]
    for run_dir in sorted((out / "runs").glob("*")):
        records += [{**row, "run": run_dir.name} for row in _metrics_rows(run_dir)]
    return records


def ingest_result(path: Path, first_search: bool = True) -> list[dict[str, Any]]:
    """The records of one result file: `benchmarks.evaluate --result` (per question) or a benchmark's --json."""
    data = _read_json(path)
    if "predictions" not in data:
        return [{"record": "run", "kind": data.get("kind", "benchmark"), **data}]
    header = {"record": "run", "kind": "evaluation", **{k: v for k, v in data.items() if k != "predictions"}}
    return [header, *question_records(data, "after", first_search)]


def ingest(source: Path, name: str, first_search: bool = True, store: Path = STORE, command: str | None = None) -> Path:
    """Ingest a run directory, a comparison's --out or a result file into the store as `name`. `command` states the
    command of a run that predates the store, whose files do not name it (`benchmarks.results_legacy.stated`)."""
    from benchmarks.results_legacy import is_legacy, legacy_records, stated

    source = Path(source)
    if command is not None and not is_legacy(source):
        raise SystemExit(f"{source}: --command is only for a run that predates the store (compare-*, main-job-*)")
    if is_legacy(source):  # first: one may hold an eval.json restored from the git history
        records = stated(legacy_records(source), command)
    elif source.is_dir() and (source / "eval.json").exists():
        records = ingest_trainer_run(source, first_search)
    elif source.is_dir() and (source / "report.json").exists():
        records = ingest_comparison(source, first_search)
    elif source.is_file():
        records = ingest_result(source, first_search)
    else:
        raise SystemExit(f"{source}: not a run directory (eval.json), a comparison (report.json) or a result file")
    records[0]["name"] = name
    records[0].setdefault("source", str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else source.name)
    return write_records(store / f"{name}.jsonl.gz", records)


def system_slug(system: str) -> str:
    """A comparison system's name as its runs' parts begin (``<slug>-seed<s>``), the way `benchmarks.compare` names
    their folders: grpo_sft:sft_coef=0.4 -> grpo_sft-sft_coef0.4."""
    return system.replace(":", "-").replace(",", "-").replace("=", "")


def mean_over(runs: Sequence[StoredRun], metric: str, parts: Sequence[str] | str = "after") -> dict[str, float]:
    """Per question id, the mean of `metric` over `runs` (seeds, each its own part) on the questions all scored."""
    parts = [parts] * len(runs) if isinstance(parts, str) else list(parts)
    scores = [run.question_scores(metric, part) for run, part in zip(runs, parts, strict=True)]
    common = set.intersection(*(set(s) for s in scores)) if scores else set()
    return {q: sum(s[q] for s in scores) / len(scores) for q in sorted(common)}


def paired_stats(
    a: str, b: str, metric: str = "f1", store: Path = STORE, without_yes_no: bool = False
) -> dict[str, float | int]:
    """`a` - `b` by question (each side a comma-joined list of ``NAME[:PART]``, averaged per question); with
    `without_yes_no`, over the questions whose gold answer is not yes or no."""
    from envs.stats import paired_difference, paired_permutation_p

    sides, yes_no, loaded = [], set(), {}
    for side in (a, b):
        runs, parts = [], []
        for item in side.split(","):
            name, _, part = item.partition(":")
            run = loaded[name] = loaded.get(name) or load(name, store)  # a comparison's seeds share one file
            if not run.questions:
                raise SystemExit(f"{name}: the store holds no per-question results for it")
            runs.append(run)
            parts.append(part or "after")
            yes_no |= {q["id"] for q in run.questions if q.get("first_search") == "yes/no"}
        sides.append(mean_over(runs, metric, parts))
    questions = sorted(set(sides[0]) & set(sides[1]) - (yes_no if without_yes_no else set()))
    if not questions:
        raise SystemExit(f"{a} and {b} share no scored question")
    x, y = [sides[0][q] for q in questions], [sides[1][q] for q in questions]
    difference = paired_difference(x, y)
    return {
        "n": len(questions),
        "difference": difference.mean,
        "low": difference.low,
        "high": difference.high,
        "p": paired_permutation_p(x, y),
    }
