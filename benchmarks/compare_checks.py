"""What keeps a comparison what it says: the settings it owns, one row per system, and caches keyed by settings.

`benchmarks.compare` calls these before anything trains. A system's own settings (``grpo:name=value``) and
``--train-arg`` flags may not set what the comparison sets for every run (`OWNED`: the seed of each run, its
directory, its steps or minutes, the held-out evaluation, the preset, protocol and start model); two systems may not
train the same thing; and a run or evaluation already in ``--out`` is reused only when it was made with the
settings this invocation asks for: a finished run trained otherwise is refused, naming what differs (`run_problems`),
and an evaluation scored otherwise is scored anew (`evaluation_current`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

OWNED = {
    "seed": "--seeds N trains seeds 0..N-1",
    "run_dir": "--out holds every run",
    "run_name": "--out holds every run",
    "steps": "--steps (or the --budget's)",
    "max_train_minutes": "--minutes",
    "eval_questions": "--eval-limit (the comparison scores every run itself)",
    "eval_batch_size": "the --budget's",
    "eval_split": "the comparison's held-out questions",
    "eval_data_path": "the comparison's held-out questions",
    "preset": "--budget",
    "protocol": "--protocol",
    "model": "--init-model or --warm-start-steps",
    "resume": "the comparison resumes unfinished runs itself",
    "torch_threads": "--threads",
    "keep_checkpoints": "the comparison keeps one checkpoint per run",
}
"""Settings the comparison sets for every run, each with the flag of the comparison that sets it."""

NOT_COMPARED = {"run_dir", "run_name", "resume", "resume_changed", "torch_threads", "progress", "wandb"}
NOT_COMPARED |= {"wandb_project", "memory_check", "dist_timeout_seconds", "push_to_hub", "save_every", "fsdp"}
NOT_COMPARED |= {"keep_checkpoints"}
"""Settings that do not change what a run computes (where it is written, threads, logging): not part of its key."""


def flag_names(argv: Sequence[str]) -> list[str]:
    """The setting names a trainer command line's flags set: ``--max-train-minutes=25`` and ``--no-wandb`` give
    ``max_train_minutes`` and ``wandb`` (a value after a flag is no flag)."""
    names = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names.append(name[3:] if name.startswith("no_") else name)
    return names


def owned_problem(where: str, names: Iterable[str]) -> str | None:
    """Why `names` (settings of a system or of ``--train-arg``) cannot be given, or None."""
    aliases = {"env_id": "env"}
    for name in names:
        name = aliases.get(name, name)
        if name in OWNED:
            return f"{where} sets {name}, which the comparison sets for every run: use {OWNED[name]}"
    return None


def duplicate_problem(systems: Sequence[Any]) -> str | None:
    """Why two of `systems` would be one row trained twice (or share run directories), or None."""
    seen: dict[Any, str] = {}
    for system in systems:
        for key in ((system.algo, tuple(sorted(_pairs(system.flags)))), system.slug):
            if key in seen:
                return f"--algos {seen[key]} and {system.name} are the same system: give each once"
            seen[key] = system.name
    return None


def _pairs(flags: Sequence[str]) -> list[tuple[str, ...]]:
    """A system's flags as (flag, value) pairs, so that their order does not make another system."""
    pairs, i = [], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            pairs.append((flags[i], flags[i + 1]))
            i += 2
        else:
            pairs.append((flags[i],))
            i += 1
    return pairs


def jsonable(value: Any) -> Any:
    """`value` as JSON reads it back (tuples as lists, paths as text), so saved and expected settings compare."""
    return json.loads(json.dumps(value, default=str))


def differences(saved: dict[str, Any], expected: dict[str, Any], skip: Iterable[str] = ()) -> list[str]:
    """``name saved -> expected`` for each setting of `expected` that `saved` holds otherwise (or lacks)."""
    skipped = set(skip)
    found = []
    for name, value in jsonable(expected).items():
        if name in skipped:
            continue
        if name not in saved:
            found.append(f"{name} (not recorded) -> {value!r}")
        elif jsonable(saved[name]) != value:
            found.append(f"{name} {saved[name]!r} -> {value!r}")
    return found


def saved_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The settings a finished run trained with: its summary's config, else its redcoda_config.json; None without."""
    summary = run_dir / "summary.json"
    if summary.exists():
        config = json.loads(summary.read_text()).get("config")
        if config:
            return config
    saved = run_dir / "redcoda_config.json"
    return json.loads(saved.read_text()) if saved.exists() else None


def run_problems(run_dir: Path, expected: dict[str, Any]) -> str | None:
    """Why the finished run in `run_dir` is not the run `expected` (its settings, `Config.flat`) would train, or None
    (no finished run there, or one trained with every setting that counts equal)."""
    if not (run_dir / "summary.json").exists():  # unfinished: the trainer's --resume continues it to these settings
        return None
    saved = saved_run_config(run_dir)
    if saved is None:
        return f"{run_dir} holds a finished run whose settings are not recorded: give another --out or remove it"
    found = differences(saved, expected, NOT_COMPARED)
    if not found:
        return None
    return (
        f"{run_dir} was trained with other settings than this comparison asks ({'; '.join(found)}): give another "
        "--out, or remove the run to train it anew"
    )


def evaluation_current(cached: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between a cached evaluation's key and `expected` (empty: it can be reused)."""
    return differences(cached.get("key") or {"settings": cached.get("settings")}, expected)
