"""Crash-safe training checkpoints: everything needed to continue a run exactly, written atomically.

Two layouts under ``<run_dir>/checkpoints``. One process and DDP write whole tensors, rank 0 alone
(`save_checkpoint`):

    step_000050/
        weights.safetensors    trainable parameters (the whole model, or only the LoRA adapter)
        optimizer.pt           optimizer state dict
        rng.safetensors        rank 0's RNG states: torch's CPU (and CUDA) generators as tensors, Python's and
                               NumPy's in the file's metadata
        rng_rank1.safetensors  every other rank's, likewise (data parallel: the ranks' streams part once anything
                               draws from them per rank, such as dropout over each rank's own micro-batches)
        state.json             step, config, weighting (RED) state, collector state, learner state, the metrics
                               rows of the steps since the previous checkpoint
        manifest.json          every other file of the directory with its size and SHA-256 digest; written last
    latest                     text file naming the newest complete checkpoint directory

Under FSDP with several ranks (`save_sharded_checkpoint`) each rank writes its own shard of the weights and of the
optimizer state with torch.distributed.checkpoint (DCP) in place of weights.safetensors and optimizer.pt, so no rank
ever holds the whole state:

    step_000050/
        shards/.metadata       DCP's index: each tensor's global shape and the file and offset of each chunk
        shards/__0_0.distcp    rank 0's chunks (weights, AdamW moments, weight average; replicated tensors such as
        shards/__1_0.distcp    a value head once, on one rank), rank 1's, ...
        rng.safetensors, rng_rank1.safetensors, ...   each rank's RNG states, written by that rank
        state.json             as above, plus the optimizer's parameter groups (its hyperparameters, by FQN)
        manifest.json          as above: every file, the shards and DCP's .metadata included

DCP reshards on load (`load_sharded_tensors`), so a sharded checkpoint resumes with any number of ranks or in one
process; a whole-tensor checkpoint resumes under FSDP too (each rank keeps its shard of the whole tensors).

Atomicity: a checkpoint is written into a temporary sibling directory, every file is fsynced, then the
directory is renamed into place (`os.replace`) and the parent directory fsynced; only then is ``latest``
replaced, itself through a fsynced temporary file. A crash at any point leaves the previous checkpoint
and the previous ``latest`` untouched; a leftover temporary directory is ignored and removed by the
next save. With several ranks, rank 0 creates the temporary directory and broadcasts its name; every rank
writes, fsyncs and hashes its own files; the ranks gather their digests (and any failure, so that none waits
for ever); rank 0 then writes state.json and the manifest, and commits; the others learn the outcome from it.

Checksums: manifest.json, written last, lists every file a resume reads, state.json included, with its size
and SHA-256 digest. Loading verifies it (`checkpoint_problem`: a torn write, bytes damaged after the fact, an
edited state.json, a missing shard) and falls back to the newest complete checkpoint when ``latest`` points at
a missing or damaged one. Checkpoints written before manifest.json existed carry their manifest inside
state.json, which it does not cover; they still load, verified as they were then. Only the newest ``keep``
checkpoints are kept.

Write faults: a full disk, a read-only file system or a directory the run may not write surface from safetensors,
torch.save and DCP in many guises (C++ stream errors such as "unexpected pos", errno 30, messages with an
"os error"). Every write here turns them into one `CheckpointWriteError` whose message names the path and the cause,
after the temporary directory is removed; the previous checkpoint and ``latest`` stay as they were.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

__all__ = [
    "Checkpoint",
    "CheckpointWriteError",
    "checkpoint_problem",
    "complete_checkpoints",
    "damaged_checkpoints",
    "find_latest",
    "is_sharded",
    "load_checkpoint",
    "load_sharded_tensors",
    "read_state",
    "restore_rng",
    "rng_file",
    "rng_state",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "set_rng_state",
    "sharded_keys",
    "write_error",
    "write_text_atomic",
    "writing",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = "shards"
LATEST_FILE = "latest"

_WRITE_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
_NEARLY_FULL_BYTES = 1 << 20
"""Free space under which a write that failed without an errno is put down to a full disk (1% of a smaller disk)."""


class CheckpointWriteError(OSError):
    """A checkpoint (or another file of the run) could not be written; what was on disk before is untouched.

    The message is one line naming the path and the cause: "no space left on device", "read-only file system",
    "permission denied", "disk quota exceeded", or the underlying error's own message. ``errno`` is the cause's
    error number where one is known.
    """

    def __init__(self, path: str | os.PathLike, cause: str, code: int | None = None) -> None:
        super().__init__(f"could not write {path}: {cause}")
        self.errno = code
        self.path = Path(path)
        """The file or checkpoint directory that was not written."""
        self.cause = cause
        """Why, in a few words."""

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across ranks: the constructor takes the parts, not the message
        return type(self), (self.path, self.cause, self.errno)


def _nested_errors(err: BaseException) -> Iterator[BaseException]:
    """`err`, what it was raised from or during, and the per-rank errors a DCP CheckpointException carries."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, Mapping):  # rank -> (exception, its stack)
            pending.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _file_system_cause(directory: Path) -> tuple[str, int] | None:
    """A read-only or (nearly) full file system holding `directory`, as a cause, or None."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return _WRITE_CAUSES[errno.EROFS], errno.EROFS
    if fs.f_bavail * fs.f_frsize < min(_NEARLY_FULL_BYTES, fs.f_blocks * fs.f_frsize // 100):
        return _WRITE_CAUSES[errno.ENOSPC], errno.ENOSPC
    return None


def write_error(
    path: str | os.PathLike, err: BaseException, directory: str | os.PathLike | None = None
) -> CheckpointWriteError:
    """`err`, raised while writing `path`, as a `CheckpointWriteError` that names the path and the cause.

    The cause is an errno among the errors `err` carries (or its text, as safetensors reports "os error 28"); else,
    when none carries an errno (torch.save's C++ stream errors name no cause), the file system's state (read-only,
    or no space left); else `err`'s own message on one line.

    Args:
        path: What was being written (named in the message).
        err: The error the write raised.
        directory: Where the bytes went (a checkpoint's temporary directory), for the file system's state; None:
            `path`'s directory. Call this before removing partial files: they hold the space that ran out.
    """
    errors = list(_nested_errors(err))
    for error in errors:
        if isinstance(error, OSError) and error.errno in _WRITE_CAUSES:
            return CheckpointWriteError(path, _WRITE_CAUSES[error.errno], error.errno)
    for error in errors:
        text = str(error).lower()
        for code, cause in _WRITE_CAUSES.items():
            if os.strerror(code).lower() in text:
                return CheckpointWriteError(path, cause, code)
    # an errno other than those is the cause as it stands; the file system's state only explains errors without one
    if not any(isinstance(error, OSError) and error.errno is not None for error in errors):
        found = _file_system_cause(Path(directory) if directory is not None else Path(path).parent)
        if found is not None:
            return CheckpointWriteError(path, *found)
    # DCP's wrapper prints every rank's stack: its first rank's error says it in one line
    shown = errors[1] if isinstance(getattr(err, "failures", None), Mapping) and len(errors) > 1 else err
    detail = " ".join(str(shown).split())[:300] or type(shown).__name__
    return CheckpointWriteError(path, detail, getattr(shown, "errno", None))


@contextlib.contextmanager
def writing(path: str | os.PathLike, directory: str | os.PathLike | None = None) -> Iterator[None]:
    """Around a write of `path`: an OSError, RuntimeError (torch.save's C++ stream errors), SafetensorError or DCP
    CheckpointException becomes a `CheckpointWriteError` (see `write_error`); others pass unchanged."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except (OSError, RuntimeError, SafetensorError) as err:
        raise write_error(path, err, directory) from err
    except BaseException as err:
        if type(err).__name__ != "CheckpointException":  # DCP's, a BaseException; torch.distributed stays unimported
            raise
        raise write_error(path, err, directory) from err


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


def _save_rng(path: Path, state: Mapping[str, Any]) -> None:
    """`state` (an `rng_state`) as a fsynced safetensors file: generator states as tensors, Python's and NumPy's
    as JSON in the metadata."""
    tensors = {"torch": state["torch"]}
    for i, cuda_state in enumerate(state.get("cuda", [])):
        tensors[f"cuda_{i}"] = cuda_state
    metadata = {"python": json.dumps(state["python"]), "numpy": json.dumps(state["numpy"])}
    save_file(tensors, str(path), metadata=metadata)
    _fsync_file(path)


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


def _entry(path: Path) -> dict[str, Any]:
    """A manifest entry: the file's size and SHA-256 digest."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` through a fsynced temporary file: a crash leaves the old or the new text.

    Raises:
        CheckpointWriteError: it could not be written (the old text, if any, is left).
    """
    with writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with writing(path):  # classified while the partial file still holds the space that ran out
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(text)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from the run's other readers
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        _fsync_dir(path.parent)


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint after `step` steps."""
    return f"step_{step:06d}"


def _new_tmp_dir(root: Path, final: Path) -> Path:
    """A fresh temporary directory for the checkpoint `final`, after removing any an earlier crash left."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))


def _commit(
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
        before_commit: Test hook, see `save_checkpoint`.
    """
    _write_json(tmp / STATE_FILE, payload)
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p != tmp / MANIFEST_FILE)
    manifest = {"files": {name: dict(known[name]) if name in known else _entry(tmp / name) for name in files}}
    _write_json(tmp / MANIFEST_FILE, manifest)
    for directory in sorted({(tmp / name).parent for name in files}):  # the entries of renamed-in files
        _fsync_dir(directory)
    if before_commit is not None:
        before_commit(tmp)
    tmp.chmod(0o755)
    if final.exists():  # a re-run of the same step (resumed run): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    write_text_atomic(final.parent / LATEST_FILE, final.name + "\n")
    for old in _step_dirs(final.parent)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


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
    root = Path(root)
    final = root / step_dir_name(step)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in weights.items()}
    with writing(final, root):
        tmp = _new_tmp_dir(root, final)
    try:
        with writing(final, tmp):  # classified before the partial files that filled the disk are removed
            save_file(tensors, str(tmp / "weights.safetensors"))
            _fsync_file(tmp / "weights.safetensors")
            torch.save(dict(optimizer), tmp / "optimizer.pt")
            _fsync_file(tmp / "optimizer.pt")
            for rank, states in enumerate(rng if rng is not None else [rng_state()]):
                _save_rng(tmp / rng_file(rank), states)
            _commit(tmp, final, {"step": step, **dict(state)}, {}, keep, _before_commit)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _grouped() -> bool:
    """Whether a process group exists (DCP then coordinates the ranks; without one it reads and writes alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _dcp_alone() -> Iterator[None]:
    """Around DCP's save or load: without a process group it works alone, as meant here; its warning that it
    assumes so says nothing to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _grouped() else 0


def save_sharded_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    tensors: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 3,
    _before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write one sharded checkpoint with torch.distributed.checkpoint: a collective, every rank calls it.

    Each rank writes its own chunks of `tensors` (DTensor shards; a replicated plain tensor once, on one rank)
    and its own RNG states; rank 0 writes state.json and the manifest and commits, as `save_checkpoint` does.

    Args:
        root: The checkpoints directory (created if missing).
        step: Steps done; names the directory.
        tensors: This rank's state dict for DCP: nested dicts of DTensors and tensors, the same keys on every rank.
        state: JSON-serialisable state, rank 0's written (the other ranks' is not read).
        keep: Keep this many newest checkpoints (at least 1).
        _before_commit: Test hook, see `save_checkpoint` (rank 0 calls it).

    Returns:
        The checkpoint's directory (on every rank, once rank 0 has committed it).

    Raises:
        CheckpointWriteError: on every rank, when any rank failed to write its files or rank 0 to commit them; the
            message names each failing rank's cause.
        RuntimeError: on every rank, when a rank failed otherwise (a fault of the program, not of the disk).
    """
    import torch.distributed.checkpoint as dcp

    from algos import distributed

    root = Path(root)
    rank = _rank()
    final = root / step_dir_name(step)
    if rank == 0:
        with writing(final, root):
            made = str(_new_tmp_dir(root, final))
    tmp = Path(distributed.broadcast_object(made if rank == 0 else None))
    failure, written = None, {}
    try:
        with writing(final, tmp):  # classified before the partial files that filled the disk are removed
            writer = dcp.FileSystemWriter(tmp / SHARDS_DIR, sync_files=True)
            with _dcp_alone():
                dcp.save(dict(tensors), storage_writer=writer, no_dist=not _grouped())
            _save_rng(tmp / rng_file(rank), rng_state())
            # this rank's files (DCP names them by rank), hashed here: the ranks share the hashing of the shards
            # (rank 0 hashes whatever no rank reported)
            mine = [tmp / rng_file(rank), *(tmp / SHARDS_DIR).glob(f"__{rank}_*.distcp")]
            written = {p.relative_to(tmp).as_posix(): _entry(p) for p in mine}
    # every rank must hear of a failure (as cause, errno, whether a write fault): the others would wait in the next
    # collective for ever
    except CheckpointWriteError as err:
        failure = (err.cause if not _grouped() else f"rank {rank}: {err.cause}", err.errno, True)
    except Exception as err:
        failure = (f"rank {rank}: {type(err).__name__}: {' '.join(str(err).split())[:300]}", None, False)
    reports = distributed.gather_objects((failure, written))
    failures = [f for f, _ in reports if f is not None]
    if rank != 0:
        outcome = distributed.broadcast_object(None)
        if outcome:
            raise _sharded_failure(final, outcome)
        return final
    outcome: tuple[str, int | None, bool] | None = ("rank 0 stopped before committing it", None, False)
    try:
        if failures:
            outcome = (
                "; ".join(cause for cause, _, _ in failures),
                next((code for _, code, _ in failures if code is not None), None),
                all(write for _, _, write in failures),
            )
            raise _sharded_failure(final, outcome)
        known = {name: entry for _, part in reports for name, entry in part.items()}
        with writing(final, tmp):
            _commit(tmp, final, {"step": step, **dict(state)}, known, keep, _before_commit)
        outcome = None
    except CheckpointWriteError as err:
        outcome = (err.cause, err.errno, True)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        distributed.broadcast_object(outcome)
    return final


def _sharded_failure(final: Path, outcome: tuple[str, int | None, bool]) -> Exception:
    """The error every rank raises for a sharded checkpoint that was not written: a `CheckpointWriteError` when every
    failing rank's was a write fault, else a RuntimeError (a fault of the program, whose traceback matters)."""
    cause, code, write = outcome
    if write:
        return CheckpointWriteError(final, cause, code)
    return RuntimeError(f"checkpoint {final} was not written: {cause}")


def _step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


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


def sharded_keys(path: str | os.PathLike) -> set[str]:
    """The flattened keys a sharded checkpoint holds (``model.<name>``, ``optimizer.<fqn>.exp_avg``, ...)."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(Path(path) / SHARDS_DIR).read_metadata().state_dict_metadata)


def load_sharded_tensors(path: str | os.PathLike, tensors: dict[str, Any]) -> None:
    """Fill `tensors` in place from sharded checkpoint `path`: a collective when a process group exists.

    `tensors` is a nested dict shaped like (part of) what `save_sharded_checkpoint` saved, its tensors allocated
    where they belong: DTensors read just their shard, plain tensors the whole tensor, whatever the number of ranks
    that wrote it. The caller verifies the checkpoint first (`checkpoint_problem`).
    """
    import torch.distributed.checkpoint as dcp

    with _dcp_alone():
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(Path(path) / SHARDS_DIR), no_dist=not _grouped())
