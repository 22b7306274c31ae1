"""The results store and `benchmarks.report`: the committed pages match the store, the store keeps its size and holds
no text, a changed block is named, ingested runs pair by question with `envs.stats`, and provenance is complete."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report
from benchmarks.results_store import (
    BUDGET_BYTES,
    STORE,
    ingest,
    load,
    names,
    read_records,
    store_bytes,
    write_records,
)
from envs.data import bundled_path
from envs.provenance import file_hash, provenance
from envs.stats import paired_difference, paired_permutation_p

TEXT_KEYS = {"text", "question", "prediction", "reply", "passages", "contents", "gold_answers", "actions"}
"""Fields that would carry passage, question or answer text: none may be stored."""


def test_every_block_in_the_pages_is_what_the_store_rebuilds():
    assert report.build(check=True) == []
    assert report.main(["--check"]) == 0


def test_the_store_keeps_its_size_budget_and_holds_no_text():
    assert names(), "the store is empty"
    assert store_bytes() <= BUDGET_BYTES
    for name in names():
        for record in read_records(STORE / f"{name}.jsonl.gz"):
            assert not TEXT_KEYS & set(record), (name, sorted(TEXT_KEYS & set(record)))


def _with_restored_history(source: Path, run: Any, into: Path) -> Path:
    """A copy of a committed folder with what the store restored for it from the git history written back where it
    was: the metrics rows, and the per-question results as evaluations holding the stored fields."""
    from benchmarks.results_questions import QUESTION_FIELDS

    copy = into / source.name
    shutil.copytree(source, copy)
    for row in run.metrics:
        path = copy / "runs" / row["run"] / "metrics.jsonl" if "run" in row else copy / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps({k: v for k, v in row.items() if k not in ("record", "run")}) + "\n")
    by_part: dict[str, list[dict[str, Any]]] = {}
    for q in run.questions:
        prediction = {"id": q["id"], "index": q["index"], **{k: q[n] for n, k in QUESTION_FIELDS.items() if n in q}}
        if q["first_search"] == "yes/no":
            prediction["gold_answers"] = ["yes"]
        by_part.setdefault(q["part"], []).append(prediction)
    if set(by_part) == {"after", "before"}:  # a main job's eval.json
        (copy / "eval.json").write_text(json.dumps({part: {"predictions": p} for part, p in by_part.items()}))
    for part, predictions in by_part.items() if set(by_part) != {"after", "before"} else ():
        (copy / "evals").mkdir(exist_ok=True)
        (copy / "evals" / f"{part}.json").write_text(json.dumps({"predictions": predictions}))
    return copy


def _committed(path: str) -> bool:
    listed = subprocess.run(["git", "ls-files", "--", path], cwd=report.ROOT, capture_output=True, text=True)
    return bool(listed.stdout.strip())


def test_a_stored_run_of_committed_files_is_what_ingesting_them_again_gives(tmp_path):
    """The runs ingested from files in the repository (the comparisons' tables, the main jobs' eval.md and run.log,
    retrieval.json) re-ingest to the same bytes: the store says what those files say. Metrics rows restored from
    the git history (metrics rows, per-question results) go back beside the folder's files first, and come out the
    same records."""
    again = 0
    for name in names():
        run = load(name)
        source = report.ROOT / run.header["source"]
        if not source.exists() or not _committed(run.header["source"]):
            continue  # a run folder in the git-ignored runs/ is there only on the machine that trained it
        if run.metrics or run.questions:
            copy = _with_restored_history(source, run, tmp_path / "restored")
            got = read_records(ingest(copy, name, store=tmp_path))
            got[0]["source"] = run.header["source"]
            assert got == read_records(STORE / f"{name}.jsonl.gz"), name
        else:
            ingest(source, name, store=tmp_path)
            assert (tmp_path / f"{name}.jsonl.gz").read_bytes() == (STORE / f"{name}.jsonl.gz").read_bytes(), name
        again += 1
    assert again >= 10


def test_the_pages_hold_the_blocks_the_results_rest_on():
    found = {(p.name, name) for p in report.pages() for _, name, *_ in report._BLOCK.findall(p.read_text())}
    for page, block in [("README.md", "readme-results"), ("main-job.md", "main-job-validation"),
                        ("comparison.md", "comparison-headline"), ("env_overhead.md", "env-overhead")]:  # fmt: skip
        assert (page, block) in found


def test_a_changed_block_is_named_and_rewritten(tmp_path):
    page = Path(report.ROOT / "docs" / "results" / "main-job.md").read_text()
    spoiled = page.replace("| 0 | 67 | 67:", "| 0 | 66 | 67:")
    assert spoiled != page
    fixed, changed = report.rebuilt(spoiled, "docs/results/main-job.md")
    assert changed == ["docs/results/main-job.md: main-job-validation"]
    assert fixed == page
    with pytest.raises(SystemExit, match="unknown block 'nothing'"):
        report.rebuilt("<!-- report:nothing -->\nx\n<!-- /report -->\n", "page.md")


def test_records_are_written_byte_for_byte_the_same(tmp_path):
    records = [{"record": "run", "b": 1, "a": [0.5, None]}, {"record": "question", "id": "q", "f1": 1.0}]
    first = write_records(tmp_path / "one.jsonl.gz", records).read_bytes()
    assert write_records(tmp_path / "two.jsonl.gz", records).read_bytes() == first
    assert read_records(tmp_path / "one.jsonl.gz") == records


def _evaluation(f1: list[float]) -> dict:
    predictions = [
        {"index": i, "id": f"q{i}", "question": "Who?", "gold_answers": ["yes" if i == 0 else "Paris"],
         "prediction": "x", "em": float(s == 1.0), "f1": s, "answered": 1.0, "num_searches": 1, "invalid_actions": 0,
         "sampler_errors": 0, "retrieval_errors": 0, "actions": ["<search>Who?</search>"]}
        for i, s in enumerate(f1)
    ]  # fmt: skip
    return {"predictions": predictions, "metrics": {"f1": {"mean": sum(f1) / len(f1)}}}


def _run_dir(root: Path, name: str, f1: list[float]) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    record = provenance(seed=3, command="python -m algos.red_grpo --seed 3", env_kwargs={"split": "dev"})
    evaluation = {"before": _evaluation([0.0] * len(f1)), "after": _evaluation(f1), "provenance": record}
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    rows = [json.dumps({"step": step, "answer_f1/mean": 0.1}) + "\n" for step in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "provenance": record}))
    return run_dir


def test_an_ingested_run_keeps_its_questions_metrics_and_provenance_and_pairs_by_question(tmp_path, monkeypatch):
    from benchmarks import results_store

    store = tmp_path / "store"
    a = [1.0, 0.5, 0.0, 1.0, 0.8, 0.2, 1.0, 0.0]
    b = [0.0, 0.5, 0.0, 0.5, 0.8, 0.0, 1.0, 0.0]
    ingest(_run_dir(tmp_path, "a", a), "run-a", first_search=False, store=store)
    ingest(_run_dir(tmp_path, "b", b), "run-b", first_search=False, store=store)
    run = load("run-a", store)
    assert run.header["provenance"]["seed"] == 3 and run.header["kind"] == "training"
    assert run.question_scores("f1") == {f"q{i}": s for i, s in enumerate(a)}
    assert run.question_scores("f1", "before") == {f"q{i}": 0.0 for i in range(len(a))}
    assert [q["first_search"] for q in run.questions[:2]] == ["yes/no", None]  # yes/no known without a replay
    assert [m["step"] for m in run.metrics] == [1, 2]
    got = report.paired_stats("run-a", "run-b", store=store)
    assert got["n"] == len(a)
    assert got["difference"] == pytest.approx(paired_difference(a, b).mean)
    assert got["p"] == pytest.approx(paired_permutation_p(a, b))
    seeds = report.paired_stats("run-a,run-b", "run-b", store=store)  # two seeds, averaged per question
    assert seeds["difference"] == pytest.approx(sum(a) / 16 - sum(b) / 16)
    monkeypatch.setattr(results_store, "STORE", store)  # the same numbers as a page's block
    text, _ = report.rebuilt("<!-- report:stats run-a run-b f1 em -->\n<!-- /report -->\n", "page.md")
    f1_row, em_row = text.splitlines()[3:5]
    interval = f"{got['difference']:+.3f} [{got['low']:+.3f}, {got['high']:+.3f}]"
    assert f1_row == f"| run-a - run-b | f1 | {interval} | {got['p']:.2g} | 8 |"
    assert em_row.startswith("| run-a - run-b | em | ")


def test_the_held_out_block_is_recomputed_from_the_stored_questions(tmp_path, monkeypatch):
    from agents.evaluation import interval_method
    from benchmarks import report_blocks, results_store
    from envs.stats import mean_ci

    f1 = [1.0, 0.5, 0.0, 0.25]
    ingest(_run_dir(tmp_path, "a", f1), "run-a", first_search=False, store=tmp_path / "store")
    monkeypatch.setattr(results_store, "STORE", tmp_path / "store")
    text, changed = report.rebuilt("<!-- report:held-out run-a -->\n<!-- /report -->\n", "page.md")
    row = text.splitlines()[3]
    assert changed == ["page.md: held-out run-a"] and row.startswith("| run-a | 3 | 2 | ")
    assert mean_ci(f1, method=interval_method("f1")).format(3) in row and row.endswith("| not replayed |")
    assert report_blocks.BLOCKS["held-out"]("run-a") in text


def test_an_evaluation_result_is_stored_and_its_row_recomputed(tmp_path, monkeypatch):
    from benchmarks import results_store

    result = {"agent": "rag", "n": 4, **_evaluation([1.0, 0.5, 0.0, 0.0])}
    result["predictions"][1].update(format=0.5, num_searches=3, invalid_actions=1)
    for p in result["predictions"]:
        p.setdefault("format", 1.0)
    (tmp_path / "rag.json").write_text(json.dumps(result))
    ingest(tmp_path / "rag.json", "rag", first_search=False, store=tmp_path / "store")
    monkeypatch.setattr(results_store, "STORE", tmp_path / "store")
    text, _ = report.rebuilt("<!-- report:evaluations rag -->\n<!-- /report -->\n", "page.md")
    assert "| rag | 4 | 0.250 | 0.375 | 0.875 | 1.50 | 0.250 |" in text


def test_stats_refuses_runs_without_per_question_results():
    with pytest.raises(SystemExit, match="retrieval: the store holds no per-question results for it"):
        report.paired_stats("retrieval", "compare-cpu-coda-66")


def test_the_restored_comparisons_pair_to_the_differences_their_tables_printed():
    """Every paired row a recorded comparison printed, recomputed by question from the per-question results restored
    into the store, gives the printed difference to its third decimal (the restored results are the runs' own)."""
    from benchmarks.report_blocks import red_minus

    checked = 0
    for name in ("compare-cpu-flat-84", "compare-cpu-coda-66", "compare-cpu-flat-warm", "compare-cpu-flat"):
        run = load(name)
        for row in (r for r in run.rows if r["table"] == "paired"):
            metric, _, rest = row["metric"].partition(" ")
            got = red_minus(run, row["comparison"].removeprefix("red_grpo - "), metric, bool(rest))
            assert round(got["difference"], 3) == pytest.approx(row["difference [95% CI]"]["mean"], abs=1e-9), row
            assert got["n"] == (176 if rest else 200)
            checked += 1
    assert checked == 16 + 16 + 12 + 9


def test_stats_leaves_out_yes_no_questions_when_asked(capsys):
    red, grpo = "compare-cpu-flat-84:red_grpo-seed0", "compare-cpu-flat-84:grpo_sft-seed0"
    assert report.paired_stats(red, grpo)["n"] == 200
    assert report.paired_stats(red, grpo, without_yes_no=True)["n"] == 176
    assert report.main(["stats", red, grpo, "--without-yes-no"]) == 0
    out = capsys.readouterr().out
    assert "f1 without yes/no" in out and "176 questions" in out


def test_provenance_names_the_code_machine_packages_data_and_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    record = provenance(seed=1, env_kwargs={"split": "dev", "top_k": 3}, model=model)
    assert len(record["code"]["commit"]) == 40 and isinstance(record["code"]["dirty"], bool)
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]
    assert "gymnasium" in record["packages"]
    assert record["data"]["questions"]["hash"] == file_hash(bundled_path("hotpotqa", "dev"))
    assert record["data"]["corpus"]["hash"] == file_hash(bundled_path("hotpotqa", "corpus"))
    assert record["data"]["index_settings"] == {"top_k": 3}
    assert record["model"]["hash"] is not None
    other = provenance(seed=1, env_kwargs={"split": "dev", "top_k": 5}, model="smollm2-135m")
    assert other["data"]["index_settings_hash"] != record["data"]["index_settings_hash"]
    assert other["model"] == {"model": "smollm2-135m", "hash": None}


def test_the_step_signal_block_reads_the_stored_metrics_rows(tmp_path, monkeypatch):
    from benchmarks import results_store

    run_dir = _run_dir(tmp_path, "a", [1.0, 0.0])
    rows = [
        {"step": step, "train/episodes": 4, "rl/signal_rows": signal, "answer_f1/mean": f1,
         "red/entropy_weight": entropy, "red/accuracy_factor": 5.0, "red/final_weight": 5.0 * entropy}
        for step, signal, f1, entropy in ((1, 0.0, 0.0, 1.0), (2, 0.0, 0.0, 2.0), (3, 0.5, 0.5, 1.0))
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest(run_dir, "run-a", first_search=False, store=tmp_path / "store")
    monkeypatch.setattr(results_store, "STORE", tmp_path / "store")
    text, changed = report.rebuilt("<!-- report:step-signal run-a -->\n<!-- /report -->\n", "page.md")
    assert changed == ["page.md: step-signal run-a"]
    assert text.splitlines()[3] == "| run-a | 3 | 0.33 | 2 | 0.33 | 0.00 | 6.67 |"


def test_the_comparison_steps_block_counts_each_seeds_tied_steps_and_reds_weights(tmp_path, monkeypatch):
    from benchmarks import results_store

    def step(run: str, advantage: float | None, weight: float, entropy: float = 1.0) -> dict[str, Any]:
        row = {"record": "metrics", "run": run, "critic/rewards/mean": -1.0, "sft/weight": weight}
        if advantage is not None:
            row["critic/advantages/abs_mean"] = advantage
        return {**row, "red/entropy_weight": entropy} if run.startswith("red") else row

    metrics = [
        step("red_grpo-seed0", 0.0, 5.0), step("red_grpo-seed0", 0.01, 7.5, 1.5), step("red_grpo-seed0", 0.0, 1.0),
        step("red_grpo-seed1", 0.2, 5.0), step("red_grpo-seed1", 0.2, 5.0),
        step("grpo-seed0", None, 0.0), step("grpo-seed0", None, 0.0),
        {"record": "metrics", "run": "warm-start", "sft/weight": 1.0},  # not a system's seed: left out
    ]  # fmt: skip
    write_records(tmp_path / "cmp.jsonl.gz", [{"record": "run", "name": "cmp", "kind": "comparison"}, *metrics])
    monkeypatch.setattr(results_store, "STORE", tmp_path)
    text, _ = report.rebuilt("<!-- report:comparison-steps cmp -->\n<!-- /report -->\n", "page.md")
    assert text.splitlines()[3:5] == [
        "| GRPO alone | 2 | - | - | - |",
        "| GRPO + RED | 3 / 2 | 2 / 0 | 1 / 2; 1 / 0; 1 / 0 | 2 / 2 |",
    ]


def test_the_comparison_steps_block_on_the_stored_comparisons():
    """The counts comparison.md's prose quotes, as the restored metrics rows give them."""
    from benchmarks.report_blocks import comparison_steps

    warm = comparison_steps("compare-cpu-flat-warm").splitlines()
    assert warm[-1] == (
        "| GRPO + RED | 84 / 84 / 84 | 51 / 52 / 43 | 43 / 47 / 42; 6 / 2 / 6; 19 / 26 / 26 | 72 / 82 / 77 |"
    )
    assert "| GRPO + RED | 24 / 24 / 24 | 6 / 7 / 10 | 17 / 18 / 22; 0 / 0 / 0; 4 / 3 / 0 | 24 / 24 / 24 |" in (
        comparison_steps("compare-cpu-flat")
    )


def test_the_first_search_block_splits_the_stored_questions_by_what_the_first_search_showed(tmp_path, monkeypatch):
    from agents.evaluation import interval_method
    from benchmarks import results_store
    from envs.stats import mean_ci

    questions = [
        {"record": "question", "part": "after", "id": f"q{i}", "f1": f1, "searches": searches, "first_search": kind}
        for i, (f1, searches, kind) in enumerate(
            [(1.0, 1, "shown"), (0.5, 1, "shown"), (0.0, 2, "not shown"), (0.2, 1, "not shown"), (1.0, 1, "yes/no")]
        )
    ]
    questions.append({**questions[0], "part": "before", "f1": 0.0})  # the starting model's score is not read
    write_records(tmp_path / "run-a.jsonl.gz", [{"record": "run", "name": "run-a"}, *questions])
    monkeypatch.setattr(results_store, "STORE", tmp_path)
    text, _ = report.rebuilt("<!-- report:first-search run-a -->\n<!-- /report -->\n", "page.md")
    shown, missed = (mean_ci(v, method=interval_method("f1")).format(3) for v in ([1.0, 0.5], [0.0, 0.2]))
    assert (
        text.splitlines()[3]
        == f"| run-a | 2, {shown} | 2, {missed} | 1.50 | 1, "
        + mean_ci([1.0], method=interval_method("f1")).format(3)
        + " |"
    )


def test_the_recorded_scale_block_renders_a_stored_copy_of_printed_figures(tmp_path, monkeypatch):
    from benchmarks import results_store

    row = {"shape": "3B", "setting": "graphs", "step_s": 15.6, "generation_s": 12.5, "old_logp_s": 1.42,
           "forward_backward_s": 1.47, "adamw_s": 0.08, "tokens_per_s": 3919, "trajectories_per_gpu_s": 4.1,
           "peak_gib": 68.1, "estimate_gib": 79.8}  # fmt: skip
    unfinished = {**{k: None for k in row}, "shape": "135M", "setting": "no step"}
    write_records(tmp_path / "scale.jsonl.gz", [{"record": "run", "rows": [row, unfinished]}])
    monkeypatch.setattr(results_store, "STORE", tmp_path)
    text, _ = report.rebuilt("<!-- report:recorded-scale scale -->\n<!-- /report -->\n", "page.md")
    lines = text.splitlines()
    assert lines[3] == (
        "| 3B, graphs | 15.6 s | 12.5 s (80%) | 1.42 | 1.47 | 0.08 | 3,919 | 4.10 | 68.1 GiB (estimate at start 79.8) |"
    )
    assert lines[4] == "| 135M, no step |  |  |  |  |  |  |  |  |"


def test_the_preset_history_block_is_each_stored_runs_steps_and_f1():
    """Every cell of the preset's history is its stored run's steps and the mean of its stored per-question F1 over
    dev 0-99 (the eval.md row's F1, marked, where none were kept), and the rows hold the runs restored for them."""
    from statistics import mean

    from benchmarks.report_blocks import BLOCKS, PRESET_HISTORY

    lines = BLOCKS["preset-history"]("").splitlines()
    marked = 0
    for change, *sides in PRESET_HISTORY:
        row = next(line for line in lines if line.startswith(f"| {change} |"))
        cells = row.strip("|").split(" | ")[1:]
        for runs, cell in zip(sides, cells, strict=True):
            assert cell.strip() == "-" if not runs else len(cell.split("; ")) == len(runs), row
            for name, shown in zip(runs, cell.strip().split("; "), strict=False):
                run = load(name)
                after = [q for q in run.questions if q["part"] == "after"]
                steps = run.header["summary"]["steps"]
                if "run.log" not in run.header["files"]:
                    assert steps == len(run.metrics) == max(m["step"] for m in run.metrics), name
                if after:
                    assert sorted(q["index"] for q in after) == list(range(100)), name
                    assert shown == f"{steps}, {mean(q['f1'] for q in after):.3f}", name
                    assert "per-question results" not in run.header["provenance"]["missing"], name
                else:
                    f1 = next(r for r in run.rows if r["model"].startswith("after"))["F1"]["mean"]
                    assert shown.startswith(f"{steps}, {f1:.3f} (eval.md"), name
                    assert "per-question results" in run.header["provenance"]["missing"], name
                    marked += 1
    assert marked == 3 and lines[-1].startswith("(eval.md): ")
    expected = {
        "answer-only demonstrations (`--quote-words 0`)": "| 28, 0.122 | 33, 0.240; 27, 0.142 |",
        "oracle fix (the top passage counted as shown)": "| 84, 0.144 | - |",
        "validation choice + question after results": "| - | 67, 0.218; 68, 0.176; 68, 0.167; 77, 0.212 |",
    }
    for change, cells in expected.items():
        assert f"| {change} {cells}" in lines


def _legacy_main_job(root: Path, with_results: bool) -> Path:
    """A main job folder as the older ones were committed: eval.md, and with `with_results` metrics.jsonl (3 steps)
    and eval.json, no run.log."""
    folder = root / "main-job-cpu-x-seed2"
    folder.mkdir()
    (folder / "eval.md").write_text(
        "Held-out: 4 dev questions, greedy, coda agent, training env settings.\n\n"
        "| model | EM | F1 | valid answers |\n|---|---|---|---|\n"
        "| before (start) | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] |\n"
        "| after (trained) | 0.250 [0.000, 0.750] | 0.438 [0.000, 0.900] | 1.000 [1.000, 1.000] |\n"
    )
    if with_results:
        rows = [json.dumps({"step": step, "loss_pg": 0.1}) + "\n" for step in (1, 2, 3)]
        (folder / "metrics.jsonl").write_text("".join(rows))
        evaluation = {"before": _evaluation([0.0] * 4), "after": _evaluation([1.0, 0.5, 0.0, 0.25])}
        (folder / "eval.json").write_text(json.dumps(evaluation))
    return folder


@pytest.mark.parametrize("with_results", [True, False])
def test_a_main_job_folder_without_run_log_counts_its_steps_from_its_metrics_rows(tmp_path, monkeypatch, with_results):
    from benchmarks import report_blocks, results_store

    folder = _legacy_main_job(tmp_path, with_results)
    ingest(folder, "run-x", store=tmp_path)
    run = load("run-x", store=tmp_path)
    header = run.header
    assert header["summary"]["steps"] == (3 if with_results else None)
    assert header["summary"]["steps_from"] == "metrics rows"
    assert header["provenance"]["command"] == "python -m algos.red_grpo --seed 2 --protocol coda"
    assert header["files"] == (["eval.md", "metrics.jsonl", "eval.json"] if with_results else ["eval.md"])
    lacking = {"per-question results", "metrics rows"} & set(header["provenance"]["missing"])
    assert lacking == (set() if with_results else {"per-question results", "metrics rows"})
    assert len(run.questions) == (8 if with_results else 0) and len(run.metrics) == (3 if with_results else 0)
    monkeypatch.setattr(results_store, "STORE", tmp_path)
    assert report_blocks._steps_f1("run-x") == ("3, 0.438" if with_results else "None, 0.438 (eval.md)")
    if with_results:  # its questions were never replayed for the first search: no split of zeros
        row = report_blocks.BLOCKS["held-out"]("run-x").splitlines()[-1]
        assert row.startswith("| run-x | 2 | 3 | ") and row.endswith(" | not replayed |")


def test_the_command_given_at_ingest_is_a_legacy_runs_and_is_refused_for_any_other(tmp_path, monkeypatch):
    """``ingest --command`` replaces the preset's command a legacy main job would record and says where it came from;
    the rest of its provenance is what ingesting it without one gives. A run that records its own command refuses it
    in one line and stores nothing."""
    folder = _legacy_main_job(tmp_path, with_results=True)
    store = tmp_path / "store"
    monkeypatch.setattr(report, "STORE", store)
    command = "python -m algos.red_grpo --seed 2 --lora --lr 1e-3"
    assert report.main(["ingest", str(folder), "--name", "run-told", "--command", command]) == 0
    ingest(folder, "run-untold", store=store)
    told, untold = load("run-told", store).header["provenance"], load("run-untold", store).header["provenance"]
    assert (told["command"], told["command_source"]) == (command, "given at ingest")
    assert untold["command"] == "python -m algos.red_grpo --seed 2 --protocol coda"
    assert {k: v for k, v in told.items() if not k.startswith("command")} == {
        k: v for k, v in untold.items() if not k.startswith("command")
    }
    trainer_run = _run_dir(tmp_path, "a", [1.0, 0.0])
    with pytest.raises(SystemExit) as refused:
        report.main(["ingest", str(trainer_run), "--name", "run-a", "--command", command])
    assert "--command is only for a run that predates the store" in str(refused.value)
    assert "\n" not in str(refused.value) and not (store / "run-a.jsonl.gz").exists()
