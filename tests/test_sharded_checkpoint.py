"""Sharded checkpoints under ``--fsdp`` (torch.distributed.checkpoint): each rank writes its own shards, a resume
continues exactly with the same number of ranks and resumes with another, and damage to any file a resume reads (a
shard, state.json) is caught, the run falling back to the previous checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import distributed_runs
import numpy as np
import pytest
import torch
from distributed_runs import RankDraws, checkpoint_tensors, red_grpo_config
from safetensors.torch import load_file

from algos.checkpoints.store import checkpoint_problem, find_latest

HERE = Path(__file__).resolve().parent
SHARDED_FILES = {
    "manifest.json",
    "state.json",
    "rng.safetensors",
    "rng_rank1.safetensors",
    "shards/.metadata",
    "shards/__0_0.distcp",
    "shards/__1_0.distcp",
}
"""Every file of a two-rank sharded checkpoint: each rank's shards and RNG states, DCP's index, rank 0's JSON."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """`distributed_runs.SHARDED_RUNS` played once by ``torchrun --nproc-per-node 2``, after one process has left, in
    ``plain_step1``, the whole-tensor checkpoint of step 1 that ``red_grpo_plain_to_fsdp`` resumes (from a copy)."""
    out = tmp_path_factory.mktemp("sharded")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        distributed_runs.red_grpo_step1(out / "plain_step1")
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(out / "plain_step1", out / "red_grpo_plain_to_fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(HERE / "distributed_runs.py"), str(out), "sharded"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def _resumed(run_dir: Path) -> RankDraws:
    """The run in `run_dir` resumed by this one process (not trained further: the caller closes it)."""
    return RankDraws(red_grpo_config(run_dir, resume=True))


def test_each_rank_writes_its_own_shards(runs):
    import torch.distributed.checkpoint as dcp

    for step in ("step_000001", "step_000002"):
        path = runs / "red_grpo_fsdp" / "checkpoints" / step
        assert _files(path) == SHARDED_FILES  # no whole weights.safetensors or optimizer.pt gathered on rank 0
        manifest = json.loads((path / "manifest.json").read_text())["files"]
        assert set(manifest) == SHARDED_FILES - {"manifest.json"}  # state.json and DCP's index included
        metadata = dcp.FileSystemReader(path / "shards").read_metadata()
        holders: dict[str, set[str]] = {}
        for index, stored in metadata.storage_data.items():
            holders.setdefault(index.fqn, set()).add(stored.relative_path)
        kinds = {key.split(".")[0] for key in holders}
        assert kinds == {"model", "optimizer", "average"}
        for key, files in holders.items():
            if not key.endswith(".step"):  # AdamW's step count is one scalar, the same on both ranks: written once
                assert files == {"__0_0.distcp", "__1_0.distcp"}, key  # half of every tensor in each rank's file
        assert sum(key.endswith(".exp_avg_sq") for key in holders) == sum(key.startswith("model.") for key in holders)


def test_a_kept_checkpoints_weights_are_read_back_under_fsdp(runs):
    """What the final model's selection does with a kept checkpoint (`TrainingRun.load_weights`): two sharded ranks
    read step 1's shards back, exactly the weights it holds."""
    weights = checkpoint_tensors(runs / "red_grpo_fsdp" / "checkpoints" / "step_000001")[0]
    reloaded = load_file(runs / "red_grpo_fsdp_step1_reloaded.safetensors")
    _assert_close(reloaded, {name: weights[name] for name in reloaded}, atol=0)
    step2 = checkpoint_tensors(runs / "red_grpo_fsdp" / "checkpoints" / "step_000002")[0]
    assert any(not torch.equal(reloaded[name], step2[name]) for name in reloaded)  # the policy held step 2's before


def test_a_resume_with_the_same_ranks_continues_exactly(runs):
    """Step 1, stop, --resume to step 2, all under two sharded ranks: the same weights, AdamW state, weight average,
    metrics and per-rank RNG streams as two ranks that never stopped."""
    straight, resumed = runs / "red_grpo_fsdp", runs / "red_grpo_fsdp_resumed"
    _assert_close(_final(resumed), _final(straight), atol=1e-6)
    start = checkpoint_tensors(runs / "red_grpo_fsdp_resumed_step1" / "checkpoints" / "step_000001")[0]
    moved = max(float((_final(straight)[name] - start[f"average/{name}"]).abs().max()) for name in _final(straight))
    assert moved > 10 * 1e-6  # step 2 moved the final (averaged) weights by far more than the tolerance
    weights, optimizer = checkpoint_tensors(resumed / "checkpoints" / "step_000002")
    weights_straight, optimizer_straight = checkpoint_tensors(straight / "checkpoints" / "step_000002")
    _assert_close(weights, weights_straight, atol=1e-6)
    assert optimizer.keys() == optimizer_straight.keys()
    for index, state in optimizer_straight.items():
        _assert_close(optimizer[index], state, atol=1e-6)
    for a, b in zip(_rows(straight), _rows(resumed), strict=True):
        assert a["step"] == b["step"] and b["sft/weight"] == pytest.approx(a["sft/weight"], rel=1e-6)
    trace = runs / "red_grpo_fsdp_resumed_rng"
    saved = [torch.load(trace / f"saved_step1_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in (0, 1):
        back = torch.load(trace / f"resumed_step1_rank{rank}.pt", weights_only=False)
        assert torch.equal(back["torch"], saved[rank]["torch"]), rank
        assert back["python"] == saved[rank]["python"] and back["numpy"] == saved[rank]["numpy"], rank
    assert not torch.equal(saved[0]["torch"], saved[1]["torch"])  # the ranks' streams had parted


def test_a_sharded_checkpoint_resumes_in_one_process(runs, tmp_path, one_torch_thread):
    """Step 1 of two sharded ranks, resumed by one process: DCP puts the shards together into whole tensors equal to
    what the checkpoint holds; the run then goes on to what the two ranks reached (to float rounding)."""
    run_dir = tmp_path / "red"
    shutil.copytree(runs / "red_grpo_fsdp_resumed_step1", run_dir)
    weights, optimizer = checkpoint_tensors(run_dir / "checkpoints" / "step_000001")
    run = _resumed(run_dir)  # the checkpoint's fsdp=True may change: one process has nothing to shard
    try:
        assert run.step == 1 and not run.fsdp
        names = [name for name, p in run.policy.named_parameters() if p.requires_grad]
        _assert_close({n: p.detach() for n, p in run.policy.named_parameters()}, {n: weights[n] for n in names}, 0)
        _assert_close(dict(zip(names, run.average, strict=True)), {n: weights[f"average/{n}"] for n in names}, 0)
        state = run.optimizer.state_dict()["state"]
        assert state.keys() == optimizer.keys()
        for index, values in optimizer.items():
            _assert_close(state[index], values, atol=0)
        saved_groups = json.loads((run_dir / "checkpoints" / "step_000001" / "state.json").read_text())
        assert [g["peak_lr"] for g in run.optimizer.param_groups] == [
            g["peak_lr"] for g in saved_groups["optimizer_groups"]
        ]
        run.train()
    finally:
        run.close()
    _assert_close(_final(run_dir), _final(runs / "red_grpo_fsdp"), atol=1e-5)
    assert [r["step"] for r in _rows(run_dir)] == [1, 2]
    assert _files(run_dir / "checkpoints" / "step_000002") == {
        "manifest.json",
        "state.json",
        "rng.safetensors",
        "weights.safetensors",
        "optimizer.pt",
    }  # one process writes whole tensors again


def test_a_whole_tensor_checkpoint_resumes_under_fsdp(runs):
    """Step 1 of one process (weights.safetensors, optimizer.pt), resumed by two sharded ranks: the same weights as
    two sharded ranks that never stopped (to float rounding), the next checkpoint sharded."""
    run_dir = runs / "red_grpo_plain_to_fsdp"
    _assert_close(_final(run_dir), _final(runs / "red_grpo_fsdp"), atol=1e-5)
    assert [r["step"] for r in _rows(run_dir)] == [1, 2]
    assert _files(run_dir / "checkpoints" / "step_000001") == _files(
        runs / "plain_step1" / "checkpoints" / "step_000001"
    )
    assert _files(run_dir / "checkpoints" / "step_000002") == SHARDED_FILES


def _damaged_copy(runs: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "red"
    shutil.copytree(runs / "red_grpo_fsdp", run_dir)
    return run_dir


def _assert_falls_back(run_dir: Path, problem: str, caplog) -> None:
    """`problem` is what `checkpoint_problem` says of step 2; a resume warns and continues from step 1."""
    checkpoints = run_dir / "checkpoints"
    assert checkpoint_problem(checkpoints / "step_000002") == problem
    assert checkpoint_problem(checkpoints / "step_000001") is None
    with caplog.at_level(logging.WARNING, logger="algos.checkpoints.store"):
        assert find_latest(checkpoints) == checkpoints / "step_000001"
    assert f"step_000002 is unusable ({problem})" in caplog.text
    weights = checkpoint_tensors(checkpoints / "step_000001")[0]
    run = _resumed(run_dir)
    try:
        assert run.step == 1
        for name, p in run.policy.named_parameters():
            torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0, msg=name)
    finally:
        run.close()


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(runs, tmp_path, caplog, one_torch_thread):
    run_dir = _damaged_copy(runs, tmp_path)
    shard = run_dir / "checkpoints" / "step_000002" / "shards" / "__1_0.distcp"
    shard.write_bytes(np.random.default_rng(0).bytes(shard.stat().st_size))  # same size: only a checksum sees it
    _assert_falls_back(run_dir, "shards/__1_0.distcp: SHA-256 mismatch (damaged after it was written)", caplog)


def test_an_edited_state_json_falls_back_to_the_previous_checkpoint(runs, tmp_path, caplog, one_torch_thread):
    """state.json holds the data position: an edit would silently continue on another data order, were it not in
    the manifest."""
    run_dir = _damaged_copy(runs, tmp_path)
    state_file = run_dir / "checkpoints" / "step_000002" / "state.json"
    text = state_file.read_text()
    position = json.loads(text)["collector"]["position"]
    assert text.count(f'"position": {position},') == 1
    edited = text.replace(f'"position": {position},', f'"position": {position + 1},')
    assert len(edited) == len(text)  # the same size: only the checksum tells
    state_file.write_text(edited)
    _assert_falls_back(run_dir, "state.json: SHA-256 mismatch (damaged after it was written)", caplog)
