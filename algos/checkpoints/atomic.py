"""Files written so that a crash or a full disk leaves either the old version or the new one, never a torn one.

`write_text_atomic` replaces a file through a fsynced temporary file; the checkpoints (`algos.checkpoints.store`) rename
whole fsynced directories into place with the same helpers.

Write faults: a full disk, a read-only file system or a directory the run may not write surface from safetensors,
torch.save and DCP in many guises (C++ stream errors such as "unexpected pos", errno 30, messages with an
"os error"). Every write wrapped in `writing` turns them into one `CheckpointWriteError` whose message names the
path and the cause; the callers remove their temporary files, so what was on disk before stays as it was.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

__all__ = [
    "CheckpointWriteError",
    "file_entry",
    "fsync_dir",
    "fsync_file",
    "sha256",
    "write_error",
    "write_json",
    "write_text_atomic",
    "writing",
]

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


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest entry: the file's size and SHA-256 digest."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


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
        fsync_dir(path.parent)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
