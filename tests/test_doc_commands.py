"""Every command line the docs show for an entry point parses: each ``python -m algos.* | benchmarks.* |
retrievers.*`` line of README.md, docs/install.md and docs/recipes.md (``torchrun`` launches included) goes through
its entry point's own parser, checks included, and stops there: nothing trains, loads or serves.

The files a command names as placeholders (``my_train.jsonl``, ``my_corpus.jsonl``, ``FILE``, ...) are real files in
a scratch directory, written from the bundled data, so that a check that reads them reads real rows.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/install.md", "docs/recipes.md")
_MODULE = re.compile(r"(?:^|\s)-m\s+((?:algos|benchmarks|retrievers)\.[\w.]+)")
_DATA = ROOT / "envs" / "data" / "hotpotqa"
PLACEHOLDER_FILES = {
    "my_train.jsonl": _DATA / "dev.jsonl.gz",
    "my_dev.jsonl": _DATA / "dev.jsonl.gz",
    "my_corpus.jsonl": _DATA / "corpus.jsonl.gz",
    "wiki18.jsonl": _DATA / "corpus.jsonl.gz",
    "wiki-18.jsonl": _DATA / "corpus.jsonl.gz",
}
"""Files the docs' commands name, and the bundled data each is written from."""


def doc_commands(path: str) -> list[str]:
    """The entry-point command lines of a Markdown file: the lines of its ``bash`` blocks (continuations joined,
    comments and ``&&`` chains split off) and its inline code that starts a command, each naming a module with -m."""
    text = (ROOT / path).read_text(encoding="utf-8")
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.sub(r"\s+#\s.*$", "", line).split("&&"):
                if _MODULE.search(part):
                    found.append(" ".join(part.split()))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        # a command with arguments; `python -m retrievers.build_index` alone in a sentence names the tool
        if _MODULE.search(span) and span.split()[0] in ("python", "torchrun") and len(span.split()) > 3:
            found.append(" ".join(span.split()))
    return found


def all_commands() -> list[tuple[str, str]]:
    return [(path, command) for path in DOCS for command in dict.fromkeys(doc_commands(path))]


class Parsed(Exception):
    """Raised by the wrapped parsers once a command line has parsed: the entry point stops before any work."""


@pytest.fixture
def stop_after_parsing(monkeypatch, tmp_path):
    """Every parser an entry point reaches (argparse's, `algos.run.cli.parse_config` with its checks, a plain
    `tyro.cli`) parses for real, then raises `Parsed`; the placeholder files exist in the working directory."""
    import tyro

    import algos.run.cli
    import algos.run.launch

    for name, source in PLACEHOLDER_FILES.items():
        (tmp_path / name).write_bytes(gzip.decompress(source.read_bytes()))
    (tmp_path / "FILE").write_text("{}\n")  # `--config FILE`: an empty mapping of settings
    monkeypatch.chdir(tmp_path)

    real_parse_args, real_parse_config, real_tyro_cli = (
        argparse.ArgumentParser.parse_args,
        algos.run.cli.parse_config,
        tyro.cli,
    )
    inside_parse_config = []

    def parse_args(self, *args, **kwargs):
        real_parse_args(self, *args, **kwargs)
        raise Parsed

    def parse_config(*args, **kwargs):
        inside_parse_config.append(True)  # its own tyro.cli call returns as usual, so its checks run
        try:
            real_parse_config(*args, **kwargs)
        finally:
            inside_parse_config.pop()
        raise Parsed

    def tyro_cli(*args, **kwargs):
        config = real_tyro_cli(*args, **kwargs)
        if inside_parse_config:
            return config
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(algos.run.cli, "parse_config", parse_config)
    monkeypatch.setattr(algos.run.launch, "parse_config", parse_config)
    monkeypatch.setattr(tyro, "cli", tyro_cli)


def _parse(module: str, args: list[str], monkeypatch) -> None:
    """Run `module` as ``python -m`` would with `args`, up to its parser; fail on a usage error."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(Parsed):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            pytest.fail(f"python -m {module} {shlex.join(args)}: exit {stop.code} while parsing")


def test_the_docs_show_the_entry_points():
    modules = {_MODULE.search(command)[1] for _, command in all_commands()}
    assert {"algos.red_grpo", "benchmarks.evaluate", "retrievers.server", "retrievers.build_index"} <= modules


def _split(command: str) -> tuple[list[str] | None, str | None, list[str]]:
    """A command as (torchrun's own flags or None, the module it runs, the module's arguments); no module for the
    launcher named alone."""
    words = [word.strip("[]") for word in shlex.split(command)]  # `[--fsdp]`: an optional flag, shown parsed
    if words[0] == "torchrun":
        launcher = words[1:]
    elif words[:3] == ["python", "-m", "algos.torchrun"]:
        launcher = words[3:]
    else:
        assert words[:2] == ["python", "-m"], command
        return None, words[2], words[3:]
    if "-m" not in launcher:
        return launcher, None, []
    at = launcher.index("-m")
    return launcher[:at], launcher[at + 1], launcher[at + 2 :]


@pytest.mark.parametrize(("path", "command"), all_commands(), ids=lambda value: value[:80])
def test_every_command_line_in_the_docs_parses(path, command, stop_after_parsing, monkeypatch):
    launcher, module, args = _split(command)
    if module is None:
        pytest.skip("the launcher named alone, without a command to launch")
    if launcher is not None:
        from torch.distributed.run import parse_args

        with pytest.raises(Parsed):  # torchrun's own flags, by torchrun's parser
            parse_args([*launcher, "-m", module, *args])
    if module.startswith("algos.") and "vllm" in args and importlib.util.find_spec("vllm") is None:
        # the checks refuse `--sampler vllm` where vLLM is not installed (tests/test_cli_errors.py); the rest parses
        at = args.index("vllm")
        assert args[at - 1] == "--sampler", command
        args = args[: at - 1] + args[at + 1 :]
    if "--help" in args:
        monkeypatch.setattr(sys, "argv", [module, *args])
        with pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        assert stop.value.code == 0
        return
    _parse(module, args, monkeypatch)
