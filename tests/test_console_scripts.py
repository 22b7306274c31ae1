"""The console scripts in pyproject.toml: each names a function that exists, answers `--help` with exit 0, and
returns None (a console script exits with its function's return value, so a returned summary would exit 1). On an
install of the env alone (no torch, no train extra) a tool that needs the extra ends in one line naming it, and
`redcoda-first-search` reads an evaluation with the env's dependencies only."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
TRAIN_ONLY = ("torch", "transformers", "tensordict", "torchrl", "tyro", "safetensors", "matplotlib", "wandb", "peft")
"""Top-level modules of the train extra (and what it pulls in) that an env-only install lacks."""


def _target(spec: str):
    module, function = spec.split(":")
    return importlib.import_module(module), function


def test_the_tools_users_run_are_console_scripts():
    assert {"redcoda-evaluate", "redcoda-compare", "redcoda-first-search"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_console_script_answers_help(name, monkeypatch, capsys):
    module, function = _target(SCRIPTS[name])
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_:
        getattr(module, function)()
    assert exit_.value.code == 0
    assert f"usage: {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_console_script_returns_none_whatever_its_main_returns(name, monkeypatch):
    module, function = _target(SCRIPTS[name])
    tool = importlib.import_module(f"benchmarks.{function}")
    monkeypatch.setattr(tool, "main", lambda *args, **kwargs: {"a summary": 1})
    assert getattr(module, function)() is None


_ENV_ONLY = """
import sys
from importlib.machinery import PathFinder


class EnvOnly(PathFinder):
    \"\"\"The path finder, blind to the train extra's modules: to importlib they are not installed.\"\"\"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in MISSING else PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [EnvOnly if finder is PathFinder else finder for finder in sys.meta_path]
"""


def _env_only(code: str, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where the train extra's modules are not installed as far as importlib can
    tell (as on `pip install redcoda` alone), with `argv` as its arguments."""
    preamble = f"MISSING = {TRAIN_ONLY!r}\n{_ENV_ONLY}\nsys.argv[1:] = {list(argv)!r}\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", preamble + code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize("name", ["redcoda-evaluate", "redcoda-compare"])
def test_a_tool_without_its_extra_ends_in_one_line_naming_it(name):
    module, function = SCRIPTS[name].split(":")
    done = _env_only(f"from {module} import {function}\n{function}()", "--help")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "pip install 'redcoda[train]'" in done.stderr


def test_a_fault_that_is_no_missing_extra_keeps_its_traceback(monkeypatch):
    from benchmarks import scripts

    with pytest.raises(ImportError, match="cannot import name"):
        scripts._hint("benchmarks.evaluate", ImportError("cannot import name 'nope' from 'envs'", name="envs"))


def test_first_search_reads_an_evaluation_without_torch(tmp_path):
    """The evaluation file of a run (dev 1: the question-as-query search shows its answer; dev 9: yes/no), read and
    replayed by `redcoda-first-search` in a process where torch cannot be imported."""
    settings = {"env_kwargs": {"split": "dev", "protocol": "flat", "retriever": "bm25-python", "top_k": 3}}
    predictions = [
        {"index": 1, "gold_answers": ["Carver Dana Andrews"], "f1": 1.0, "num_searches": 1, "actions": []},
        {"index": 9, "gold_answers": ["yes"], "f1": 1.0, "num_searches": 1, "actions": []},
    ]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"settings": settings, "predictions": predictions}))
    code = (
        "from benchmarks.scripts import first_search\nfirst_search()\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)\n"
    )
    done = _env_only(code, str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "| eval | 1, 1.000 [" in done.stdout and "| 1, 1.000 |" in done.stdout, done.stdout
