"""The files of a checkpoint directory: their names, the RNG state files, and the commit that makes a checkpoint.

Atomicity: a checkpoint is written into a temporary sibling directory, every file is fsynced, then the directory is
renamed into place (`os.replace`) and the parent directory fsynced; only then is ``latest`` replaced, itself
through a fsynced temporary file. A crash at any point leaves the previous checkpoint and the previous ``latest``
untouched; a leftover temporary directory is ignored and removed by the next save (`commit`, `new_tmp_dir`).

Each data-parallel rank's RNG states are a file of their own (`rng_file`): torch's CPU (and CUDA) generators as
tensors, Python's and NumPy's in the file's metadata; the ranks' streams part once anything draws from them per
rank, such as dropout over each rank's own micro-batches.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from algos.checkpoints.atomic import file_entry, fsync_dir, fsync_file, write_json, write_text_atomic

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "SHARDS_DIR",
    "STATE_FILE",
    "commit",
    "new_tmp_dir",
    "restore_rng",
    "rng_file",
    "rng_state",
    "save_rng",
    "set_rng_state",
    "step_dir_name",
    "step_dirs",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = "shards"
LATEST_FILE = "latest"


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


def rng_file(rank: int) -> str:
    """The file of a checkpoint that holds rank `rank`'s RNG states (rank 0's is one process's)."""
    return "rng.safetensors" if rank == 0 else f"rng_rank{rank}.safetensors"


def save_rng(path: Path, state: Mapping[str, Any]) -> None:
    """`state` (an `rng_state`) as a fsynced safetensors file: generator states as tensors, Python's and NumPy's
    as JSON in the metadata."""
    tensors = {"torch": state["torch"]}
    for i, cuda_state in enumerate(state.get("cuda", [])):
        tensors[f"cuda_{i}"] = cuda_state
    metadata = {"python": json.dumps(state["python"]), "numpy": json.dumps(state["numpy"])}
    save_file(tensors, str(path), metadata=metadata)
    fsync_file(path)


def restore_rng(path: str | os.PathLike, rank: int = 0, legacy: Mapping[str, Any] | None = None) -> None:
    """Set the global RNG states to rank `rank`'s in checkpoint `path` (rank 0's when it had fewer ranks).

    Args:
        path: A ``step_*`` directory.
        rank: This process's rank.
        legacy: The Python and NumPy states of a checkpoint written before they moved into the RNG file (its
            state.json's ``rng``).
    """
    path = Path(path)
    file = path / rng_file(rank)
    if not file.is_file():  # written by fewer ranks: rank 0's, as a fresh start seeds every rank alike
        file = path / rng_file(0)
    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    if "python" in metadata:
        state: dict[str, Any] = {"python": json.loads(metadata["python"]), "numpy": json.loads(metadata["numpy"])}
    elif legacy is not None:
        state = dict(legacy)
    else:
        raise ValueError(f"{file} holds no Python or NumPy RNG state")
    state["torch"] = tensors["torch"]
    cuda = sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k.removeprefix("cuda_")))
    if cuda:
        state["cuda"] = [tensors[k] for k in cuda]
    set_rng_state(state)


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint after `step` steps."""
    return f"step_{step:06d}"


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def new_tmp_dir(root: Path, final: Path) -> Path:
    """A fresh temporary directory for the checkpoint `final`, after removing any an earlier crash left."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))


def commit(
    tmp: Path,
    final: Path,
    payload: Mapping[str, Any],
    known: Mapping[str, dict[str, Any]],
    keep: int,
    before_commit: Callable[[Path], None] | None,
) -> None:
    """Finish a checkpoint whose tensor files are in `tmp`: state.json, the manifest last, the rename, ``latest``.

    Args:
        tmp: The temporary directory holding every other file, each fsynced.
        final: The checkpoint's directory.
        payload: What state.json holds.
        known: Manifest entries computed already (by the ranks that wrote those files); the rest are computed here.
        keep: Keep this many newest checkpoints.
        before_commit: Test hook, see `algos.checkpoints.store.save_checkpoint`.
    """
    write_json(tmp / STATE_FILE, payload)
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p != tmp / MANIFEST_FILE)
    manifest = {"files": {name: dict(known[name]) if name in known else file_entry(tmp / name) for name in files}}
    write_json(tmp / MANIFEST_FILE, manifest)
    for directory in sorted({(tmp / name).parent for name in files}):  # the entries of renamed-in files
        fsync_dir(directory)
    if before_commit is not None:
        before_commit(tmp)
    tmp.chmod(0o755)
    if final.exists():  # a re-run of the same step (resumed run): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    write_text_atomic(final.parent / LATEST_FILE, final.name + "\n")
    for old in step_dirs(final.parent)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
