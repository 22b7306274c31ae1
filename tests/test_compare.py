"""The algorithm comparison end to end: tiny model, two-step budget, real env and retriever."""

from __future__ import annotations

import csv
import json

from benchmarks.compare import main


def test_compare_runs_end_to_end_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    argv = ["--budget", "tiny", "--algos", "grpo", "red_grpo", "--seeds", "2", "--out", str(out)]
    report = main(argv)

    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["algorithm"] for r in rows] == ["grpo", "red_grpo", "start model, no RL (baseline)"]
    assert all(0.0 <= float(r["f1"]) <= 1.0 and int(r["seeds"]) >= 1 for r in rows)
    assert float(rows[1]["tokens_trained"]) > 0
    table = (out / "table.md").read_text()
    assert "Protocol: flat" in table and "| red_grpo | 2 |" in table
    for plot in ("reward.png", "f1.png", "red_weights.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    assert len(report["runs"]) == 4 and report["protocol"] == "flat"
    red_rows = [json.loads(x) for x in (out / "runs" / "red_grpo-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert len(red_rows) == 2 and "red/final_weight" in red_rows[-1]

    # a second invocation redoes nothing: finished trainings and evaluations are kept
    summary = out / "runs" / "grpo-seed1" / "summary.json"
    evaluation = out / "evals" / "grpo-seed1.json"
    stamps = (summary.stat().st_mtime_ns, evaluation.stat().st_mtime_ns)
    main(argv)
    assert (summary.stat().st_mtime_ns, evaluation.stat().st_mtime_ns) == stamps
