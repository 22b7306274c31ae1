"""The command line of the training entry points: a `Config` from the preset, a ``--config FILE`` and the flags.

`parse_config` is what every entry point parses with (through `algos.run.launch.main`); its ``--help`` is tyro's, one
group per section of `algos.config.Config`, without the entry point's fixed ``--algo``.

    python -m algos.red_grpo --help
    python -m algos.red_grpo --preset cpu --config runs/red/redcoda_config.json --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path

from algos.config import VALIDATE_ON_INIT, Config, default_preset, preset_config
from algos.presets import PRESETS
from algos.registry import UnknownAlgorithm, algorithm, entry_command
from algos.settings import AlgoName, PresetName

__all__ = ["load_config_file", "parse_config"]


def parse_config(argv: Sequence[str] | None = None, *, algo: AlgoName, description: str | None = None) -> Config:
    """Parse a command line into the `Config` of algorithm `algo`, by one rule for every entry point:

        the dataclasses' defaults < the preset < the algorithm's defaults (`algos.registry.Algorithm.defaults_for`:
        its own, then its own for that preset) < a ``--config FILE``'s values < the command line's flags

    The preset is ``--preset``'s, else the config file's, else ``gpu`` with CUDA and ``cpu`` without (printed, as
    the recipes differ). ``--config`` takes a YAML or JSON mapping of field names to values (`load_config_file`),
    such as a run's saved ``redcoda_config.json``; an ``algo`` in it must be `algo` (the entry point's learner trains).

    Args:
        argv: Arguments without the program name; None reads sys.argv.
        algo: A registered algorithm's name (the entry point's, fixed: no flag of the trainer sets it); its
            settings class (`Algorithm.config`) is what is parsed.
        description: Text shown at the top of ``--help``.

    Returns:
        The parsed, frozen `Config` (the algorithm's settings class).

    Raises:
        SystemExit: status 2, after a one-line message naming the flag, for settings that cannot train
            (``--temperature 0``, ``--group-size 1`` with GRPO, ``--steps 0``, ...) or an algorithm that is not
            registered, as for any usage error.
    """
    import tyro

    try:
        entry = algorithm(algo)
        config_cls = entry.config_class()
    except (UnknownAlgorithm, ImportError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    args = list(sys.argv[1:] if argv is None else argv)
    args, from_file = _config_file_values(args, config_cls)
    if from_file.get("algo", algo) != algo:  # the learner is the entry point's: a file never swaps it silently
        how = f"{entry_command(str(from_file['algo']))} --config FILE"
        print(
            f"error: --config: the file holds a {from_file['algo']} run's settings (algo), not {algo}'s: train it "
            f"with {how}, or delete its algo line to train {algo} with its other settings",
            file=sys.stderr,
        )
        raise SystemExit(2)
    preset = _chosen_preset(args, from_file)
    token = VALIDATE_ON_INIT.set(False)
    try:
        from_file = {k: v for k, v in from_file.items() if k not in ("preset", "algo")}
        values = {**entry.defaults_for(preset), **from_file, "algo": algo}
        base = preset_config(preset, config_cls, **values)  # checked with the flags, below
        usage = "--config FILE: a YAML or JSON file of these settings, applied after the preset, before the flags."
        description = f"{description or ''}\n\n{usage}".strip()
        config = _tyro_cli(tyro, config_cls, base, args, description)
    finally:
        VALIDATE_ON_INIT.reset(token)
    try:
        config.validate()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return config


def _tyro_cli(
    tyro: types.ModuleType, config_cls: type[Config], base: Config, args: list[str], description: str
) -> Config:
    """`tyro.cli`, with its usage errors (an unknown flag, a value of the wrong type, a missing value) printed as the
    project's one line, ``error: ...``, instead of tyro's framed box with the flag's help; exit status 2 as before.

    tyro's public API has no way to get an error's message without its box (its parse-error hook is private and
    unstable), so the box is read as text: pyproject.toml pins tyro to the releases whose messages
    `tests/test_cli_errors.py` reads whole."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            config = tyro.cli(
                config_cls, default=base, args=args, description=description, prog=os.path.basename(sys.argv[0])
            )
    except SystemExit as stop:
        if not stop.code:
            sys.stderr.write(captured.getvalue())
            raise
        print(f"error: {_box_message(captured.getvalue())}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stderr.write(captured.getvalue())  # anything else tyro said (a warning) is the user's to see
    return config


def _box_message(text: str) -> str:
    """The message of tyro's framed error as one line: its title line and its help sections dropped.

    The frame is Unicode on a terminal and ASCII otherwise (the title then on a line of its own), so lines are
    read after stripping the frame's characters: a line of rules ends a section, and the first section after the
    title is the message.
    """
    rules = set("─━-=+ ")
    lines = [line.strip().strip("│|╭╮╰╯+").strip(" ─-") for line in text.strip().splitlines()]
    sections: list[list[str]] = [[]]
    for raw, line in zip(text.strip().splitlines()[1:], lines[1:], strict=True):  # the first line is the title
        if set(raw.strip().strip("│|╭╮╰╯")) <= rules:
            sections.append([])
        elif line:
            sections[-1].append(line)
    message = next((" ".join(section) for section in sections if section), "")
    return message or "could not parse the command line (see --help)"


def load_config_file(path: str | os.PathLike[str], config_cls: type[Config] = Config) -> dict[str, object]:
    """Field values from a YAML or JSON file (a mapping of field name to value; a run's redcoda_config.json is one).

    Lists become tuples (JSON has no tuples), so a saved config reads back as the values it was saved from.

    Raises:
        ValueError: the file is not a mapping, or names something that is not a field of `config_cls`.
    """
    import json

    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    else:
        import yaml

        try:
            values = yaml.safe_load(text)  # YAML is a superset of JSON: any other name reads either
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f"line {where.line + 1}: " if where is not None else ""
            raise ValueError(f"{path}: not valid YAML ({at}{getattr(err, 'problem', None) or err})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a config file is a mapping of field names to values, got {type(values).__name__}")
    hints = config_cls.flat_types()
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"{path}: not a setting of {config_cls.__name__}: {', '.join(unknown)}")
    return {name: _typed(value, hints[name], f"{path}: {name}") for name, value in values.items()}


def _typed(value: object, hint: object, where: str) -> object:
    """`value` as a field of type `hint` holds it (lists as tuples, whole numbers as floats where floats go).

    Raises:
        ValueError: `value` is not of the type, naming `where` (the file and the key) and what was expected.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            with contextlib.suppress(ValueError):
                return _typed(value, option, where)
        expected = " or ".join("null" if a is type(None) else _name(a) for a in args)
    elif origin is typing.Literal:
        if value in args:
            return value
        expected = "one of " + ", ".join(repr(a) for a in args)
    elif origin is tuple:
        if isinstance(value, list | tuple):
            items = args if not (len(args) == 2 and args[1] is Ellipsis) else (args[0],) * len(value)
            if len(items) == len(value):
                return tuple(_typed(v, t, where) for v, t in zip(value, items, strict=True))
        expected = (
            f"a list of {len(args)} ({_name(args[0])} each)"
            if args[-1] is not Ellipsis
            else f"a list ({_name(args[0])} each)"
        )
    elif hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif hint in (bool, int, str) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    else:
        expected = _name(hint)
    raise ValueError(f"{where} must be {expected}, got {value!r}")


def _name(hint: object) -> str:
    """How an error message names a type: "an int", "a float", ..."""
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    return names.get(hint, str(hint))


def _config_file_values(args: list[str], config_cls: type[Config]) -> tuple[list[str], dict[str, object]]:
    """`args` without ``--config FILE``, and the file's field values (none without the flag)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(args)
    if known.config is None:
        return args, {}
    try:
        return rest, load_config_file(known.config, config_cls)
    except (OSError, ValueError) as err:
        print(f"error: --config: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _chosen_preset(args: Sequence[str], from_file: dict[str, object]) -> PresetName:
    """The preset of ``--preset``, else of the config file, else by hardware; says which when hardware chose it."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    named = pre.parse_known_args(list(args))[0].preset or from_file.get("preset")
    if named is not None:
        return named  # type: ignore[return-value]
    preset = default_preset()
    if int(os.environ.get("RANK", "0")) == 0 and not {"-h", "--help"} & set(args):
        # The same command trains a different recipe on a machine with CUDA: say so before any work starts.
        why = "a CUDA device is available" if preset == "gpu" else "no CUDA device"
        print(f"preset {preset}: {why}; pass --preset to choose", flush=True)
    return preset
