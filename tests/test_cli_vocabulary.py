"""One vocabulary: the trainers' ``--config FILE`` and preset notice, and the evaluate CLI's trainer flags and
``--run-dir`` (a trained run re-scored in exactly the env it trained in)."""

from __future__ import annotations

import json

import pytest

from algos.config import default_preset, preset_config
from algos.run.cli import parse_config
from algos.run.evaluation import held_out_settings
from algos.run.outputs import write_run_config
from benchmarks.evaluate import main as evaluate_main


def test_a_config_file_applies_after_the_preset_and_before_the_flags(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("lr: 0.0003\nsteps: 7\ntop_k: 5\nlora_target_modules: [q_proj, v_proj]\n")
    config = parse_config(["--preset", "tiny", "--config", str(path), "--steps", "3"], algo="red_grpo")
    assert (config.run.preset, config.optim.lr, config.env.top_k, config.optim.steps) == ("tiny", 0.0003, 5, 3)
    assert config.rl.max_new_tokens == preset_config("tiny").rl.max_new_tokens  # the preset's, the file names none
    assert config.model.lora_target_modules == ("q_proj", "v_proj")


def test_a_saved_run_config_reproduces_the_run(tmp_path):
    saved = preset_config("tiny", algo="grpo_sft", protocol="coda", seed=4, top_k=5)
    write_run_config(saved, tmp_path)
    assert parse_config(["--config", str(tmp_path / "redcoda_config.json")], algo="grpo_sft") == saved


def test_a_config_file_of_another_algorithm_is_refused_in_one_line(tmp_path, capsys):
    """The entry point's learner trains: a saved grpo_sft run's file given to red_grpo is an error, not a swap."""
    write_run_config(preset_config("tiny", algo="grpo_sft"), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--config", str(tmp_path / "redcoda_config.json")], algo="red_grpo")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "python -m algos.grpo_sft --config" in err


def test_a_config_file_naming_no_setting_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"learning_rate": 1e-4}))
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny", "--config", str(path)], algo="red_grpo")
    assert exit_info.value.code == 2 and "learning_rate" in capsys.readouterr().err


def test_the_preset_chosen_by_hardware_is_announced(capsys):
    config = parse_config(["--steps", "3"], algo="red_grpo")
    reason = "a CUDA device is available" if default_preset() == "gpu" else "no CUDA device"
    assert config.run.preset == default_preset()
    assert f"preset {config.run.preset}: {reason}; pass --preset to choose" in capsys.readouterr().out
    parse_config(["--preset", "tiny"], algo="red_grpo")
    assert "preset" not in capsys.readouterr().out  # named: nothing to announce


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run directory as a trainer leaves it: redcoda_config.json and a final/ model (the tiny random one)."""
    from agents.models import tiny_model

    run_dir = tmp_path_factory.mktemp("run")
    config = preset_config(
        "tiny", algo="red_grpo", protocol="coda", top_k=2, max_search_turns=1, question_after_results=True
    )
    write_run_config(config, run_dir)
    model, tokenizer = tiny_model(seed=0)
    model.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    return run_dir, config


def test_evaluate_rescores_a_run_in_its_training_env(tiny_run, capsys):
    run_dir, config = tiny_run
    result = evaluate_main(["--run-dir", str(run_dir), "--limit", "2", "--max-new-tokens", "4"])
    settings = held_out_settings(config)
    assert result["agent"] == settings["agent"] == "coda" and result["n"] == 2
    assert result["env"] == {"id": config.env.env_id, "kwargs": settings["env_kwargs"]}
    assert result["env"]["kwargs"]["question_after_results"] is True and result["model"].endswith("final")


def test_evaluate_flags_replace_single_settings_of_a_run(tiny_run):
    run_dir, config = tiny_run
    argv = ["--config", str(run_dir / "redcoda_config.json"), "--model", str(run_dir / "final"), "--limit", "1"]
    result = evaluate_main([*argv, "--top-k", "3", "--max-search-turns", "2", "--max-new-tokens", "4"])
    kwargs = result["env"]["kwargs"]
    assert (kwargs["top_k"], kwargs["max_executor_turns"], kwargs["max_passage_words"]) == (3, 3, 20)


def test_evaluate_takes_the_trainers_names_and_the_old_ones(tiny_run):
    run_dir, _ = tiny_run
    model = ["--agent", "search_r1", "--model", str(run_dir / "final"), "--limit", "1", "--max-new-tokens", "4"]
    trainer_names = ["--max-search-turns", "2", "--eval-batch-size", "1", "--instructions", "short"]
    result = evaluate_main([*model, *trainer_names, "--question-after-results", "--top-k", "2"])
    kwargs = result["env"]["kwargs"]
    assert (kwargs["max_turns"], kwargs["instructions"], kwargs["question_after_results"]) == (3, "short", True)
    old = evaluate_main([*model, "--max-turns", "3", "--batch", "1", "--top-k", "2"])
    assert old["env"]["kwargs"]["max_turns"] == 3  # --max-turns counts every turn, --max-search-turns the searches
