"""Checkpoints written beside the steps: the write holds the state of the moment it was taken while the caller goes
on, a failed write raises in the caller, and a process killed mid-write leaves the previous checkpoint whole."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from algos.checkpoints.atomic import CheckpointWriteError
from algos.checkpoints.background import BackgroundWriter
from algos.checkpoints.store import (
    checkpoint_problem,
    find_latest,
    load_checkpoint,
    save_checkpoint,
    snapshot_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]


def _state(seed: int) -> tuple[dict[str, torch.Tensor], torch.optim.AdamW]:
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(64, 32))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    return {"w": weight}, optimizer


def test_the_write_holds_the_snapshot_while_the_caller_steps_on(tmp_path):
    """The write waits (a hook before its rename) while the caller changes the weights and AdamW state in place, as
    the next steps do; what lands on disk is the state when the snapshot was taken."""
    weights, optimizer = _state(0)
    taken = weights["w"].detach().clone()
    moment = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    reached, release = threading.Event(), threading.Event()

    def hold(tmp: Path) -> None:
        reached.set()
        assert release.wait(timeout=60)

    writer = BackgroundWriter()
    state = {"collector": {"position": 1}}
    writer.submit(
        snapshot_checkpoint(
            tmp_path, 1, weights=weights, optimizer=optimizer.state_dict(), state=state, _before_commit=hold
        )
    )
    assert reached.wait(timeout=60) and writer.busy
    state["collector"]["position"] = 99  # the caller's objects change after the snapshot
    weights["w"].sum().backward()
    optimizer.step()
    assert not torch.equal(weights["w"], taken)
    assert find_latest(tmp_path) is None  # nothing renamed into place yet
    release.set()
    assert writer.wait() == tmp_path / "step_000001"
    saved = load_checkpoint(tmp_path / "step_000001")
    assert torch.equal(saved.weights["w"], taken)
    for key, value in moment.items():
        assert torch.equal(saved.optimizer["state"][0][key], value)
    assert saved.state["collector"] == {"position": 1}


def test_a_failed_write_raises_in_the_caller_and_keeps_the_last_checkpoint(tmp_path):
    weights, optimizer = _state(0)
    save_checkpoint(tmp_path, 1, weights=weights, optimizer=optimizer.state_dict(), state={})

    def full(tmp: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer = BackgroundWriter()
    writer.submit(
        snapshot_checkpoint(
            tmp_path, 2, weights=weights, optimizer=optimizer.state_dict(), state={}, _before_commit=full
        )
    )
    with pytest.raises(CheckpointWriteError, match="step_000002: no space left on device"):
        writer.wait()
    assert find_latest(tmp_path) == tmp_path / "step_000001" and checkpoint_problem(tmp_path / "step_000001") is None
    assert not list(tmp_path.glob(".tmp-*"))
    writer.check()  # raised once: the writer is free for the next write
    assert not writer.busy


KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from algos.checkpoints.background import BackgroundWriter
from algos.checkpoints.store import save_checkpoint, snapshot_checkpoint

root, marker = Path(sys.argv[1]), Path(sys.argv[2])
weights = {"w": torch.arange(4096, dtype=torch.float32)}
save_checkpoint(root, 1, weights=weights, optimizer={"state": {}, "param_groups": []}, state={"seen": 1})

def stall(tmp):  # every file of step 2 written and fsynced, the rename not yet done
    marker.write_text(str(tmp))
    time.sleep(600)

writer = BackgroundWriter()
weights["w"] = weights["w"] * 2
writer.submit(snapshot_checkpoint(root, 2, weights=weights, optimizer={"state": {}, "param_groups": []},
              state={"seen": 2}, _before_commit=stall))
weights["w"].add_(1.0)  # the next step goes on
writer.wait()
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    root, marker = tmp_path / "checkpoints", tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root), str(marker)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120  # a bound on the wait, not a measurement
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer never reached its write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert Path(marker.read_text()).is_dir()  # the killed write's temporary directory, left behind
    assert find_latest(root) == root / "step_000001" and not (root / "step_000002").exists()
    assert checkpoint_problem(root / "step_000001") is None
    kept = load_checkpoint(root / "step_000001")
    assert torch.equal(kept.weights["w"], torch.arange(4096, dtype=torch.float32)) and kept.state["seen"] == 1
    save_checkpoint(root, 3, weights=kept.weights, optimizer=kept.optimizer, state={})
    assert not list(root.glob(".tmp-*"))  # the next save removes what the killed one left


def _sharded_rank(rank: int, init: str, root: str) -> None:
    """One of two gloo ranks: a sharded checkpoint taken, the live shards changed and collectives run on the default
    group while the write goes on beside them on the side group, then read back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from algos import distributed
    from algos.checkpoints.sharded import load_sharded_tensors, side_group, snapshot_sharded_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(48.0).reshape(8, 6)
        tensors = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)}}
        group = side_group()
        write = snapshot_sharded_checkpoint(root, 1, tensors=tensors, state={"note": "step 1"}, group=group)
        tensors["model"]["w"].to_local().mul_(0.0)  # the next step changes the live shards (before the write starts)
        tensors["model"]["b"].add_(1.0)
        writer = BackgroundWriter()
        writer.submit(write)
        for _ in range(20):  # and runs its own collectives on the default group while the write goes on
            assert distributed.all_sum(1.0)[0] == 2.0
        path = writer.wait()
        assert path == Path(root) / "step_000001" and checkpoint_problem(path) is None
        back = {"model": {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "b": torch.zeros(3)}}
        load_sharded_tensors(path, back)
        assert torch.equal(back["model"]["w"].full_tensor(), full)  # the moment it was taken
        assert torch.equal(back["model"]["b"], torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_is_written_beside_the_steps_from_its_copy(tmp_path):
    """Two gloo ranks (`_sharded_rank`): each writes its own shards on its writer thread, from the copy taken before
    the next step changed them, its collectives apart from the loop's."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_sharded_rank, args=(init, str(tmp_path / "checkpoints")), nprocs=2, start_method="spawn")
    written = {
        p.relative_to(tmp_path / "checkpoints" / "step_000001").as_posix()
        for p in (tmp_path / "checkpoints" / "step_000001").rglob("*")
        if p.is_file()
    }
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "rng.safetensors", "rng_rank1.safetensors"} <= written
