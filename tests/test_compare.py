"""The algorithm comparison end to end: tiny model, two-step budget, real env and retriever."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from algos.config import Config
from algos.run.evaluation import held_out_settings
from benchmarks.compare import main
from benchmarks.compare_runs import ClaimedElsewhere, _trained_code, claimed

ROOT = Path(__file__).resolve().parent.parent


def _trained_config(run_dir) -> Config:
    """The config a comparison run trained with, as its newest checkpoint recorded it (kept in summary.json)."""
    saved = json.loads((run_dir / "summary.json").read_text())["config"]
    return Config().with_values(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def _scores(out, name) -> dict:
    return json.loads((out / "evals" / f"{name}.json").read_text())["metrics"]


def _per_question(out, name, metric) -> dict[str, float]:
    predictions = json.loads((out / "evals" / f"{name}.json").read_text())["predictions"]
    return {p["id"]: p[metric] for p in predictions}


def test_compare_runs_end_to_end_and_resumes(tmp_path, monkeypatch, capsys):
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
    trained = _trained_config(out / "runs" / "red_grpo-seed1")
    for result in evals.values():
        assert result["settings"]["env_kwargs"] == held_out_settings(trained)["env_kwargs"]
        assert result["n"] == 4 and float(result["metrics"]["f1"]["mean"]) == pytest.approx(
            sum(p["f1"] for p in result["predictions"]) / 4
        )
    assert float(rows[1]["tokens_trained"]) > 0
    assert float(rows[0]["answered"]) == pytest.approx(
        (evals["grpo-seed0"]["metrics"]["answered"]["mean"] + _scores(out, "grpo-seed1")["answered"]["mean"]) / 2
    )
    table = (out / "table.md").read_text()
    assert "Protocol: flat" in table and "| red_grpo | 2 |" in table
    assert "| red_grpo-seed1 | 2 |" in table  # one line per run
    for plot in ("reward.png", "f1.png", "answered.png", "sft_weight.png", "red_weights.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    assert len(report["runs"]) == 4 and report["protocol"] == "flat"
    git = shutil.which("git")
    head = subprocess.run([git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout if git else ""
    if head.strip():  # in a git checkout every run and the report name the commit that ran
        commit = head.strip()
        assert report["code"].startswith(commit) and all(r["code"].startswith(commit) for r in report["runs"])
        for name in ("red_grpo-seed0", "grpo-seed1"):  # written as the training started
            assert (out / "runs" / name / "code_versions.txt").read_text().startswith(commit)
    # RED against each other system, paired by question, each system's question score the mean of its seeds
    test = next(t for t in report["paired"] if t["other"] == "grpo" and t["metric"] == "f1")
    red = [_per_question(out, f"red_grpo-seed{s}", "f1") for s in (0, 1)]
    grpo = [_per_question(out, f"grpo-seed{s}", "f1") for s in (0, 1)]
    expected = sum((red[0][q] + red[1][q]) / 2 - (grpo[0][q] + grpo[1][q]) / 2 for q in red[0]) / 4
    assert test["questions"] == 4 and test["difference"] == pytest.approx(expected)
    assert 0 < test["p"] <= 1 and "| red_grpo - grpo | f1 |" in table
    without = next(t for t in report["paired"] if t["other"] == "grpo" and t["metric"] == "f1 without yes/no")
    assert without["questions"] == 4  # dev 0-3: no yes/no question among them, so the same test
    assert {t["other"] for t in report["paired"]} == {"grpo", "start model"}
    # the provenance of the report, each run and each evaluation; ingested, the store pairs the same way
    assert report["provenance"]["machine"]["cores"] >= 1 and report["provenance"]["packages"]["torch"]
    run_record = json.loads((out / "runs" / "red_grpo-seed0" / "summary.json").read_text())["provenance"]
    assert run_record["seed"] == 0 and run_record["model"]["hash"] and run_record["data"]["corpus"]["hash"]
    assert evals["grpo-seed0"]["provenance"]["data"]["questions"]["hash"]
    from benchmarks.report import paired_stats
    from benchmarks.results_store import ingest, load

    ingest(out, "cmp", first_search=False, store=tmp_path / "store")
    seeds = "cmp:{0}-seed0,cmp:{0}-seed1"
    stored = paired_stats(seeds.format("red_grpo"), seeds.format("grpo"), store=tmp_path / "store")
    assert stored["difference"] == pytest.approx(test["difference"]) and stored["p"] == pytest.approx(test["p"])
    assert {r["table"] for r in load("cmp", tmp_path / "store").rows} == {"systems", "paired", "runs"}
    red_rows = [json.loads(x) for x in (out / "runs" / "red_grpo-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert len(red_rows) == 2 and "red/final_weight" in red_rows[-1]
    # a finished run keeps its final model and drops its checkpoint (1.6 GB for SmolLM2-135M): nothing to resume
    assert (out / "runs" / "red_grpo-seed0" / "final" / "config.json").exists()
    assert not (out / "runs" / "red_grpo-seed0" / "checkpoints").exists()
    assert _trained_config(out / "runs" / "red_grpo-seed0").run.keep_checkpoints == 1

    # a second invocation redoes nothing: finished trainings and evaluations are kept
    summary = out / "runs" / "grpo-seed1" / "summary.json"
    evaluation = out / "evals" / "grpo-seed1.json"
    stamps = (summary.stat().st_mtime_ns, evaluation.stat().st_mtime_ns)
    main(argv)
    assert (summary.stat().st_mtime_ns, evaluation.stat().st_mtime_ns) == stamps
    # ... and one asking other settings refuses them, naming what differs, before anything trains or is scored
    header = table.splitlines()[0]
    assert "(2 steps of preset tiny)" in header and "seeds: 0, 1;" in header and "the first 4 HotpotQA" in header
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--steps", "3"])
    assert "(steps 2 -> 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--eval-limit", "2", "--report-only"])
    assert "grpo-seed0.json was scored with other settings" in capsys.readouterr().err
    assert (summary.stat().st_mtime_ns, evaluation.stat().st_mtime_ns) == stamps

    # --report-only: the report over what is finished, training and scoring nothing (a third seed is not there yet)
    report = main([*argv, "--seeds", "3", "--report-only"])
    assert not (out / "runs" / "grpo-seed2").exists() and [r["seeds"] for r in report["rows"]] == [2, 2, 1]
    assert "left out of this report: grpo-seed2, red_grpo-seed2." in (out / "table.md").read_text()
    with pytest.raises(SystemExit, match="nothing finished"):
        main(["--budget", "tiny", "--algos", "grpo_sft", "--no-baseline", "--report-only", "--out", str(out)])


@pytest.mark.slow  # a whole run in its own process: the slow set keeps the default run short
def test_a_coda_comparison_evaluates_in_the_env_it_trained_in(tmp_path, monkeypatch):
    """The whole pipeline in CoDA; every evaluation's turn limits, context length and tokens per turn are the runs'."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    report = main(["--budget", "tiny", "--protocol", "coda", "--seeds", "1", "--out", str(out)])  # all three
    assert [row["algorithm"] for row in report["rows"]][:3] == ["grpo", "grpo_sft", "red_grpo"]
    assert {t["other"] for t in report["paired"]} == {"grpo", "grpo_sft", "start model"}
    trained = _trained_config(out / "runs" / "red_grpo-seed0")
    assert trained.env.protocol == "coda"
    for name in ("grpo-seed0", "grpo_sft-seed0", "red_grpo-seed0", "untrained"):
        settings = json.loads((out / "evals" / f"{name}.json").read_text())["settings"]
        expected = held_out_settings(trained)
        assert settings["agent"] == "coda"
        assert settings["env_kwargs"] == expected["env_kwargs"]
        assert settings["env_kwargs"]["max_executor_turns"] == trained.env.max_executor_turns
        assert settings["max_context_tokens"] == trained.model.max_context_tokens
        assert settings["max_new_tokens"] == trained.rl.max_new_tokens


def test_an_interrupted_run_continues_from_its_checkpoint(tmp_path, monkeypatch):
    """A training stopped after its first checkpoint resumes there: its steps are not redone, and the whole run
    equals one trained without the stop."""
    from algos.red_grpo import main as red_grpo

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    run_dir = out / "runs" / "red_grpo-seed0"
    # what an interruption after step 1 of 2 leaves: the comparison's trainer flags, one checkpoint, no summary
    red_grpo(["--preset", "tiny", "--seed", "0", "--steps", "1", "--protocol", "flat", "--run-dir", str(run_dir),
              "--eval-questions", "0", "--keep-checkpoints", "1"])  # fmt: skip
    first = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 1 and (run_dir / "checkpoints" / "latest").exists()
    argv = ["--budget", "tiny", "--algos", "red_grpo", "--seeds", "1", "--no-baseline", "--out", str(out)]
    with open(run_dir / ".compare.lock", "a+") as held:  # another invocation is training this run right now
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="nothing finished .* red_grpo-seed0"):  # skipped, and nothing else ran
            main(argv)
    assert (run_dir / "metrics.jsonl").read_text().splitlines() == first  # untouched
    main(argv)  # the lock died with its holder
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and rows[0] == first[0]  # step 1 kept as it was, step 2 trained after the resume

    uninterrupted = tmp_path / "once"
    main(["--budget", "tiny", "--algos", "red_grpo", "--seeds", "1", "--no-baseline", "--out", str(uninterrupted)])
    again = [
        json.loads(r) for r in (uninterrupted / "runs" / "red_grpo-seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    for key in ("critic/rewards/mean", "sft/nll", "loss_pg"):
        assert [json.loads(r)[key] for r in rows] == pytest.approx([r[key] for r in again], abs=1e-5)


@pytest.mark.slow  # a whole run in its own process: the slow set keeps the default run short
def test_regime_two_with_a_fixed_sft_weight_as_a_system_of_its_own(tmp_path, monkeypatch):
    """Every run and the baseline start from one shared SFT warm start; `grpo_sft:sft_coef=0.4` is GRPO + SFT with its
    own weight, trained, scored, paired against RED and named as a system."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    systems = ["red_grpo", "grpo_sft:sft_coef=0.4"]
    report = main(
        ["--budget", "tiny", "--algos", *systems, "--seeds", "1", "--warm-start-steps", "1", "--out", str(out)]
    )
    warm = out / "runs" / "warm-start"
    assert len((warm / "metrics.jsonl").read_text().splitlines()) == 1  # the SFT warm start's one step
    assert (warm / "final" / "config.json").exists() and not (warm / "checkpoints").exists()
    assert not (warm / "eval.json").exists()  # scored once, as the baseline row
    variant = _trained_config(out / "runs" / "grpo_sft-sft_coef0.4-seed0")
    assert variant.run.algo == "grpo_sft" and variant.sft.sft_coef == 0.4
    assert _trained_config(out / "runs" / "red_grpo-seed0").sft.sft_coef != 0.4
    for run in ("red_grpo-seed0", "grpo_sft-sft_coef0.4-seed0"):
        assert _trained_config(out / "runs" / run).model.model == str(warm / "final")
    table = (out / "table.md").read_text()
    assert str(warm / "final") in table  # the header names the start model
    assert "| grpo_sft:sft_coef=0.4 | 1 |" in table and "| red_grpo - grpo_sft:sft_coef=0.4 | f1 |" in table
    assert [row["algorithm"] for row in report["rows"]] == [*systems, "start model, no RL (baseline)"]
    assert json.loads((out / "evals" / "untrained.json").read_text())["n"] == 4
    # the report is re-made from the runs' files alone: the models (warm start included) can stay behind
    for final in out.glob("runs/*/final"):
        shutil.rmtree(final)
    again = main(["--budget", "tiny", "--algos", *systems, "--seeds", "1", "--warm-start-steps", "1", "--out", str(out),
                  "--report-only"])  # fmt: skip
    assert json.dumps(again["rows"]) == json.dumps(report["rows"])  # (NaN intervals of one seed compare as text)
    for bad in ("grpo_sft:sft_coef", "grpo_sft:no_such_setting=1", "ppo", "sft:lr"):
        with pytest.raises(SystemExit):
            main(["--budget", "tiny", "--algos", bad, "--out", str(out)])


def test_the_paired_f1_without_yes_no_questions_leaves_exactly_them_out():
    from benchmarks.compare_report import paired_tests

    def scored(f1s):  # questions 0 and 2 are yes/no
        golds = ("yes", "Paris", "No", "Rome")
        return [{"predictions": [{"id": str(i), "gold_answers": [g], "f1": f, "em": f, "answered": 1.0}
                                 for i, (g, f) in enumerate(zip(golds, f1s, strict=True))]}]  # fmt: skip

    tests = paired_tests({"red_grpo": scored([1, 1, 1, 0]), "grpo": scored([0, 0, 0, 0])}, "red_grpo")
    by_metric = {t["metric"]: t for t in tests}
    assert (by_metric["f1"]["questions"], by_metric["f1"]["difference"]) == (4, 0.75)
    assert (by_metric["f1 without yes/no"]["questions"], by_metric["f1 without yes/no"]["difference"]) == (2, 0.5)


def test_a_trainer_outliving_its_comparison_keeps_the_run_claimed(tmp_path):
    """Killing a comparison leaves its trainer running (an orphan); the run stays claimed until the trainer ends,
    so a stream beside it skips the run instead of resuming it under the running trainer."""
    run_dir = tmp_path / "red_grpo-seed0"
    started = tmp_path / "trainer.pid"
    trainer = f"import os, time; open({str(started)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    comparison = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from benchmarks.compare_runs import claimed, run_holding\n"
            f"with claimed(Path({str(run_dir)!r})) as claim: run_holding(claim, [sys.executable, '-c', {trainer!r}])",
        ],
        cwd=ROOT,
    )
    try:
        for _ in range(600):
            if started.exists() and started.read_text():
                break
            time.sleep(0.05)
        assert started.exists(), "the trainer never started"
        comparison.kill()
        comparison.wait()
        trainer_pid = int(started.read_text())
        os.kill(trainer_pid, 0)  # the trainer goes on without its comparison
        with pytest.raises(ClaimedElsewhere, match=f"trainer process {trainer_pid}"), claimed(run_dir):
            pass
    finally:
        comparison.kill()
        if started.exists() and started.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(started.read_text()), signal.SIGKILL)
    for _ in range(600):  # the lock goes with the last process holding it
        try:
            with claimed(run_dir):
                break
        except ClaimedElsewhere:
            time.sleep(0.05)
    else:
        raise AssertionError("the run stayed claimed after its trainer ended")


def test_a_run_names_the_code_that_trained_it_not_the_code_checked_out_later(tmp_path):
    run_dir = tmp_path / "red_grpo-seed0"
    run_dir.mkdir()
    (run_dir / "code_versions.txt").write_text("aaa\naaa\n")  # started, then resumed under the same commit
    assert _trained_code(run_dir) == "aaa"
    with (run_dir / "code_versions.txt").open("a") as versions:
        versions.write("bbb+changes\n")  # resumed again after a checkout
    assert _trained_code(run_dir) == "aaa then bbb+changes"


def test_a_run_being_scored_by_one_stream_is_skipped_by_the_other(tmp_path):
    """Two streams can both find a run trained and not yet scored; only one evaluates it, the other goes on."""
    from benchmarks.compare_runs import evaluate_run

    evals = tmp_path / "evals"
    with claimed(evals, lock=".red_grpo-seed0.lock", doing="evaluated (red_grpo-seed0)"):
        with pytest.raises(ClaimedElsewhere, match=r"evaluated \(red_grpo-seed0\)"):
            evaluate_run("red_grpo-seed0", "unused", None, None, evals)
        (evals / "red_grpo-seed0.json").write_text('{"metrics": {"f1": 0.5}}')  # the holder finishes
    # scored: read, not redone (the model, budget and config are never touched)
    assert evaluate_run("red_grpo-seed0", "unused", None, None, evals) == {"metrics": {"f1": 0.5}}


def test_sft_alone_is_a_system_with_variants_like_the_others():
    """`sft` (SFT only, `python -m algos.sft`) is accepted beside the RL systems; `sft:lr=5e-5` is a variant of it."""
    from benchmarks.compare_runs import ALGOS, parse_system

    assert "sft" not in ALGOS  # the default systems stay the three RL ones
    plain, variant = parse_system("sft"), parse_system("sft:lr=5e-5,sft_batch_size=2")
    assert (plain.name, plain.algo, plain.flags, plain.slug) == ("sft", "sft", (), "sft")
    assert variant.algo == "sft" and variant.flags == ("--lr", "5e-5", "--sft-batch-size", "2")
    assert variant.slug == "sft-lr5e-5-sft_batch_size2"
    with pytest.raises(ValueError, match="names no setting"):
        parse_system("sft:")


@pytest.mark.parametrize("budget_name", ["cpu", "tiny"])
def test_the_sft_arm_runs_algos_sft_with_the_budget_of_every_other_system(tmp_path, budget_name):
    """Its command is the RL systems' with `algos.sft` in place of `algos.<algo>`: the same steps, minutes limit,
    start model and seed; parsed as `python -m algos.sft` parses it, its own defaults and the system's flags."""
    import dataclasses

    from algos.run.cli import parse_config
    from benchmarks.compare_runs import BUDGETS, train_command

    budget = dataclasses.replace(BUDGETS[budget_name], train_args=(*BUDGETS[budget_name].train_args, "--model", "M"))
    run_dir = tmp_path / "run"
    rl = train_command("grpo_sft", 1, budget, "flat", run_dir, threads=1)
    sft = train_command("sft", 1, budget, "flat", run_dir, threads=1)
    assert sft[1:3] == ["-m", "algos.sft"] and rl[1:3] == ["-m", "algos.grpo_sft"]
    assert sft[3:] == rl[3:]
    args = sft[3:]
    config = parse_config(args, algo="sft")
    rl_config = parse_config(rl[3:], algo="grpo_sft")
    assert config.run.algo == "sft" and config.model.model == "M" and config.run.seed == 1
    assert (config.optim.steps, config.optim.max_train_minutes) == (
        rl_config.optim.steps,
        rl_config.optim.max_train_minutes,
    )
    assert config.optim.steps == budget.steps_for("flat")
    assert config.sft.sft_coef == 1.0  # SFT alone: its loss is the whole objective
    variant = train_command("sft", 1, budget, "flat", run_dir, flags=("--lr", "5e-5"))
    assert parse_config(variant[3:], algo="sft").optim.lr == 5e-5  # the system's flags decide


def test_the_pairing_takes_in_the_sft_arm():
    """RED minus every other system, `sft` among them; without RED, `sft` minus every other system."""
    from benchmarks.compare_report import paired_tests, pairing_reference

    def scored(f1s):
        return [{"predictions": [{"id": str(i), "gold_answers": ["Paris"], "f1": f, "em": f, "answered": 1.0}
                                 for i, f in enumerate(f1s)]}]  # fmt: skip

    evals = {"red_grpo": scored([1, 1, 0]), "sft": scored([1, 0, 0]), "grpo": scored([0, 0, 0])}
    assert pairing_reference(list(evals)) == "red_grpo"
    tests = paired_tests(evals, pairing_reference(list(evals)))
    assert {(t["reference"], t["other"]) for t in tests} == {("red_grpo", "sft"), ("red_grpo", "grpo")}
    without_red = {"grpo": evals["grpo"], "sft": evals["sft"], "start model": scored([0, 0, 0])}
    assert pairing_reference(list(without_red)) == "sft"
    tests = paired_tests(without_red, "sft")
    assert {t["other"] for t in tests} == {"grpo", "start model"}
    f1 = next(t for t in tests if t["other"] == "grpo" and t["metric"] == "f1")
    assert f1["difference"] == pytest.approx(1 / 3)
    assert pairing_reference(["grpo", "grpo_sft"]) == "grpo"  # neither: the first system, as before


@pytest.mark.slow
def test_the_sft_arm_continues_the_warm_start_and_is_paired(tmp_path, monkeypatch):
    """Regime 2 with the SFT-only arm as a variant: trained by `algos.sft` from the shared warm start for the same
    steps as RED, scored on the same questions and paired against RED."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "cmp"
    systems = ["red_grpo", "sft:lr=5e-5"]
    argv = ["--budget", "tiny", "--algos", *systems, "--seeds", "1", "--warm-start-steps", "1", "--no-baseline"]
    report = main([*argv, "--out", str(out)])
    warm = out / "runs" / "warm-start"
    sft, red = _trained_config(out / "runs" / "sft-lr5e-5-seed0"), _trained_config(out / "runs" / "red_grpo-seed0")
    assert sft.run.algo == "sft" and sft.optim.lr == 5e-5 and sft.model.model == red.model.model == str(warm / "final")
    assert (
        sft.optim.steps
        == red.optim.steps
        == len((out / "runs" / "sft-lr5e-5-seed0" / "metrics.jsonl").read_text().splitlines())
    )
    assert _per_question(out, "sft-lr5e-5-seed0", "f1").keys() == _per_question(out, "red_grpo-seed0", "f1").keys()
    assert [row["algorithm"] for row in report["rows"]] == systems
    assert {t["other"] for t in report["paired"]} == {"sft:lr=5e-5"}
    assert "| red_grpo - sft:lr=5e-5 | f1 |" in (out / "table.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--eval-limit", "0"], "--eval-limit must be >= 1, got 0"),
        (["--steps", "-1"], "--steps must be >= 1, got -1"),
        (["--warm-start-steps", "-1"], "--warm-start-steps must be >= 0, got -1"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--max-error-rate", "2"], "--max-error-rate is a share in [0, 1], got 2.0"),
        (["--algos", "nope"], "unknown algorithm 'nope'"),
        (["--algos", "grpo_sft:sft_coef=abc"], "Error parsing --sft-coef: could not convert string to float: 'abc'"),
        (["--algos", "grpo_expert:expert_shaping=-1"], "--expert-shaping must be > 0, got -1.0"),
        (["--train-arg=--bogus"], "Unrecognized options: --bogus"),
        (["--init-model", "{empty}"], "holds no config.json: not a model directory"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_anything_trains(argv, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = [arg.format(empty=tmp_path / "empty") for arg in argv]
    with pytest.raises(SystemExit) as stop:
        main(["--budget", "tiny", "--out", str(tmp_path / "out"), *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("error: " in line for line in lines) == 1, err
    assert message in lines[-1], err
    assert not (tmp_path / "out" / "runs").exists() or not any((tmp_path / "out" / "runs").iterdir())


def test_runs_go_seed_by_seed_so_that_streams_side_by_side_pair_the_arms_of_a_seed(tmp_path, monkeypatch):
    """Every system of a seed is trained before the next seed; a run another stream holds is skipped; the report
    still lists the runs system by system."""
    import argparse

    import benchmarks.compare as compare
    from benchmarks.compare_runs import parse_system

    trained = []

    def train(algo, seed, budget, protocol, run_dir, threads, flags):
        if (algo, seed) == ("sft", 0):
            raise ClaimedElsewhere("sft-seed0 is trained by another comparison")
        trained.append((algo, seed))
        return {"final_model": str(run_dir / "final"), "tokens_sampled": 0}

    monkeypatch.setattr(compare, "train", train)
    monkeypatch.setattr(compare, "metric_total", lambda run_dir, key: 0)
    monkeypatch.setattr(compare, "evaluate_run", lambda name, *args: {"metrics": {"f1": {"mean": 0.5}}, "name": name})
    monkeypatch.setattr(compare, "summary_row", lambda name, evals, summaries: {"system": name, "n": len(evals)})
    systems = [parse_system("sft"), parse_system("red_grpo")]
    args = argparse.Namespace(seeds=2, report_only=False, threads=1, protocol="coda", max_error_rate=0.05)
    got = compare._Results()
    compare._run_systems(systems, args, None, None, tmp_path, got)
    assert trained == [("red_grpo", 0), ("sft", 1), ("red_grpo", 1)]
    assert got.missing == ["sft-seed0"]
    assert [(run["system"], Path(run["final_model"]).parent.name) for run in got.runs] == [
        ("sft", "sft-seed1"),
        ("red_grpo", "red_grpo-seed0"),
        ("red_grpo", "red_grpo-seed1"),
    ]
    assert got.rows == [{"system": "sft", "n": 1}, {"system": "red_grpo", "n": 2}]
