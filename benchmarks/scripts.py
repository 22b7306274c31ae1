"""The console scripts of pyproject.toml, each a door to one tool that imports the tool only when run.

    redcoda-evaluate --help            # benchmarks.evaluate (needs the train extra)
    redcoda-compare --help             # benchmarks.compare (needs the train extra)
    redcoda-first-search EVAL.json     # benchmarks.first_search (the env alone)

A tool's module imports what its extra brings (torch, transformers, ...) as it loads. Imported by the console
script's own wrapper, a missing extra would end in a traceback before the tool could say anything; imported here,
it ends in one line that names the extra to install, exit status 1.
"""

from __future__ import annotations

import importlib
import sys

EXTRAS = {
    "torch": "train",
    "transformers": "train",
    "tensordict": "train",
    "torchrl": "train",
    "tyro": "train",
    "safetensors": "train",
    "matplotlib": "train",
    "wandb": "train",
    "pyserini": "lucene",
    "faiss": "dense",
    "fastapi": "server",
}
"""The extra that brings each optional top-level module a tool may import."""


def _run(module: str) -> None:
    """Import `module` and call its ``cli``; a missing optional dependency ends the process in one line."""
    try:
        tool = importlib.import_module(module)
    except ImportError as err:
        print(f"error: {_hint(module, err)}", file=sys.stderr)
        raise SystemExit(1) from None
    tool.cli()


def _hint(module: str, err: ImportError) -> str:
    """What to install, for an ImportError raised while `module` loaded; an ImportError that is no missing extra is
    raised again (a fault of the code, whose traceback is the way to find it)."""
    if "pip install 'redcoda[" in str(err):  # a package's own check (agents/, algos/) already names the extra
        return f"{module} cannot run: {err}"
    missing = (getattr(err, "name", None) or "").split(".")[0]
    if missing in EXTRAS:
        return (
            f"{module} needs the {EXTRAS[missing]} extra ({missing} missing): pip install 'redcoda[{EXTRAS[missing]}]'"
        )
    raise err


def evaluate() -> None:
    """``redcoda-evaluate``: `benchmarks.evaluate`."""
    _run("benchmarks.evaluate")


def compare() -> None:
    """``redcoda-compare``: `benchmarks.compare`."""
    _run("benchmarks.compare")


def first_search() -> None:
    """``redcoda-first-search``: `benchmarks.first_search`."""
    _run("benchmarks.first_search")
