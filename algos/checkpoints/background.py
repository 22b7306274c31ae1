"""Checkpoint writes beside the training loop: one write at a time, on a thread of its own.

The loop takes a snapshot (`algos.checkpoints.store.snapshot_checkpoint`: the tensors copied to the CPU, the state
serialised; under FSDP every rank its own shards, `algos.checkpoints.sharded.snapshot_sharded_checkpoint`) and hands
its write to `BackgroundWriter.submit`; the next steps run while the files are written, hashed
into the manifest and renamed into place. The write is the same atomic one as a synchronous save, so a kill at any
moment of it leaves the previous checkpoint and ``latest`` whole (tested by killing a process mid-write).

The loop waits only where it must: before the next snapshot (one write at a time bounds the host memory the copies
take), before it reads the checkpoints (the final model's selection, a stop by a signal) and at its end.
A failed write raises its `CheckpointWriteError` at the loop's next `BackgroundWriter.check` or `wait`. The thread is
not a daemon, so a process that ends on an error still finishes the write under way first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Runs one checkpoint write at a time on a thread beside the caller.

    writer = BackgroundWriter()
    writer.submit(snapshot_checkpoint(root, step, weights=..., optimizer=..., state=...))
    ...                        # the next steps
    writer.wait()              # the checkpoint is on disk (or its write error is raised here)
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._written: Path | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """Whether a write is under way."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], Path]) -> None:
        """Start `write` (which returns the checkpoint's directory) on the writer's thread, after waiting for the
        write before it (whose error, if it failed, is raised here instead)."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer")
        self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        try:
            self._written = write()
        except BaseException as err:  # raised in the caller's thread by `wait` or `check`
            self._error = err

    def check(self) -> None:
        """Raise the error of a write that has failed, without waiting for one under way."""
        if not self.busy:
            self.wait()

    def wait(self) -> Path | None:
        """Wait for the write under way, if any; return the directory of the last one written.

        Raises:
            CheckpointWriteError: that write failed (the previous checkpoint and ``latest`` are as they were).
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._written
