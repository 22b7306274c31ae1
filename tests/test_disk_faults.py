"""A full disk and a read-only run directory: a checkpoint write (whole tensors or sharded), ``latest`` and a run's
end through ``main`` fail with one `CheckpointWriteError` line naming the path and the cause, and the last good
checkpoint stays the one ``latest`` names, loadable, with no temporary directory left behind.

Where the test process may mount (root), each fault is real: a small tmpfs that fills up during the write, or one
remounted read-only. Elsewhere the same assertions run against the error the write would raise, raised from inside
it; the "simulated" cases do so everywhere, so both paths are covered where mounting works."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from algos.checkpoints import store as checkpoint
from algos.checkpoints.atomic import CheckpointWriteError, write_text_atomic
from algos.checkpoints.files import LATEST_FILE
from algos.checkpoints.sharded import load_sharded_tensors, save_sharded_checkpoint
from algos.checkpoints.store import find_latest, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
FULL = "no space left on device"
READ_ONLY = "read-only file system"
BIG = 300_000
"""Floats in a tensor that overflows the 1 MiB disk (1.2 MB); the first checkpoint's are a few KB."""


@dataclass
class Disk:
    """A directory on a small file system of its own (`real`), or an ordinary one where mounting is not allowed."""

    root: Path
    real: bool

    def make_read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.root)], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _small_disk(directory: Path, size: str, real: bool) -> Iterator[Disk]:
    """`directory` as a tmpfs of `size` when `real` and mounting works (it is unmounted afterwards), else as is."""
    directory.mkdir(parents=True)
    mounted = False
    if real:
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, timeout=30
            )
            mounted = done.returncode == 0
        except (OSError, subprocess.SubprocessError):  # no mount command, or not allowed to: simulate the fault
            mounted = False
    try:
        yield Disk(directory, mounted)
    finally:
        if mounted and subprocess.run(["umount", str(directory)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


@pytest.fixture(params=["real", "simulated"])
def disk(request, tmp_path) -> Iterator[Disk]:
    """A 1 MiB disk ("real": a tmpfs where the test may mount, else the fault is simulated)."""
    with _small_disk(tmp_path / "disk", "1m", real=request.param == "real") as made:
        yield made


def _weights(step: int, size: int = 12) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size,), float(step))}


def _optimizer(step: int, size: int = 12) -> dict:
    return {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(size) * step}}, "param_groups": []}


def _save(root: Path, step: int, weights_size: int = 12, optimizer_size: int = 12) -> Path:
    weights, optimizer = _weights(step, weights_size), _optimizer(step, optimizer_size)
    return save_checkpoint(root, step, weights=weights, optimizer=optimizer, state={"collector": {"position": step}})


def _save_sharded(root: Path, step: int, size: int = 12) -> Path:
    tensors = {"model": {"w": torch.full((size,), float(step))}}
    return save_sharded_checkpoint(root, step, tensors=tensors, state={"collector": {"position": step}})


def _raise_from_write(monkeypatch, target: object, name: str, code: int) -> None:
    """Make `target.name` (a writer) leave a partial file, as a write into a full disk does, then raise errno `code`."""

    def failing(*args, **kwargs):
        path = next((a for a in args if isinstance(a, str | Path) and str(a).endswith((".safetensors", ".pt"))), None)
        if path is not None:
            Path(path).write_bytes(b"\0" * 100)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(target, name, failing)


def _assert_refused(err: CheckpointWriteError, path: Path, cause: str, code: int) -> None:
    message = str(err)
    assert "\n" not in message
    assert str(path) in message and cause in message, message
    assert err.errno == code


def _assert_kept(root: Path, good: Path) -> None:
    """`good` is still the checkpoint ``latest`` names, complete and loadable; no temporary directory is left."""
    assert (root / LATEST_FILE).read_text().strip() == good.name
    assert find_latest(root) == good
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("overflowing", ["weights", "optimizer"])
def test_a_full_disk_names_the_checkpoint_and_keeps_the_last_good_one(disk, overflowing, monkeypatch):
    root = disk.root / "checkpoints"
    good = _save(root, 1)
    if not disk.real and overflowing == "weights":  # safetensors reports the errno
        _raise_from_write(monkeypatch, checkpoint, "save_file", errno.ENOSPC)
    elif not disk.real:  # torch.save's C++ stream error names no cause: the file system's free space tells it
        monkeypatch.setattr(torch, "save", _cxx_stream_error)
        real_statvfs = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda path: _no_space_left(real_statvfs(path)))
    sizes = {"weights_size": BIG} if overflowing == "weights" else {"optimizer_size": BIG}
    with pytest.raises(CheckpointWriteError) as caught:
        _save(root, 2, **sizes)
    _assert_refused(caught.value, root / "step_000002", FULL, errno.ENOSPC)
    _assert_kept(root, good)
    assert torch.equal(load_checkpoint(good).weights["w"], _weights(1)["w"])


def _cxx_stream_error(obj: object, path: object, *args, **kwargs) -> None:
    """What torch.save raises when the disk fills under it."""
    Path(path).write_bytes(b"\0" * 100)
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _no_space_left(real: os.statvfs_result) -> os.statvfs_result:
    fields = list(real)
    fields[4] = fields[3] = 0  # f_bfree, f_bavail
    return os.statvfs_result(fields)


def test_a_read_only_disk_names_the_checkpoint_and_keeps_the_last_good_one(disk, monkeypatch):
    root = disk.root / "checkpoints"
    good = _save(root, 1)
    if disk.real:
        disk.make_read_only()
    else:
        _raise_from_write(monkeypatch, checkpoint, "save_file", errno.EROFS)
    with pytest.raises(CheckpointWriteError) as caught:
        _save(root, 2)
    _assert_refused(caught.value, root / "step_000002", READ_ONLY, errno.EROFS)
    _assert_kept(root, good)
    assert load_checkpoint(good).step == 1


@pytest.mark.parametrize(
    ("code", "cause"), [(errno.EACCES, "permission denied"), (errno.EIO, "[Errno 5] Input/output error")]
)
def test_other_faults_name_their_cause_in_one_line(code, cause, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    good = _save(root, 1)
    _raise_from_write(monkeypatch, checkpoint, "save_file", code)
    with pytest.raises(CheckpointWriteError) as caught:
        _save(root, 2)
    _assert_refused(caught.value, root / "step_000002", cause, code)
    _assert_kept(root, good)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_sharded_checkpoint_fails_the_same_way(disk, fault, monkeypatch):
    import torch.distributed.checkpoint as dcp

    root = disk.root / "checkpoints"
    good = _save_sharded(root, 1)
    code = errno.ENOSPC if fault == "full" else errno.EROFS
    if not disk.real:
        _raise_from_write(monkeypatch, dcp, "save", code)
    elif fault == "read-only":
        disk.make_read_only()
    with pytest.raises(CheckpointWriteError) as caught:
        _save_sharded(root, 2, size=BIG)
    _assert_refused(caught.value, root / "step_000002", FULL if fault == "full" else READ_ONLY, code)
    _assert_kept(root, good)
    loaded = {"model": {"w": torch.zeros(12)}}
    load_sharded_tensors(good, loaded)
    assert torch.equal(loaded["model"]["w"], torch.full((12,), 1.0))


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_write_text_atomic_keeps_the_old_text(disk, fault, monkeypatch):
    path = disk.root / "eval.json"
    write_text_atomic(path, "old")
    code = errno.ENOSPC if fault == "full" else errno.EROFS
    if not disk.real:
        _raise_from_write(monkeypatch, os, "fsync", code)
    elif fault == "read-only":
        disk.make_read_only()
    with pytest.raises(CheckpointWriteError) as caught:
        write_text_atomic(path, "new" * 1_000_000)
    _assert_refused(caught.value, path, FULL if fault == "full" else READ_ONLY, code)
    assert path.read_text() == "old"
    assert [p.name for p in disk.root.iterdir()] == ["eval.json"]


# --- through main -------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--eval-questions", "0", "--corpus", "distractor", "--no-memory-check"]
"""The tiny preset checkpoints every step, keeping two: each about 39 MB (weights 13 MB, then optimizer 26 MB); its
final model is about 16 MB (weights 13 MB, then the tokenizer). The start-of-run disk check would refuse these runs
(`algos.run.disk`, tested in test_run_disk.py); here the write that runs out of room is what is tested."""
SIZED = {
    # 60 MiB: the first checkpoint fits, the second runs out of room in its optimizer.pt (torch.save's C++ error)
    "checkpoint": ("60m", ["--steps", "3"], "checkpoints/step_000002"),
    # 45 MiB: the one checkpoint fits, the final model's weights do not (safetensors' error)
    "final model": ("45m", ["--steps", "1"], "final"),
}


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    return lines[0]


@pytest.mark.parametrize("failing", list(SIZED))
@pytest.mark.parametrize("real", [True, False], ids=["real", "simulated"])
def test_main_stops_with_one_line_naming_the_cause_and_the_checkpoint_to_resume(
    real, failing, tmp_path, monkeypatch, capsys
):
    size, steps, unwritten = SIZED[failing]
    with _small_disk(tmp_path / "disk", size, real=real) as small:
        run = small.root / "run"
        if small.real:
            command = [sys.executable, "-m", "algos.red_grpo", *TINY, *steps, "--run-dir", str(run)]
            done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
            status, err = done.returncode, done.stderr
        else:
            from algos import red_grpo
            from algos.run import outputs

            real_save_file = checkpoint.save_file

            def fills_up(tensors, path, *args, **kwargs):
                if Path(path).parent.name.startswith(".tmp-step_000002"):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_save_file(tensors, path, *args, **kwargs)

            monkeypatch.setattr(checkpoint, "save_file", fills_up)
            _raise_from_write(monkeypatch, outputs, "describe_final_model", errno.ENOSPC)
            with pytest.raises(SystemExit) as stopped:
                red_grpo.main([*TINY, *steps, "--run-dir", str(run)])
            status, err = stopped.value.code, capsys.readouterr().err
        line = _one_error_line(err)
        good = run / "checkpoints" / "step_000001"
        assert status == 1
        assert f"could not write {run / unwritten}: {FULL}" in line, line
        assert f"the last good checkpoint is {good}" in line and "--resume" in line, line
        _assert_kept(run / "checkpoints", good)
        assert not (run / "final").exists() and not list(run.glob(".final-*"))
