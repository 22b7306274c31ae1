"""Sharded checkpoints under FSDP: each rank writes its own shards with torch.distributed.checkpoint (DCP).

With several ranks under ``--fsdp`` (`save_sharded_checkpoint`) each rank writes its own shard of the weights and
of the optimizer state in place of weights.safetensors and optimizer.pt, so no rank ever holds the whole state:

    step_000050/
        shards/.metadata       DCP's index: each tensor's global shape and the file and offset of each chunk
        shards/__0_0.distcp    rank 0's chunks (weights, AdamW moments, weight average; replicated tensors such as
        shards/__1_0.distcp    a value head once, on one rank), rank 1's, ...
        rng.safetensors, rng_rank1.safetensors, ...   each rank's RNG states, written by that rank
        state.json             as in `algos.checkpoints.store`, plus the optimizer's parameter groups (by FQN)
        manifest.json          every file, the shards and DCP's .metadata included

DCP reshards on load (`load_sharded_tensors`), so a sharded checkpoint resumes with any number of ranks or in one
process. Rank 0 creates the temporary directory and broadcasts its name; every rank writes, fsyncs and hashes its
own files; the ranks gather their digests (and any failure, so that none waits for ever); rank 0 then writes
state.json and the manifest, and commits (`algos.checkpoints.files.commit`); the others learn the outcome from it.

Beside the steps (`snapshot_sharded_checkpoint`): every rank copies its shards to host memory in the loop, then
writes, hashes and commits them on a thread while the next steps run, its collectives on a gloo group of their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from algos.checkpoints.atomic import CheckpointWriteError, file_entry, writing
from algos.checkpoints.files import SHARDS_DIR, commit, new_tmp_dir, rng_file, rng_state, save_rng, step_dir_name

__all__ = ["load_sharded_tensors", "save_sharded_checkpoint", "sharded_keys", "snapshot_sharded_checkpoint"]


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


def side_group() -> Any:
    """A new gloo process group of every rank, for collectives that a thread runs beside the training loop's (a
    checkpoint written in the background): two threads' collectives on one group could pair up wrongly. A collective
    itself: every rank calls it, at the same point. None without a process group."""
    import torch.distributed as dist

    if not _grouped() or dist.get_world_size() < 2:
        return None
    return dist.new_group(backend="gloo")


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
    and its own RNG states; rank 0 writes state.json and the manifest and commits, as
    `algos.checkpoints.store.save_checkpoint` does.

    Args:
        root: The checkpoints directory (created if missing).
        step: Steps done; names the directory.
        tensors: This rank's state dict for DCP: nested dicts of DTensors and tensors, the same keys on every rank.
        state: JSON-serialisable state, rank 0's written (the other ranks' is not read).
        keep: Keep this many newest checkpoints (at least 1).
        _before_commit: Test hook, see `algos.checkpoints.store.save_checkpoint` (rank 0 calls it).

    Returns:
        The checkpoint's directory (on every rank, once rank 0 has committed it).

    Raises:
        CheckpointWriteError: on every rank, when any rank failed to write its files or rank 0 to commit them; the
            message names each failing rank's cause.
        RuntimeError: on every rank, when a rank failed otherwise (a fault of the program, not of the disk).
    """
    import torch.distributed.checkpoint as dcp

    rank, final, tmp = _begin(Path(root), step)

    def save(writer: Any) -> None:
        with _dcp_alone():
            dcp.save(dict(tensors), storage_writer=writer, no_dist=not _grouped())

    report = _write_own_shards(tmp, final, rank, rng_state(), save)
    return _settle(tmp, final, step, state, keep, rank, report, None, _before_commit)


def snapshot_sharded_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    tensors: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 3,
    group: Any = None,
) -> Callable[[], Path]:
    """`save_sharded_checkpoint` split at the copy, for a write beside the next steps: a collective, every rank calls
    it, then every rank runs the returned write (on a thread: `algos.checkpoints.background.BackgroundWriter`).

    Here each rank copies its shards of `tensors` to host memory (DCP's default stager, as its ``async_save`` does)
    and takes its RNG states, so the steps that follow may change the live tensors; the write saves the copies with
    DCP, hashes and commits as `save_sharded_checkpoint` does, its collectives over `group`
    (`side_group`: a gloo group of its own, so that they never pair up with the training loop's on
    the default group). The copies cost this rank's shards once more in host memory until the write ends.

    Raises:
        RuntimeError: on every rank, here, when a rank could not copy its shards (nothing is written).
    """
    from algos import distributed

    rank, final, tmp = _begin(Path(root), step)
    rng = rng_state()
    copies, problem = None, None
    try:
        copies = _host_copy(tensors)
    except Exception as err:  # a host out of memory, most likely: every rank must hear of it before any writes
        problem = f"rank {rank}: copying its shards to host memory failed: {type(err).__name__}: {err}"
    problems = [p for p in distributed.gather_objects(problem) if p]
    if problems:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"checkpoint {final} was not written: {'; '.join(problems)}")

    def write() -> Path:
        import torch.distributed.checkpoint as dcp

        def save(writer: Any) -> None:
            # with a process group DCP says nothing to silence, and a thread must not swap the warning filters
            with contextlib.nullcontext() if _grouped() else _dcp_alone():
                dcp.save(copies, storage_writer=writer, process_group=group, no_dist=not _grouped())

        report = _write_own_shards(tmp, final, rank, rng, save)
        return _settle(tmp, final, step, state, keep, rank, report, group, None)

    return write


def _host_copy(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a DCP state dict in host memory (DTensors stay DTensors, their local shards copied)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))  # a blocking, plain copy
    try:
        return stager.stage(dict(tensors))
    finally:
        stager.close()


def _begin(root: Path, step: int) -> tuple[int, Path, Path]:
    """This rank, the checkpoint's final directory and the temporary one rank 0 made for it (broadcast)."""
    from algos import distributed

    rank = _rank()
    final = root / step_dir_name(step)
    made = None
    if rank == 0:
        with writing(final, root):
            made = str(new_tmp_dir(root, final))
    return rank, final, Path(distributed.broadcast_object(made))


_Report = tuple[tuple[str, int | None, bool] | None, dict[str, dict[str, Any]]]
"""A rank's part of a sharded write: None or its failure (cause, errno, whether a write fault), and the manifest
entries of the files it wrote."""


def _settle(
    tmp: Path,
    final: Path,
    step: int,
    state: Mapping[str, Any],
    keep: int,
    rank: int,
    report: _Report,
    group: Any,
    _before_commit: Callable[[Path], None] | None,
) -> Path:
    """Gather every rank's `report` (over `group`), commit on rank 0 or raise there, and tell the other ranks the
    outcome, which they raise too."""
    from algos import distributed

    reports = distributed.gather_objects(report, group)
    failures = [f for f, _ in reports if f is not None]
    if rank != 0:
        outcome = distributed.broadcast_object(None, group)
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
            commit(tmp, final, {"step": step, **dict(state)}, known, keep, _before_commit)
        outcome = None
    except CheckpointWriteError as err:
        outcome = (err.cause, err.errno, True)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        distributed.broadcast_object(outcome, group)
    return final


def _write_own_shards(tmp: Path, final: Path, rank: int, rng: dict[str, Any], save: Callable[[Any], None]) -> _Report:
    """This rank's part of a sharded write: its DCP chunks (`save` writes them with the writer it is given) and its
    RNG states `rng` in `tmp`, fsynced and hashed."""
    import torch.distributed.checkpoint as dcp

    failure, written = None, {}
    try:
        with writing(final, tmp):  # classified before the partial files that filled the disk are removed
            save(dcp.FileSystemWriter(tmp / SHARDS_DIR, sync_files=True))
            save_rng(tmp / rng_file(rank), rng)
            # this rank's files (DCP names them by rank), hashed here: the ranks share the hashing of the shards
            # (rank 0 hashes whatever no rank reported)
            mine = [tmp / rng_file(rank), *(tmp / SHARDS_DIR).glob(f"__{rank}_*.distcp")]
            written = {p.relative_to(tmp).as_posix(): file_entry(p) for p in mine}
    # every rank must hear of a failure (as cause, errno, whether a write fault): the others would wait in the next
    # collective for ever
    except CheckpointWriteError as err:
        failure = (err.cause if not _grouped() else f"rank {rank}: {err.cause}", err.errno, True)
    except Exception as err:
        failure = (f"rank {rank}: {type(err).__name__}: {' '.join(str(err).split())[:300]}", None, False)
    return failure, written


def _sharded_failure(final: Path, outcome: tuple[str, int | None, bool]) -> Exception:
    """The error every rank raises for a sharded checkpoint that was not written: a `CheckpointWriteError` when every
    failing rank's was a write fault, else a RuntimeError (a fault of the program, whose traceback matters)."""
    cause, code, write = outcome
    if write:
        return CheckpointWriteError(final, cause, code)
    return RuntimeError(f"checkpoint {final} was not written: {cause}")


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
