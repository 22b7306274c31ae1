"""Checkpoints: atomic writes, crash safety (an exception mid-save, a SIGKILL mid-save), RNG restore, pruning, the
manifest over every file (state.json included), the earlier format, and the sharded layout in one process (its
two-rank runs: tests/test_sharded_checkpoint.py)."""

from __future__ import annotations

import json
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
from safetensors.torch import save_file

from algos.checkpoints.files import restore_rng, rng_state
from algos.checkpoints.sharded import load_sharded_tensors, save_sharded_checkpoint
from algos.checkpoints.store import (
    checkpoint_problem,
    damaged_checkpoints,
    find_latest,
    is_sharded,
    load_checkpoint,
    read_state,
    save_checkpoint,
)

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
    step_3 = tmp_path / "step_000003"
    (step_3 / "state.json").write_text('{"step": 3, "collec')  # torn
    assert {path.name: problem for path, problem in damaged_checkpoints(tmp_path).items()} == {
        "step_000001": "weights.safetensors is missing",
        "step_000002": f"optimizer.pt is 4 bytes, the manifest says {_size_in_manifest(tmp_path / 'step_000002')}",
        "step_000003": f"state.json is 19 bytes, the manifest says {_size_in_manifest(step_3, 'state.json')}",
    }
    assert find_latest(tmp_path) is None


def _size_in_manifest(path: Path, name: str = "optimizer.pt") -> int:
    return json.loads((path / "manifest.json").read_text())["files"][name]["bytes"]


_WRITER = """
import sys, torch
from algos.checkpoints.store import save_checkpoint
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


def _files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def test_the_manifest_covers_every_file_and_state_json(tmp_path):
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert set(manifest) == _files(path) - {"manifest.json"}
    assert {"state.json", "weights.safetensors", "optimizer.pt", "rng.safetensors"} <= set(manifest)


def test_an_edited_state_json_is_damage(tmp_path):
    """state.json holds the data position: editing it used to resume silently on another data order."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    state_file = tmp_path / "step_000002" / "state.json"
    text = state_file.read_text()
    assert text.count('"position": 2') == 1
    state_file.write_text(text.replace('"position": 2', '"position": 7'))  # the same size
    problem = "state.json: SHA-256 mismatch (damaged after it was written)"
    assert checkpoint_problem(tmp_path / "step_000002") == problem
    assert find_latest(tmp_path).name == "step_000001"
    assert load_checkpoint(find_latest(tmp_path)).state["collector"] == {"position": 1}
    with pytest.raises(ValueError, match="state.json: SHA-256 mismatch"):
        load_checkpoint(tmp_path / "step_000002")


def test_a_missing_manifest_is_an_unfinished_save(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step_000002" / "manifest.json").unlink()
    assert checkpoint_problem(tmp_path / "step_000002") == "manifest.json is missing (an unfinished save)"
    assert find_latest(tmp_path).name == "step_000001"
    (tmp_path / "step_000001" / "manifest.json").write_text('{"files": {"rng.safetensors": {"bytes": 1}}}')
    assert checkpoint_problem(tmp_path / "step_000001") == "manifest.json does not cover state.json"


def _save_earlier_format(root: Path, step: int) -> Path:
    """A checkpoint as written before manifest.json: the manifest inside state.json (covering the other files), the
    Python and NumPy RNG states in state.json, torch's alone in rng.safetensors."""
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    save_file({"w": torch.full((4, 3), float(step))}, str(path / "weights.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.ones(4, 3) * step}}, "param_groups": []}, path / "optimizer.pt")
    rng = rng_state()
    save_file({"torch": rng.pop("torch")}, str(path / "rng.safetensors"))
    rng.pop("cuda", None)
    files = ["weights.safetensors", "optimizer.pt", "rng.safetensors"]
    manifest = {name: {"bytes": (path / name).stat().st_size} for name in files}
    state = {"step": step, "collector": {"position": step}, "rng": rng, "manifest": manifest}
    (path / "state.json").write_text(json.dumps(state))
    (root / "latest").write_text(path.name + "\n")
    return path


def test_checkpoints_of_the_earlier_format_still_load(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    path = _save_earlier_format(tmp_path, 4)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert checkpoint_problem(path) is None
    checkpoint = load_checkpoint(find_latest(tmp_path))
    assert checkpoint.step == 4 and checkpoint.state == {"step": 4, "collector": {"position": 4}}
    assert torch.equal(checkpoint.weights["w"], torch.full((4, 3), 4.0))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    (path / "optimizer.pt").write_bytes(b"torn")  # its own manifest still guards the other files
    assert checkpoint_problem(path) == f"optimizer.pt is 4 bytes, the manifest says {_size_in_state(path)}"


def _size_in_state(path: Path) -> int:
    return json.loads((path / "state.json").read_text())["manifest"]["optimizer.pt"]["bytes"]


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_each_rank_gets_back_its_own_rng_streams(tmp_path):
    """Data parallel: rank 0 writes every rank's RNG states (they part once a rank draws more than another); each
    rank restores its own, a rank the checkpoint did not have rank 0's."""
    streams, expected = [], []
    for seed in (5, 6):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        streams.append(rng_state())
        expected.append(_draws())
    path = _save(tmp_path, 1, rng=streams)
    assert {"rng.safetensors", "rng_rank1.safetensors"} <= set(
        json.loads((path / "manifest.json").read_text())["files"]
    )
    for rank, wanted in ((1, expected[1]), (0, expected[0]), (2, expected[0])):
        torch.manual_seed(99)
        load_checkpoint(path, rank=rank)
        assert _draws() == wanted, rank


def _save_sharded(root: Path, step: int, **kwargs) -> Path:
    tensors = {
        "model": {"w": torch.full((4, 3), float(step))},
        "optimizer": {"policy.w": {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4, 3) * step}},
    }
    state = {"collector": {"position": step}, "optimizer_groups": [{"lr": 1e-6, "params": ["policy.w"]}]}
    return save_sharded_checkpoint(root, step, tensors=tensors, state=state, **kwargs)


def _load_sharded(path: Path) -> dict:
    tensors = {
        "model": {"w": torch.zeros(4, 3)},
        "optimizer": {"policy.w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, 3)}},
    }
    load_sharded_tensors(path, tensors)
    return tensors


def test_a_sharded_checkpoint_in_one_process(tmp_path):
    """The sharded layout written and read without a process group (one rank): DCP's files, all in the manifest."""
    torch.manual_seed(11)
    path = _save_sharded(tmp_path, 1)
    expected = torch.rand(1).item()
    assert is_sharded(path) and not is_sharded(_save(tmp_path / "whole", 1))
    assert _files(path) == {
        "manifest.json",
        "state.json",
        "rng.safetensors",
        "shards/.metadata",
        "shards/__0_0.distcp",
    }
    assert set(json.loads((path / "manifest.json").read_text())["files"]) == _files(path) - {"manifest.json"}
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert read_state(path) == {
        "step": 1,
        "collector": {"position": 1},
        "optimizer_groups": [{"lr": 1e-6, "params": ["policy.w"]}],
    }
    tensors = _load_sharded(find_latest(tmp_path))
    assert torch.equal(tensors["model"]["w"], torch.full((4, 3), 1.0))
    assert torch.equal(tensors["optimizer"]["policy.w"]["exp_avg"], torch.ones(4, 3))
    torch.manual_seed(99)
    restore_rng(path)
    assert torch.rand(1).item() == expected
    with pytest.raises(ValueError, match="is a sharded checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["shards/__0_0.distcp", "shards/.metadata", "state.json", "rng.safetensors"])
def test_a_damaged_sharded_checkpoint_falls_back(tmp_path, name):
    _save_sharded(tmp_path, 1)
    _save_sharded(tmp_path, 2)
    target = tmp_path / "step_000002" / name
    target.write_bytes(np.random.default_rng(0).bytes(target.stat().st_size))
    assert checkpoint_problem(tmp_path / "step_000002") == f"{name}: SHA-256 mismatch (damaged after it was written)"
    assert find_latest(tmp_path).name == "step_000001"
    assert torch.equal(_load_sharded(find_latest(tmp_path))["model"]["w"], torch.full((4, 3), 1.0))
    target.unlink()
    assert checkpoint_problem(tmp_path / "step_000002") == f"{name} is missing"


def test_a_crash_before_a_sharded_commit_leaves_the_newest_good_checkpoint(tmp_path):
    _save_sharded(tmp_path, 1)

    def crash(tmp_dir: Path) -> None:
        shard = tmp_dir / "shards" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])  # a torn write, then the process dies before the rename
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _save_sharded(tmp_path, 2, _before_commit=crash)
    assert find_latest(tmp_path).name == "step_000001"
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "step_000002").exists()
    _save_sharded(tmp_path, 2, keep=1)
    assert find_latest(tmp_path).name == "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]
