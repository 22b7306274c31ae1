"""Checkpoints: atomic writes, crash safety (an exception mid-save, a SIGKILL mid-save), RNG restore, pruning."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from algos.checkpoint import checkpoint_problem, damaged_checkpoints, find_latest, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _save(root: Path, step: int, **kwargs) -> Path:
    weights = {"w": torch.full((4, 3), float(step)), "b": torch.arange(3.0) + step}
    optimizer = {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4, 3) * step}},
        "param_groups": [],
    }
    state = {"config": {"lr": 1e-6}, "weighting": {"h_rl": step / 10, "h_sft": None}, "collector": {"position": step}}
    return save_checkpoint(root, step, weights=weights, optimizer=optimizer, state=state, **kwargs)


def test_round_trip_restores_everything_and_the_rng(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = _save(tmp_path, 7)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)

    checkpoint = load_checkpoint(find_latest(tmp_path))
    assert checkpoint.path == path and checkpoint.step == 7
    assert torch.equal(checkpoint.weights["w"], torch.full((4, 3), 7.0))
    assert torch.equal(checkpoint.optimizer["state"][0]["exp_avg"], torch.ones(4, 3) * 7)
    assert checkpoint.state["weighting"] == {"h_rl": 0.7, "h_sft": None}
    assert checkpoint.state["collector"] == {"position": 7}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_keeps_only_the_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_000004", "step_000005"]
    assert (tmp_path / "latest").read_text().strip() == "step_000005"


def test_exception_mid_write_leaves_the_newest_good_checkpoint(tmp_path):
    _save(tmp_path, 1)

    def crash(tmp_dir: Path) -> None:
        # a torn write: half a weights file, then the process dies before the rename
        data = (tmp_dir / "weights.safetensors").read_bytes()
        (tmp_dir / "weights.safetensors").write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, _before_commit=crash)
    assert find_latest(tmp_path).name == "step_000001"
    assert torch.equal(load_checkpoint(find_latest(tmp_path)).weights["w"], torch.full((4, 3), 1.0))
    _save(tmp_path, 2)  # the next save succeeds and cleans up
    assert find_latest(tmp_path).name == "step_000002"
    assert not list(tmp_path.glob(".tmp-*"))


def test_damaged_or_missing_latest_falls_back(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step_000002" / "optimizer.pt").write_bytes(b"torn")  # damaged after the fact
    assert find_latest(tmp_path).name == "step_000001"
    (tmp_path / "latest").write_text("step_000009\n")  # names a checkpoint that is not there
    assert find_latest(tmp_path).name == "step_000001"
    (tmp_path / "latest").unlink()
    assert find_latest(tmp_path).name == "step_000001"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_000002")
    assert find_latest(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("name", ["optimizer.pt", "weights.safetensors", "rng.safetensors"])
def test_same_size_random_bytes_are_caught_by_the_checksum(tmp_path, name):
    """Bytes overwritten in place (same size) used to load silently; the manifest's SHA-256 catches them."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    target = tmp_path / "step_000002" / name
    target.write_bytes(np.random.default_rng(0).bytes(target.stat().st_size))
    assert checkpoint_problem(tmp_path / "step_000002") == f"{name}: SHA-256 mismatch (damaged after it was written)"
    assert checkpoint_problem(tmp_path / "step_000001") is None
    assert damaged_checkpoints(tmp_path) == {tmp_path / "step_000002": checkpoint_problem(tmp_path / "step_000002")}
    assert find_latest(tmp_path).name == "step_000001"  # falls back, as for a truncated file
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        load_checkpoint(tmp_path / "step_000002")
    assert torch.equal(load_checkpoint(find_latest(tmp_path)).weights["w"], torch.full((4, 3), 1.0))


def test_damage_reports_say_what_is_wrong(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    (tmp_path / "step_000001" / "weights.safetensors").unlink()
    (tmp_path / "step_000002" / "optimizer.pt").write_bytes(b"torn")
    (tmp_path / "step_000003" / "state.json").write_text('{"step": 3, "manif')
    assert {path.name: problem for path, problem in damaged_checkpoints(tmp_path).items()} == {
        "step_000001": "weights.safetensors is missing",
        "step_000002": f"optimizer.pt is 4 bytes, the manifest says {_size_in_manifest(tmp_path / 'step_000002')}",
        "step_000003": "state.json is unreadable (JSONDecodeError)",
    }
    assert find_latest(tmp_path) is None


def _size_in_manifest(path: Path) -> int:
    import json

    return json.loads((path / "state.json").read_text())["manifest"]["optimizer.pt"]["bytes"]


_WRITER = """
import sys, torch
from algos.checkpoint import save_checkpoint
root = sys.argv[1]
for step in range(1, 100000):
    weights = {"w": torch.full((512, 512), float(step))}
    save_checkpoint(root, step, weights=weights, optimizer={"step": step}, state={"step_seen": step}, keep=2)
    print(step, flush=True)
"""


def test_sigkill_mid_write_never_corrupts(tmp_path):
    """A writer saving 1 MB checkpoints back to back is killed mid-save; the newest good one loads."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    for _ in range(3):
        proc.stdout.readline()  # a few checkpoints are complete and the writer is inside the next one
    time.sleep(0.017)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoint = load_checkpoint(find_latest(tmp_path))
    assert checkpoint.state["step_seen"] == checkpoint.step >= 3
    assert torch.equal(checkpoint.weights["w"], torch.full((512, 512), float(checkpoint.step)))
