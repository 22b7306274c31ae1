"""Files written whole or not at all, and output paths checked before any work: what every layer's writers and
command lines share (the lowest layer, so that the retrievers, the env, the agents and the trainers use one copy).

    with atomic_file("out/cache.jsonl") as tmp:   # write tmp; it replaces out/cache.jsonl when the block ends
        tmp.write_text(text)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

__all__ = ["OneLineParser", "atomic_file", "output_problem"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``error: ...``, with exit status 2 and no usage text: the
    form every command line of the project refuses bad input in."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def output_problem(flag: str, path: str | os.PathLike, *, directory: bool = False) -> str | None:
    """Why the command cannot write its output (a file, or a directory with `directory`) at `path`, or None.

    Creates the missing parent directories, as writing would, and opens a temporary file among them, so that a parent
    that is a file, a read-only file system or a directory without write permission is told before any work starts.
    """
    path = Path(path)
    if not directory and path.is_dir():
        return f"{flag} {path}: is a directory; give a file name"
    if directory and path.exists() and not path.is_dir():
        return f"{flag} {path}: is a file, not a directory"
    above = next(parent for parent in path.absolute().parents if parent.exists())
    if not above.is_dir():
        return f"{flag} {path}: {above} is a file, not a directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        return f"{flag} {path}: cannot write in {path.parent} ({err.strerror or err})"
    if not directory and path.exists() and not os.access(path, os.W_OK):
        return f"{flag} {path}: the file is not writable"
    return None


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path`, ending in its name (so its suffix still says the format), that replaces `path`
    when the block ends and is removed when the block raises: a failed write leaves no partial file behind.

    The parent directories are made. The file is fsynced before the rename. A `path` that is a link, or exists and
    is not a regular file (a device, a pipe), is yielded as it is, to be written directly.
    """
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".partial-{os.getpid()}-{threading.get_ident()}-{path.name}")
    try:
        yield tmp
        with open(tmp, "rb") as written:  # on disk before the name points at it: a crash leaves old or new
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
