"""A comparison is what it says: the settings it owns cannot be set twice, each system is one row, and what it finds
in `--out` from an earlier invocation is reused only when it was made with the settings asked for now."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare import main
from benchmarks.compare_checks import flag_names, owned_problem
from benchmarks.compare_runs import parse_system


def _refused(argv: list[str], tmp_path, capsys) -> str:
    """Run the comparison; its error line (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        main(["--budget", "tiny", "--out", str(tmp_path / "out"), *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error: " in line]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algos", "grpo", "grpo:seed=5"], "--algos grpo:seed=5 sets seed, which the comparison sets for every run"),
        (["--train-arg=--seed=5"], "--train-arg sets seed, which the comparison sets for every run: use --seeds N"),
        (["--train-arg=--seed", "--train-arg=5"], "--train-arg sets seed"),
        (["--algos", "grpo:run_dir=/x"], "--algos grpo:run_dir=/x sets run_dir, which the comparison sets"),
        (
            ["--train-arg=--max-train-minutes", "--train-arg=25"],
            "sets max_train_minutes, which the comparison sets for every run: use --minutes",
        ),  # fmt: skip
        (["--train-arg=--eval-questions=3"], "sets eval_questions"),
        (["--train-arg=--steps=9"], "sets steps"),
        (["--train-arg=--model=x"], "sets model, which the comparison sets for every run: use --init-model"),
        (["--algos", "red_grpo:protocol=coda"], "sets protocol"),
        (["--algos", "grpo", "grpo"], "--algos grpo and grpo are the same system: give each once"),
        (["--algos", "grpo_sft:sft_coef=0.4,lr=1e-5", "grpo_sft:lr=1e-5,sft_coef=0.4"], "are the same system"),
        (["--minutes", "0"], "--minutes must be a number > 0, got 0.0"),
    ],
)
def test_what_the_comparison_owns_is_refused_before_anything_trains(argv, message, tmp_path, capsys):
    assert message in _refused(argv, tmp_path, capsys)
    assert not (tmp_path / "out" / "runs").exists()


def test_flag_names_read_every_spelling_of_a_flag():
    assert flag_names(["--seed=5", "--no-wandb", "5", "--max-train-minutes", "-1"]) == [
        "seed",
        "wandb",
        "max_train_minutes",
    ]
    assert owned_problem("x", ["lr", "sft_coef"]) is None
    assert parse_system("grpo_sft:sft_coef=0.4").flags == ("--sft-coef", "0.4")


@pytest.mark.slow  # a run of its own: the default set's twin is test_compare.py's end-to-end test (the refusals)
def test_a_rerun_with_other_settings_is_refused_or_scored_anew_and_the_header_says_what_ran(
    tmp_path, monkeypatch, capsys
):
    """Cached runs are keyed by the trainer's saved config, cached evaluations by their own settings: other steps are
    refused naming the difference; other held-out questions are scored anew; the header reads the runs."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "out"
    argv = ["--budget", "tiny", "--algos", "grpo", "--seeds", "1", "--no-baseline", "--out", str(out)]
    main(argv)
    summary, evaluation = out / "runs" / "grpo-seed0" / "summary.json", out / "evals" / "grpo-seed0.json"
    header = (out / "table.md").read_text().splitlines()[0]
    assert "(2 steps of preset tiny)" in header and "seeds: 0;" in header and "the first 4 HotpotQA" in header
    trained = summary.stat().st_mtime_ns

    line = _refused([*argv[2:], "--steps", "3"], tmp_path, capsys)  # argv[2:]: without the budget given again
    assert "grpo-seed0 was trained with other settings than this comparison asks (steps 2 -> 3)" in line

    line = _refused([*argv[2:], "--eval-limit", "2", "--report-only"], tmp_path, capsys)
    assert "grpo-seed0.json was scored with other settings" in line and "'questions': 4" in line

    main([*argv, "--eval-limit", "2"])  # the same run, scored anew on 2 questions
    assert summary.stat().st_mtime_ns == trained
    assert json.loads(evaluation.read_text())["n"] == 2
    assert "the first 2 HotpotQA" in (out / "table.md").read_text().splitlines()[0]
    assert "scoring it anew" in capsys.readouterr().out
