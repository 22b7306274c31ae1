"""The three entry points run end to end (tiny preset, 2 steps, CPU), as a researcher would call them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.models import load_model

ROOT = Path(__file__).resolve().parents[1]
RED_KEYS = ("red/entropy_weight", "red/accuracy_factor", "red/final_weight", "red/batch_accuracy")
COMMON_KEYS = ("critic/rewards/mean", "answer_f1/mean", "format_scores/mean", "loss_pg", "time/generation", "tokens/s")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("module", ["grpo", "grpo_sft"])
def test_entry_point_in_process(module, tmp_path):
    import importlib

    summary = importlib.import_module(f"algos.{module}").main(["--preset", "tiny", "--run-dir", str(tmp_path)])
    assert summary["steps"] == 2 and summary["algo"] == module
    rows = _metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    for key in COMMON_KEYS:
        assert key in rows[-1], key
    assert ("loss_sft" in rows[-1]) == (module == "grpo_sft")
    model, _ = load_model(summary["final_model"], device="cpu")  # the final model is a Hugging Face directory
    assert model.config.num_hidden_layers == 2


def test_red_grpo_command_line(tmp_path):
    """`python -m algos.red_grpo --preset tiny` in a fresh process, with wandb offline; then --resume is a no-op."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "algos.red_grpo", "--preset", "tiny", "--run-dir", str(tmp_path), "--wandb"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final model" in done.stdout
    rows = _metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    for key in RED_KEYS + COMMON_KEYS + ("loss_sft", "sft/entropy"):
        assert key in rows[-1], key
    assert 1.0 <= rows[-1]["red/final_weight"] <= 25.0
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_help_lists_the_settings(capsys):
    from algos import red_grpo

    with pytest.raises(SystemExit) as exit_info:
        red_grpo.main(["--preset", "tiny", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--steps", "--sft-coef", "--red-max-factor", "--resume", "--lora", "--kl-coef"):
        assert flag in text, flag
