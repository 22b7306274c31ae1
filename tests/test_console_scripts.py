"""The console scripts in pyproject.toml: each names a function that exists, answers `--help` with exit 0, and
returns None (a console script exits with its function's return value, so a returned summary would exit 1)."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


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
    monkeypatch.setattr(module, "main", lambda *args, **kwargs: {"a summary": 1})
    assert getattr(module, function)() is None
