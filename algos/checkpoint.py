"""Crash-safe training checkpoints: everything needed to continue a run exactly, written atomically.

Layout under ``<run_dir>/checkpoints``:

    step_000050/
        weights.safetensors   trainable parameters (the whole model, or only the LoRA adapter)
        optimizer.pt          optimizer state dict
        rng.safetensors       torch CPU (and CUDA) generator states
        state.json            step, config, weighting (RED) state, collector state, Python/NumPy RNG states,
                              the metrics rows of the steps since the previous checkpoint, and a manifest of
                              the other files with their sizes and SHA-256 digests; written last
    latest                    text file naming the newest complete checkpoint directory

Atomicity: a checkpoint is written into a temporary sibling directory, every file is fsynced, then the
directory is renamed into place (`os.replace`) and the parent directory fsynced; only then is ``latest``
replaced, itself through a fsynced temporary file. A crash at any point leaves the previous checkpoint
and the previous ``latest`` untouched; a leftover temporary directory is ignored and removed by the
next save. Loading verifies the manifest (every file's size and SHA-256, so a torn write and bytes
damaged after the fact are both caught) and falls back to the newest complete checkpoint when ``latest``
points at a missing or damaged one; `checkpoint_problem` says what is wrong with a damaged one. Only the
newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

__all__ = [
    "Checkpoint",
    "checkpoint_problem",
    "complete_checkpoints",
    "damaged_checkpoints",
    "find_latest",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "write_text_atomic",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.json"
LATEST_FILE = "latest"


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
    """Everything else (config, weighting, collector, RNG states, extra)."""


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) global RNG states."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` through a fsynced temporary file: a crash leaves the old or the new text."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from the run's other readers
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint after `step` steps."""
    return f"step_{step:06d}"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    weights: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 3,
    _before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write one checkpoint atomically, point ``latest`` at it, and prune old ones.

    Args:
        root: The checkpoints directory (created if missing).
        step: Steps done; names the directory.
        weights: Trainable tensors by name (saved as safetensors, on CPU).
        optimizer: Optimizer state dict.
        state: JSON-serialisable state (config, weighting, collector, extra); RNG states are added here.
        keep: Keep this many newest checkpoints (at least 1).
        _before_commit: Test hook called with the temporary directory after every file is written and
            before the rename: raising there simulates a crash mid-save.

    Returns:
        The checkpoint's directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):  # debris of an earlier crash
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        rng = rng_state()
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in weights.items()}
        save_file(tensors, str(tmp / "weights.safetensors"))
        torch.save(dict(optimizer), tmp / "optimizer.pt")
        rng_tensors = {"torch": rng.pop("torch")}
        for i, cuda_state in enumerate(rng.pop("cuda", [])):
            rng_tensors[f"cuda_{i}"] = cuda_state
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        files = ["weights.safetensors", "optimizer.pt", "rng.safetensors"]
        for name in files:
            _fsync_file(tmp / name)
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in files}
        payload = {"step": step, **dict(state), "rng": rng, "manifest": manifest}
        with open(tmp / STATE_FILE, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        if _before_commit is not None:
            _before_commit(tmp)
        tmp.chmod(0o755)
        if final.exists():  # a re-run of the same step (resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    write_text_atomic(root / LATEST_FILE, final.name + "\n")
    for old in _step_dirs(root)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


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
    try:
        with open(path / STATE_FILE, encoding="utf-8") as handle:
            manifest = json.load(handle)["manifest"]
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (an unfinished save)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{STATE_FILE} is unreadable ({type(err).__name__})"
    if not isinstance(manifest, dict):
        return f"{STATE_FILE} holds no manifest"
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
        if digest is not None and _sha256(path / name) != digest:
            return f"{name}: SHA-256 mismatch (damaged after it was written)"
    return None


def _is_complete(path: Path) -> bool:
    return checkpoint_problem(path) is None


def damaged_checkpoints(root: str | os.PathLike) -> dict[Path, str]:
    """Every ``step_*`` directory under `root` that cannot be loaded, with what is wrong with it, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {path: checkpoint_problem(path) for path in _step_dirs(root)}
    return {path: problem for path, problem in found.items() if problem is not None}


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every complete, undamaged ``step_*`` directory under `root` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [(int(p.name.removeprefix("step_")), p) for p in _step_dirs(root) if _is_complete(p)]


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
    for path in reversed(_step_dirs(root)):
        if path != named and _is_complete(path):
            return path
    return None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint directory (see `find_latest`) and restore the global RNG states it holds.

    Args:
        path: A ``step_*`` directory.

    Returns:
        The `Checkpoint`; weights and optimizer state are on CPU.
    """
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} is not a complete checkpoint: {problem}")
    with open(path / STATE_FILE, encoding="utf-8") as handle:
        state = json.load(handle)
    rng_tensors = load_file(str(path / "rng.safetensors"))
    rng = dict(state.pop("rng"))
    rng["torch"] = rng_tensors["torch"]
    cuda = [rng_tensors[k] for k in sorted((k for k in rng_tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda:
        rng["cuda"] = cuda
    set_rng_state(rng)
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return Checkpoint(path, int(state["step"]), load_file(str(path / "weights.safetensors")), optimizer, state)
