"""The algorithm comparison end to end: tiny model, two-step budget, real env and retriever."""

from __future__ import annotations

import csv
import json

import pytest

from algos.config import Config
from algos.evaluation import held_out_settings
from benchmarks.compare import main


def _trained_config(run_dir) -> Config:
    """The config a comparison run trained with, as its newest checkpoint recorded it."""
    state = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "state.json"
    saved = json.loads(state.read_text())["config"]
    return Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def test_compare_runs_end_to_end_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    argv = ["--budget", "tiny", "--algos", "grpo", "red_grpo", "--seeds", "2", "--out", str(out)]
    report = main(argv)

    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["algorithm"] for r in rows] == ["grpo", "red_grpo", "start model, no RL (baseline)"]
    assert [int(r["seeds"]) for r in rows] == [2, 2, 1]
    evals = {
        name: json.loads((out / "evals" / f"{name}.json").read_text()) for name in ("grpo-seed0", "red_grpo-seed1")
    }
    for result in evals.values():
        assert result["n"] == 4 and float(result["metrics"]["f1"]["mean"]) == pytest.approx(
            sum(p["f1"] for p in result["predictions"]) / 4
        )
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


def test_a_coda_comparison_evaluates_in_the_env_it_trained_in(tmp_path, monkeypatch):
    """Turn limits, context length and tokens per turn of the evaluation are the training run's own."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    main(["--budget", "tiny", "--protocol", "coda", "--algos", "red_grpo", "--seeds", "1", "--out", str(out)])
    trained = _trained_config(out / "runs" / "red_grpo-seed0")
    assert trained.protocol == "coda"
    for name in ("red_grpo-seed0", "untrained"):
        settings = json.loads((out / "evals" / f"{name}.json").read_text())["settings"]
        expected = held_out_settings(trained)
        assert settings["agent"] == "coda"
        assert settings["env_kwargs"] == expected["env_kwargs"]
        assert settings["env_kwargs"]["max_executor_turns"] == trained.max_executor_turns
        assert settings["max_context_tokens"] == trained.max_context_tokens
        assert settings["max_new_tokens"] == trained.max_new_tokens
