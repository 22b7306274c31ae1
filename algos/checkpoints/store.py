"""Crash-safe training checkpoints: everything needed to continue a run exactly, written atomically.

Under ``<run_dir>/checkpoints``, one process and DDP write whole tensors, rank 0 alone (`save_checkpoint`); under
FSDP with several ranks each rank writes its own shards (`algos.checkpoints.sharded`):

    step_000050/
        weights.safetensors    trainable parameters (the whole model, or only the LoRA adapter)
        optimizer.pt           optimizer state dict
        rng.safetensors        rank 0's RNG states; rng_rank1.safetensors, ... every other rank's (`rng_file`)
        state.json             step, config, weighting (RED) state, collector state, learner state, the metrics
                               rows of the steps since the previous checkpoint
        manifest.json          every other file of the directory with its size and SHA-256 digest; written last
    latest                     text file naming the newest complete checkpoint directory

A checkpoint is written into a temporary directory and renamed into place (`algos.checkpoints.files`); a write
fault raises one `CheckpointWriteError` and leaves the previous checkpoint and ``latest`` untouched
(`algos.checkpoints.atomic`). Loading verifies the manifest (`checkpoint_problem`: a torn write, bytes damaged after
the fact, an edited state.json, a missing shard) and falls back to the newest complete checkpoint when
``latest`` points at a missing or damaged one. Checkpoints written before manifest.json existed carry their
manifest inside state.json, which it does not cover; they still load, verified as they were then. Only the
newest ``keep`` checkpoints are kept. `snapshot_checkpoint` splits a save in two: the copies of this moment, then
their write, which may run beside the next steps (`algos.checkpoints.background`). A whole-tensor checkpoint
resumes under FSDP too (each rank keeps its shard of the whole tensors), and a sharded one in one process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from algos.checkpoints.atomic import (
    fsync_file,
    sha256,
    writing,
)
from algos.checkpoints.files import (
    LATEST_FILE,
    MANIFEST_FILE,
    SHARDS_DIR,
    STATE_FILE,
    commit,
    new_tmp_dir,
    restore_rng,
    rng_file,
    rng_state,
    save_rng,
    step_dir_name,
    step_dirs,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Checkpoint",
    "checkpoint_problem",
    "complete_checkpoints",
    "damaged_checkpoints",
    "find_latest",
    "is_sharded",
    "load_checkpoint",
    "read_state",
    "save_checkpoint",
    "snapshot_checkpoint",
]


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: tensors and JSON state, ready to be put back into a trainer."""

    path: Path
    """Directory it was read from."""
    step: int
    """Optimizer steps done when it was written."""
    weights: dict[str, torch.Tensor]
    """Trainable parameters by name."""
    optimizer: dict[str, Any]
    """Optimizer state dict."""
    state: dict[str, Any]
    """Everything else (config, weighting, collector, extra)."""


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    weights: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 3,
    rng: Sequence[Mapping[str, Any]] | None = None,
    _before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write one whole-tensor checkpoint atomically, point ``latest`` at it, and prune old ones.

    Args:
        root: The checkpoints directory (created if missing).
        step: Steps done; names the directory.
        weights: Trainable tensors by name (saved as safetensors, on CPU).
        optimizer: Optimizer state dict.
        state: JSON-serialisable state (config, weighting, collector, extra).
        keep: Keep this many newest checkpoints (at least 1).
        rng: Every data-parallel rank's `rng_state`, in rank order; None: this process's alone.
        _before_commit: Test hook called with the temporary directory after every file is written and
            before the rename: raising there simulates a crash mid-save.

    Returns:
        The checkpoint's directory.

    Raises:
        CheckpointWriteError: it could not be written (a full or read-only disk, ...): the temporary directory is
            removed, the previous checkpoint and ``latest`` are untouched.
    """
    write = snapshot_checkpoint(
        root, step, weights=weights, optimizer=optimizer, state=state, keep=keep, rng=rng, _before_commit=_before_commit
    )
    return write()


def snapshot_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    weights: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 3,
    rng: Sequence[Mapping[str, Any]] | None = None,
    _before_commit: Callable[[Path], None] | None = None,
) -> Callable[[], Path]:
    """Copy what a checkpoint of this moment holds and return the write of those copies (`save_checkpoint`'s
    arguments; calling the result writes the checkpoint, as `save_checkpoint` does, and returns its directory).

    Every tensor (weights, the optimizer's state) is copied to the CPU and the JSON state is serialised now, so the
    steps after this call may change the originals while the write runs on another thread
    (`algos.checkpoints.background.BackgroundWriter`). The copies hold the weights and AdamW state once more in host
    memory until the write ends.
    """
    root = Path(root)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in weights.items()}
    optimizer_copy = _cpu_copies(dict(optimizer))
    payload = json.loads(json.dumps({"step": step, **dict(state)}, default=str))
    rngs = list(rng) if rng is not None else [rng_state()]

    def write() -> Path:
        return _write_checkpoint(root, step, tensors, optimizer_copy, payload, keep, rngs, _before_commit)

    return write


def _cpu_copies(value: Any) -> Any:
    """`value` with every tensor inside its dicts, lists and tuples copied to the CPU (an optimizer's state dict)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copies(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copies(item) for item in value)
    return value


def _write_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    payload: dict[str, Any],
    keep: int,
    rngs: Sequence[Mapping[str, Any]],
    before_commit: Callable[[Path], None] | None,
) -> Path:
    """Write a checkpoint's copies into a temporary directory, then commit it (`algos.checkpoints.files.commit`)."""
    final = root / step_dir_name(step)
    with writing(final, root):
        tmp = new_tmp_dir(root, final)
    try:
        with writing(final, tmp):  # classified before the partial files that filled the disk are removed
            save_file(tensors, str(tmp / "weights.safetensors"))
            fsync_file(tmp / "weights.safetensors")
            torch.save(optimizer, tmp / "optimizer.pt")
            fsync_file(tmp / "optimizer.pt")
            for rank, states in enumerate(rngs):
                save_rng(tmp / rng_file(rank), states)
            commit(tmp, final, payload, {}, keep, before_commit)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _read_manifest(path: Path) -> dict[str, Any] | str:
    """The manifest of checkpoint `path` (file name to expected size and digest), or what is wrong with it."""
    try:
        with open(path / MANIFEST_FILE, encoding="utf-8") as handle:
            files = json.load(handle)["files"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_FILE} is unreadable ({type(err).__name__})"
    else:
        if not isinstance(files, dict):
            return f"{MANIFEST_FILE} lists no files"
        if STATE_FILE not in files:
            return f"{MANIFEST_FILE} does not cover {STATE_FILE}"
        return files
    # no manifest.json: a checkpoint of the earlier format (its manifest inside state.json), or an unfinished save
    try:
        with open(path / STATE_FILE, encoding="utf-8") as handle:
            files = json.load(handle).get("manifest")
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (an unfinished save)"
    except (OSError, ValueError, AttributeError) as err:
        return f"{STATE_FILE} is unreadable ({type(err).__name__})"
    if not isinstance(files, dict):
        return f"{MANIFEST_FILE} is missing (an unfinished save)"
    return files


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """What makes a checkpoint directory unusable, or None when it is complete and undamaged.

    Every file of the manifest must exist with its recorded size and SHA-256 digest (checkpoints written
    before digests were recorded are checked by size only).

    Args:
        path: A ``step_*`` directory.

    Returns:
        A short reason (e.g. ``"optimizer.pt: SHA-256 mismatch"``), or None.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    if isinstance(manifest, str):
        return manifest
    for name, expected in manifest.items():
        if not isinstance(expected, dict):  # written before digests were recorded: the size alone
            expected = {"bytes": expected}
        size, digest = expected.get("bytes"), expected.get("sha256")
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is {actual} bytes, the manifest says {size}"
        if digest is not None and sha256(path / name) != digest:
            return f"{name}: SHA-256 mismatch (damaged after it was written)"
    return None


def _is_complete(path: Path) -> bool:
    return checkpoint_problem(path) is None


def damaged_checkpoints(root: str | os.PathLike) -> dict[Path, str]:
    """Every ``step_*`` directory under `root` that cannot be loaded, with what is wrong with it, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {path: checkpoint_problem(path) for path in step_dirs(root)}
    return {path: problem for path, problem in found.items() if problem is not None}


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every complete, undamaged ``step_*`` directory under `root` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [(int(p.name.removeprefix("step_")), p) for p in step_dirs(root) if _is_complete(p)]


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`: the one ``latest`` names, else the newest that verifies.

    Returns:
        Its directory, or None when there is none.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    named = None
    try:
        named = root / (root / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        pass
    if named is not None and named.name:
        problem = checkpoint_problem(named)
        if problem is None:
            return named
        logger.warning("checkpoint %s is unusable (%s); looking for an older one", named, problem)
    for path in reversed(step_dirs(root)):
        if path != named and _is_complete(path):
            return path
    return None


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether checkpoint `path` holds DCP shards (`save_sharded_checkpoint`) rather than whole tensors."""
    return (Path(path) / SHARDS_DIR).is_dir()


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON state of checkpoint `path` (step, config, weighting, collector, ...), without verifying it."""
    with open(Path(path) / STATE_FILE, encoding="utf-8") as handle:
        state = json.load(handle)
    state.pop("manifest", None)  # the earlier format's
    return state


def load_checkpoint(path: str | os.PathLike, rank: int = 0) -> Checkpoint:
    """Read a whole-tensor checkpoint directory (see `find_latest`) and restore the global RNG states it holds.

    Args:
        path: A ``step_*`` directory.
        rank: This process's data-parallel rank: its RNG states are restored (rank 0's when the checkpoint has
            none of its own).

    Returns:
        The `Checkpoint`; weights and optimizer state are on CPU.

    Raises:
        ValueError: the checkpoint is damaged or incomplete, or sharded (read it with `load_sharded_tensors`).
    """
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} is not a complete checkpoint: {problem}")
    if is_sharded(path):
        raise ValueError(f"{path} is a sharded checkpoint (written under --fsdp): read it with load_sharded_tensors")
    state = read_state(path)
    restore_rng(path, rank, legacy=state.pop("rng", None))
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return Checkpoint(path, int(state["step"]), load_file(str(path / "weights.safetensors")), optimizer, state)
