"""`benchmarks.evaluate` checks its input before it works: every number in its range, the output files writable, one
line and exit status 2 otherwise, before any model, index or episode; and it takes every env setting of the trainer
under the trainer's name."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from algos.settings import EnvSettings
from benchmarks.evaluate import _parser, main, run_settings


def _refused(argv: list[str], capsys) -> str:
    """Run the command in this process; its one ``error:`` line (exit status 2, no traceback, no usage text)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-batch-size", "-1"], "--eval-batch-size must be >= 1, got -1"),
        (["--eval-batch-size", "0"], "--eval-batch-size must be >= 1, got 0"),  # not silently the default
        (["--batch", "0"], "--eval-batch-size must be >= 1, got 0"),
        (["--first", "-5", "--limit", "2"], "--first must be >= 0, got -5"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--num-questions", "0"], "--limit must be >= 1, got 0"),
        (["--top-k", "0"], "--top-k must be in [1, 1000], got 0"),
        (["--max-passage-words", "0"], "--max-passage-words must be in [1, 100000], got 0"),
        (["--max-search-turns", "0"], "--max-search-turns must be in [1, 9999], got 0"),
        (["--max-planner-turns", "0"], "--max-planner-turns must be in [1, 10000], got 0"),
        (["--max-turns", "0"], "--max-turns must be in [1, 10000], got 0"),
        (["--max-executor-turns", "-2"], "--max-executor-turns must be in [1, 10000], got -2"),
        (["--seed", "-3"], "--seed must be in [0, 4294967295], got -3"),
        (["--max-new-tokens", "-4"], "--max-new-tokens must be >= 1, got -4"),
        (["--max-context-tokens", "0"], "--max-context-tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a number >= 0 (0: greedy), got -1.0"),
        (["--temperature", "nan"], "--temperature must be a number >= 0 (0: greedy), got nan"),
        (["--retriever-timeout", "0"], "--retriever-timeout must be a number of seconds > 0, got 0.0"),
        (["--retriever-retries", "-1"], "--retriever-retries must be >= 0, got -1"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--sampler-timeout", "inf"], "--sampler-timeout must be a number of seconds > 0, got inf"),
        (["--sampler-retries", "-1"], "--sampler-retries must be >= 0, got -1"),
        (["--max-error-rate", "2"], "--max-retrieval-error-rate must be a share in [0, 1], got 2.0"),
        (["--max-retrieval-error-rate", "-0.1"], "--max-retrieval-error-rate must be a share in [0, 1], got -0.1"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    ],
)
def test_every_number_is_checked_as_it_is_read(argv, message, capsys):
    assert _refused(["--agent", "direct", *argv], capsys) == f"error: {message}"


def test_outputs_that_cannot_be_written_are_refused_before_any_episode(tmp_path, capsys):
    """A directory, a path under a file, a place that cannot be made, or one file for both outputs: refused at start,
    so no evaluation runs its episodes and then loses its predictions."""
    (tmp_path / "file").write_text("")
    base = ["--agent", "direct", "--model", str(tmp_path / "no-model-here")]  # a model would only load later
    for flag in ("--out", "--result"):
        assert (
            _refused([*base, flag, str(tmp_path)], capsys)
            == f"error: {flag} {tmp_path}: is a directory; give a file name"
        )
        under = tmp_path / "file" / "x.json"
        assert f"{tmp_path / 'file'} is a file, not a directory" in _refused([*base, flag, str(under)], capsys)
        assert "cannot write in" in _refused([*base, flag, "/proc/no-such/x.json"], capsys)
    same = str(tmp_path / "both.json")
    assert "--out and --result are one file" in _refused([*base, "--out", same, "--result", same], capsys)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot write in" in _refused([*base, "--out", str(locked / "x.jsonl")], capsys)
    # every refusal came before the model was looked for: a missing model is the next thing refused
    assert "no-model-here" in _refused([*base, "--out", str(tmp_path / "ok.jsonl")], capsys)
    assert not (tmp_path / "ok.jsonl").exists()


def test_every_env_setting_of_the_trainer_is_a_flag_of_the_same_name():
    """The trainer's env section (`algos.settings.EnvSettings`) and the evaluation's parser name the same settings."""
    options = {flag for action in _parser()._actions for flag in action.option_strings}
    trainer = {"--" + field.name.replace("_", "-") for field in dataclasses.fields(EnvSettings)}
    assert trainer - options == set()
    assert {"--env-id", "--max-error-rate", "--num-questions", "--no-question-after-results"} <= options


def test_a_run_s_env_flags_replace_its_settings(tmp_path):
    """Given with a run's config, the env flags replace single settings, the query-rewrite env's own among them."""
    config = tmp_path / "redcoda_config.json"
    config.write_text(json.dumps({"env": "RedCoda-QueryRewrite-v0", "max_passage_words": 50}))
    plain = run_settings(config, {})
    raw = run_settings(config, {"query_action_format": "raw", "max_passage_words": 20})
    assert plain["env_kwargs"]["action_format"] == "tag" and raw["env_kwargs"]["action_format"] == "raw"
    assert (plain["env_kwargs"]["max_passage_words"], raw["env_kwargs"]["max_passage_words"]) == (50, 20)


def test_on_a_cpu_the_batch_is_no_larger_than_fits_in_memory(monkeypatch, tmp_path):
    """With the transformers sampler on a CPU, `--eval-batch-size` episodes at a time only where their contexts fit
    in the memory available (`algos.run.memory.held_out_batch`); other samplers keep the flag's batch."""
    from agents.models import tiny_model
    from algos.run import memory
    from benchmarks.evaluate import _batch_that_fits, _flag_target

    model, tokenizer = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    parser = _parser()

    def batch(*argv: str) -> int:
        args = parser.parse_args(["--agent", "coda", "--model", str(tmp_path), "--device", "cpu", *argv])
        return _batch_that_fits(args, _flag_target(args, parser, {}))

    assert batch("--eval-batch-size", "40") == 40
    monkeypatch.setattr(memory, "usable_memory", lambda device: 0.0)
    assert batch("--eval-batch-size", "40") == 1
    assert batch("--eval-batch-size", "40", "--sampler", "openai", "--sampler-url", "http://127.0.0.1:9") == 40
