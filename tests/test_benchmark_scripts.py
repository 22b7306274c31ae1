"""Every tool runs: each script in benchmarks/ at its smallest size, so that a change in the env, the agents or the
trainer that breaks one fails here. The long ones (a server, torchrun, fresh indexes) are in the slow set, each with
a faster twin in the default set; those that need a GPU or vLLM say so in one line where there is none.

The console scripts (`redcoda-evaluate`, `redcoda-compare`, `redcoda-first-search`) run here too, or in their own
tests: `tests/test_compare.py` runs the whole comparison at `--budget tiny`, `tests/test_evaluate.py` the evaluation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def _run(module: str, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m module argv` in a fresh process (scripts that set process-wide state: caches, threads)."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny test model saved as a model directory, as the scripts' `--model` takes one."""
    from agents.models import tiny_model

    model, tokenizer = tiny_model(seed=0)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_env_overhead_steps_searches(capsys, tmp_path, monkeypatch):
    """It prints and, with --json, writes its figures with their provenance, which the store ingests and a page's
    env-overhead block shows."""
    from benchmarks import report, results_store
    from benchmarks.env_overhead import main

    argv = ["--steps", "3", "--warmup", "4", "--server-envs", "2", "--server-turns", "2"]
    main([*argv, "--json", str(tmp_path / "overhead.json")])
    out = capsys.readouterr().out
    assert "queries: 3 HotpotQA dev questions" in out and "env's own share, inside each step" in out
    written = json.loads((tmp_path / "overhead.json").read_text())
    assert written["steps"] == 3 and written["warmup"] == 4 and 0 <= written["env_share"] <= 1
    assert written["env_us_lookup"] > 0 and written["env_us_evicted"] > 0 and written["evict_mib"] == 64
    server = written["server"]
    assert (server["envs"], server["turns"]) == (2, 2) and 0 < server["env_share"] < 1 and server["env_us"] > 0
    assert written["provenance"]["data"]["questions"]["file"] == "bundled:hotpotqa/dev"
    results_store.ingest(tmp_path / "overhead.json", "overhead", store=tmp_path / "store")
    monkeypatch.setattr(results_store, "STORE", tmp_path / "store")
    text, _ = report.rebuilt("<!-- report:env-overhead overhead -->\n<!-- /report -->\n", "page.md")
    assert f"| {written['env_share']:.1%} (target <= 5%) |" in text
    assert f"| the same after retrieval wrote 64 MiB, no JVM (median) | {written['env_us_evicted']:.1f} µs |" in text
    assert f"| {server['env_share']:.1%} ({server['env_us']:.1f} µs) |" in text
    assert written["cores_allowed"] == len(os.sched_getaffinity(0)) and "pinned" not in text
    machine = {**written["provenance"]["machine"], "cores": 4}
    pinned = {**written, "cores_allowed": 1, "provenance": {**written["provenance"], "machine": machine}}
    (tmp_path / "pinned.json").write_text(json.dumps(pinned))
    results_store.ingest(tmp_path / "pinned.json", "pinned", store=tmp_path / "store")
    text, _ = report.rebuilt("<!-- report:env-overhead pinned -->\n<!-- /report -->\n", "page.md")
    assert f"| CPU | {machine['cpu']}, 4 cores (the process pinned to 1) |" in text


def test_rollout_measures_a_coda_rollout_against_plain_sampling(tiny_dir, one_torch_thread):
    from benchmarks.rollout import main

    result = main(["--model", str(tiny_dir), "--batch", "2", "--max-new-tokens", "4", "--turns", "1"])
    assert result and all(v >= 0 for v in result.values() if isinstance(v, float))


def test_roofline_measures_the_machine_and_the_model(tiny_dir, one_torch_thread):
    from benchmarks.roofline import main

    result = main(["--model", str(tiny_dir), "--lengths", "8", "--decode-tokens", "2", "--repeats", "1"])
    assert result["matmul_peak_flops"] > 0 and result["read_bandwidth_bytes_per_s"] > 0
    assert result["fwd_bwd_tokens_per_s"] > 0 and result["weight_bytes"] > 0


def test_train_step_splits_a_tiny_step(one_torch_thread):
    from benchmarks.train_step import main

    result = main(["--preset", "tiny"])
    assert result


@pytest.mark.slow  # the trainer in a process of its own: the default set's twin is test_train_step_splits_a_tiny_step
def test_scale_step_trains_the_tiny_shape(tmp_path):
    from benchmarks.scale_step import main

    logs = main(["--shapes", "tiny", "--preset", "tiny", "--work", str(tmp_path)])
    assert logs and "step" in logs[0] and "tok/s that reading" in logs[0]


def test_the_decode_bound_reads_every_weight_once_per_step_for_the_samplers_rows(tiny_dir):
    from transformers import AutoConfig

    from algos.run.memory import count_parameters
    from benchmarks.scale_step import decode_bound

    parameters = count_parameters(AutoConfig.from_pretrained(tiny_dir))
    bound, rows, weight_bytes = decode_bound(tiny_dir, "tiny", ["--device", "cpu"], bandwidth=1e9)
    assert rows == 4 and weight_bytes == parameters * 4  # the tiny preset: 2 questions x 2 episodes, float32
    assert bound == pytest.approx(rows * 1e9 / weight_bytes)
    half = decode_bound(tiny_dir, "gpu", ["--bf16", "True", "--device", "cpu"], bandwidth=1e9)
    assert half[1] == 64 and half[2] == parameters * 2


def test_decode_levers_compares_each_lever_on_and_off(one_torch_thread):
    from benchmarks.decode_levers import main

    lines = main(
        ["--hidden", "64", "--layers", "2", "--rows", "4", "--group", "2", "--new-tokens", "4", "--repeats", "1"]
    )
    assert [line.split(" | ")[0].split(" (")[0] for line in lines[2:5]] == [
        "finished rows leave the bucket",
        "prefix sharing",
        "prefill attention",
    ]
    assert lines[-3].split(": ")[1].startswith("64 rows") and lines[-1].split(": ")[1].startswith("256 rows")


def test_checkpoint_overlap_times_the_three_modes(one_torch_thread, tmp_path):
    from benchmarks.checkpoint_overlap import main

    lines = main(["--shape", "tiny", "--steps", "1", "--tokens", "8", "--work", str(tmp_path)])
    assert [line.split(" step ")[0].split(maxsplit=1)[1].strip() for line in lines] == [
        "none",
        "in the loop",
        "beside the steps",
    ]
    assert "(checkpoint" in lines[2] and not list(tmp_path.iterdir())  # its checkpoints go with their folder


@pytest.mark.slow  # five stages, three of them trainers in processes of their own
def test_gpu_check_rehearses_every_stage_at_tiny_shapes(tmp_path):
    from benchmarks.gpu_check import main

    summary = main(["--rehearse", "--out", str(tmp_path)])
    assert {name: stage["status"] for name, stage in summary["stages"].items()} == dict.fromkeys(
        ["tests", "135m", "1.5b", "3b", "seed"], "passed"
    )
    for name in ("135m", "1.5b", "3b", "seed"):
        assert (tmp_path / name / "metrics.jsonl").read_text().strip()
        assert "trajectories/GPU/s" in summary["stages"][name]["line"]
    assert "tok/s that reading" in summary["stages"]["3b"]["line"]
    assert "tests collected" in (tmp_path / "tests" / "pytest.log").read_text()
    assert "**seed** passed" in (tmp_path / "summary.md").read_text()


def test_timing_keeps_the_fastest_call():
    from benchmarks.timing import best_seconds

    calls = []
    assert best_seconds(lambda: calls.append(1), repeats=3, warmup=True) >= 0 and len(calls) == 4


def test_evaluate_and_first_search_run_as_console_scripts(tmp_path, monkeypatch, capsys):
    """`redcoda-evaluate` writes a result (the oracle agent: no model to load) that `redcoda-first-search` splits,
    each through its console script's function."""
    from benchmarks.scripts import evaluate, first_search  # the functions pyproject.toml's console scripts call

    result = tmp_path / "oracle.json"
    monkeypatch.setattr(sys, "argv", ["redcoda-evaluate", "--agent", "oracle", "--limit", "2", "--result", str(result)])
    assert evaluate() is None and json.loads(result.read_text())["n"] == 2
    monkeypatch.setattr(sys, "argv", ["redcoda-first-search", str(result)])
    assert first_search() is None
    assert "oracle" in capsys.readouterr().out


def test_sampler_gpu_says_in_one_line_that_it_needs_a_gpu(tiny_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_sampler_gpu_runs_on_a_gpu runs the benchmark")
    done = _run("benchmarks.sampler_gpu", "--config", str(tiny_dir), "--rows", "2", "--new-tokens", "4")
    assert done.returncode == 1 and done.stderr.strip() == "this benchmark needs a CUDA device", done.stderr


@pytest.mark.gpu
def test_sampler_gpu_runs_on_a_gpu(tiny_dir):
    done = _run("benchmarks.sampler_gpu", "--config", str(tiny_dir), "--rows", "2", "--new-tokens", "4")
    assert done.returncode == 0, done.stderr


def test_sampler_vllm_says_in_one_line_that_it_needs_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is here: test_sampler_vllm_runs_with_vllm runs the benchmark")
    done = _run("benchmarks.sampler_vllm", "--rows", "2", "--max-new-tokens", "4", "--repeats", "1", timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: this benchmark needs vLLM"), done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.vllm
def test_sampler_vllm_runs_with_vllm():
    pytest.importorskip("vllm")
    done = _run("benchmarks.sampler_vllm", "--rows", "2", "--max-new-tokens", "4", "--repeats", "1")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("benchmarks.server_memory", ["--requests", "0"], "--requests must be >= 1, got 0"),
        ("benchmarks.env_overhead", ["--steps", "0"], "--steps must be >= 1, got 0"),
        ("benchmarks.env_overhead", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        ("benchmarks.sampler_vllm", ["--rows", "2", "0"], "--rows must be >= 1, got 0"),
    ],
)
def test_bad_numbers_are_refused_before_any_work(module, argv, message):
    done = _run(module, *argv, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow  # a server process and its JVM: the twin in the default set is the refusal above
def test_server_memory_measures_a_server_under_load():
    done = _run("benchmarks.server_memory", "--requests", "2", "--clients", "1", "--topk", "4")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["requests"] == 2 and result["rss_peak_mb"] >= result["rss_after_start_mb"] > 0


@pytest.mark.slow  # two torchrun launches: the default set's twin is tests/test_distributed.py's 2-rank run
def test_scaling_times_one_and_two_ranks():
    done = _run("benchmarks.scaling", "--procs", "1", "2", "--steps", "2", "--warmup", "1")
    assert done.returncode == 0, done.stderr
    assert "| ranks x threads |" in done.stdout


@pytest.mark.slow  # builds every index afresh: the default set's twin is the retriever tests over the same indexes
def test_retrieval_benchmark_builds_and_times_every_retriever(tmp_path):
    out = tmp_path / "retrieval.json"
    done = _run("benchmarks.retrieval", "--questions", "3", "--repeats", "1", "--encode-sample", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())


def test_the_second_query_bound_replays_first_searches(capsys):
    from benchmarks.investigations.second_query_bound import main

    assert main(["--limit", "3"])["questions"] == 3


def test_the_query_rewrite_evaluation_scores_a_model_against_the_question(tiny_dir, one_torch_thread):
    from benchmarks.investigations.query_rewrite_eval import main

    result = main(["--model", str(tiny_dir), "--limit", "2", "--max-new-tokens", "4"])
    assert json.dumps(result)


def test_restate_intervals_rewrites_a_recorded_table(tmp_path):
    """On a copy of a recorded comparison table (it rewrites the table in place)."""
    from benchmarks.investigations.restate_intervals import main

    table = tmp_path / "table.md"
    recorded = (ROOT / "benchmarks" / "results" / "compare-cpu-flat" / "table.md").read_text()
    # the grpo row as it was first written: an interval equal in every seed printed [x, x]
    table.write_text(recorded.replace("| grpo | 3 | 0.000 [0.000, 0.708] |", "| grpo | 3 | 0.000 [0.000, 0.000] |"))
    assert main([str(table)]) == {str(table): 1}
    assert table.read_text() == recorded


def test_the_tail_replay_answers_help(monkeypatch, capsys):
    """The tail's replay needs a finished main job and a git revision to compare against: here its command line."""
    from benchmarks.investigations.tail import main

    monkeypatch.setattr(sys, "argv", ["tail", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0 and "--baseline" in capsys.readouterr().out


@pytest.mark.slow  # the real SmolLM2-135M: the default set's twin is test_roofline_measures_the_machine_and_the_model
def test_prefill_pass_times_the_real_model(capsys, one_torch_thread):
    from benchmarks.investigations.prefill_pass import main

    main(["--threads", "1", "--repeats", "1"])
    assert "PREFILL_SPLIT_TOKENS" in capsys.readouterr().out
