"""A run's log holds the run's own lines and third-party warnings, not third-party INFO chatter or progress bars."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from algos.run.logs import QUIET_LOGGERS, BelowWarning, set_up_logging

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restored_logging():
    """Undo `set_up_logging`'s process-wide changes after a test: the filter on pytest's own handlers (which live
    across tests), the third-party loggers' levels, the progress bars."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield
    for each in logging.getLogger().handlers:
        for found in [f for f in each.filters if isinstance(f, BelowWarning)]:
            each.removeFilter(found)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    transformers_logging.enable_progress_bar()
    enable_progress_bars()


def test_a_tiny_run_in_process_logs_no_third_party_info_line(tmp_path, caplog, capsys, restored_logging):
    """The same run through the entry point's body in this process (its output is not a terminal here either): the
    records that reach the root logger's handlers and what is printed."""
    from algos.run.launch import main
    from benchmarks.scale_step import build

    model = build("tiny", tmp_path / "model")
    capsys.readouterr()
    caplog.set_level(logging.INFO)
    caplog.handler.setLevel(logging.NOTSET)  # as basicConfig's handler: bm25s logs at DEBUG on a logger set to DEBUG
    flags = ["--preset", "tiny", "--model", str(model), "--corpus", "distractor", "--steps", "1"]
    main([*flags, "--save-every", "0", "--eval-questions", "0", "--run-dir", str(tmp_path / "run")], algo="grpo_sft")
    names = {record.name for record in caplog.records}
    assert "agents.samplers.hf" in names  # the run's own INFO lines stay
    assert not [n for n in names if any(n == q or n.startswith(q + ".") for q in QUIET_LOGGERS)], names
    printed = capsys.readouterr()
    assert "Loading weights" not in printed.err and "Writing model shards" not in printed.err


@pytest.mark.slow  # a run in a process of its own; the in-process twin above is in the default set
def test_a_tiny_runs_log_has_no_third_party_info_lines(tmp_path):
    """A tiny run from a saved model directory (so transformers loads and writes weights, with their progress bars)
    over the in-memory BM25 (bm25s logs each index it builds at INFO, and sets its own logger to DEBUG at import),
    its output piped to a file as a batch job's is."""
    from benchmarks.scale_step import build

    model = build("tiny", tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "algos.red_grpo", "--preset", "tiny", "--model", str(model)]
    command += ["--retriever", "bm25-python", "--steps", "1", "--save-every", "0", "--eval-questions", "0"]
    done = subprocess.run(
        [*command, "--run-dir", str(tmp_path / "run")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    lines = log.splitlines()
    assert any(" agents.samplers.hf: sampler decode: " in line for line in lines)  # the run's own INFO lines stay
    chatter = [line for line in lines if any(f" {name}: " in line for name in QUIET_LOGGERS)]
    assert chatter == []
    assert not [line for line in lines if "Loading weights" in line or "Writing model shards" in line]


def test_third_party_info_is_dropped_unless_verbose():
    """The filter drops what a library logs below WARNING after setting its own level, and keeps its warnings."""
    record = logging.LogRecord("bm25s", logging.INFO, __file__, 1, "Building index from tokens", None, None)
    assert not BelowWarning().filter(record)
    record.levelno = logging.WARNING
    assert BelowWarning().filter(record)
    child = logging.LogRecord("httpx._client", logging.INFO, __file__, 1, "HTTP Request", None, None)
    assert not BelowWarning().filter(child)
    own = logging.LogRecord("algos.run.training_run", logging.INFO, __file__, 1, "memory estimate", None, None)
    assert BelowWarning().filter(own)
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        set_up_logging(verbose=True, interactive=True)
        assert not any(isinstance(f, BelowWarning) for f in handler.filters)
        set_up_logging(verbose=False, interactive=True)
        assert any(isinstance(f, BelowWarning) for f in handler.filters)
    finally:
        for each in root.handlers:  # pytest's capture handlers live across tests: take the filter off them
            for found in [f for f in each.filters if isinstance(f, BelowWarning)]:
                each.removeFilter(found)
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
