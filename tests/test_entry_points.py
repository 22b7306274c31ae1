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


@pytest.mark.slow  # a whole run in its own process: the slow set keeps the default run short
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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--temperature", "-1"], "--temperature must be > 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--group-size", "1"], "--group-size must be >= 2 for red_grpo"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "-4"], "--steps must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--micro-batch-tokens", "0"], "--micro-batch-tokens must be >= 1"),
        (["--save-every", "-1"], "--save-every must be >= 0"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
        (["--clip-eps", "-0.2"], "--clip-eps must be > 0"),
        (["--max-retrieval-error-rate", "1.5"], "--max-retrieval-error-rate must be in [0, 1]"),
        (["--retriever-timeout", "0"], "--retriever-timeout must be > 0"),
        (["--max-train-minutes", "0"], "--max-train-minutes must be > 0"),
        (["--eval-questions", "-1"], "--eval-questions must be >= 0"),
        (["--tie-probe-questions", "5"], "--tie-probe-questions must be <= --questions-per-step"),
        (["--eval-split", "train"], "--eval-split must differ from --split"),
        (["--data-path", "mine.jsonl"], "--data-path trains on your own questions"),
    ],
)
def test_settings_that_cannot_train_are_usage_errors(flags, message, capsys):
    from algos import red_grpo

    with pytest.raises(SystemExit) as exit_info:
        red_grpo.main(["--preset", "tiny", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_the_warm_start_keeps_a_presets_own_step_size():
    """algos.sft's larger lr and batch replace the seed's RL defaults, never the values a preset chose."""
    from algos.run.cli import parse_config

    def parse(*args: str):
        return parse_config(list(args), algo="sft")

    gpu, cpu, flags = parse("--preset", "gpu"), parse("--preset", "cpu"), parse("--preset", "cpu", "--lr", "3e-5")
    assert (gpu.optim.lr, gpu.sft.sft_batch_size, gpu.sft.sft_coef) == (5e-5, 4, 1.0)
    assert (cpu.optim.lr, cpu.sft.sft_batch_size, cpu.sft.sft_coef) == (1e-4, 8, 1.0)
    assert (flags.optim.lr, flags.sft.sft_batch_size) == (3e-5, 8)


def test_group_size_one_is_fine_without_groups():
    """PPO and ArCHer use a value baseline, not group statistics: one episode per question is their default."""
    from algos.config import preset_config

    assert preset_config("tiny", algo="ppo", group_size=1).rl.group_size == 1
    with pytest.raises(ValueError, match="--group-size must be >= 2 for grpo"):
        preset_config("tiny", algo="grpo", group_size=1)


def test_user_mistakes_print_one_line_and_exit_2(tmp_path):
    """In a fresh process: no traceback, one line that names the flag, exit status 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "algos.grpo", "--preset", "tiny", "--run-dir", str(tmp_path), "--temperature", "0"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == "error: --temperature must be > 0 (sampling divides the logits by it), got 0.0\n"
    assert not (tmp_path / "metrics.jsonl").exists()


def _last_line(err: str) -> str:
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_data_and_run_directory_faults_are_one_line_errors(tmp_path, capsys):
    from algos import grpo, grpo_sft

    bad = tmp_path / "demos.jsonl"
    bad.write_text('{"token_ids": [1, 2], "loss_mask": [0, 1], "f1": 1.0}\n[1, 2, 3]\n')
    with pytest.raises(SystemExit) as exit_info:
        grpo_sft.main(["--preset", "tiny", "--run-dir", str(tmp_path / "a"), "--sft-data", str(bad)])
    assert exit_info.value.code == 2
    assert (
        _last_line(capsys.readouterr().err)
        == f"error: {bad}: line 2: expected a JSON object (one demonstration), got a list"
    )

    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--preset", "tiny", "--run-dir", str(tmp_path / "b"), "--num-questions", "100000"])
    assert exit_info.value.code == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("error: --num-questions 100000 is more than the 1325 questions of ") and "train" in line

    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--preset", "tiny", "--run-dir", str(tmp_path / "c"), "--resume"])
    assert exit_info.value.code == 1
    assert "no checkpoint in" in _last_line(capsys.readouterr().err)


def test_summary_table_in_a_log_file_keeps_long_rows_on_one_line(capsys, tmp_path):
    from algos.run.finish import print_summary

    run_dir = tmp_path / ("a-run-directory-with-a-long-name-" * 3)
    summary = {
        "run": "red_grpo-seed0",
        "algo": "red_grpo",
        "window": 10,
        "steps": 77,
        "wall_time_s": 1836.0,
        "process_wall_time_s": 1900.0,
        "reward_first": -3.0,
        "reward_last": -1.5,
        "f1_first": 0.0,
        "f1_last": 0.2,
        "sft_weight_last": 1.0,
        "checkpoint": str(run_dir / "checkpoint"),
        "final_model": str(run_dir / "final"),
        "metrics": str(run_dir / "metrics.jsonl"),
    }
    print_summary(summary)
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) > 80  # not wrapped at a terminal's 80 columns
    assert any(str(run_dir / "final") in line for line in out.splitlines())


def test_the_summary_ends_with_the_pictures_and_the_next_commands(capsys, tmp_path):
    """After the table: the learning curves' file, the command that scores the run again in its own env, and, for a
    wandb run logged offline, the command that uploads it."""
    from algos.run.finish import print_summary

    (tmp_path / "wandb" / "offline-run-20260101_000000-abcd1234").mkdir(parents=True)
    summary = {
        "run": "red_grpo-seed0",
        "algo": "red_grpo",
        "window": 1,
        "steps": 2,
        "wall_time_s": 10.0,
        "process_wall_time_s": 12.0,
        "reward_first": -3.0,
        "reward_last": -3.0,
        "f1_first": 0.0,
        "f1_last": 0.0,
        "sft_weight_last": 1.0,
        "checkpoint": str(tmp_path / "checkpoint"),
        "final_model": str(tmp_path / "final"),
        "metrics": str(tmp_path / "metrics.jsonl"),
        "run_dir": str(tmp_path),
        "curves": str(tmp_path / "curves.png"),
    }
    print_summary(summary)
    out = capsys.readouterr().out
    assert f"look at the learning curves: {tmp_path / 'curves.png'}" in out
    assert f"python -m benchmarks.evaluate --run-dir {tmp_path}" in out
    assert f"wandb sync {tmp_path / 'wandb' / 'offline-run-20260101_000000-abcd1234'}" in out
    assert "benchmarks.first_search" not in out  # no held-out evaluation ran, so no eval.json to split
