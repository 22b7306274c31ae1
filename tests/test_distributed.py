"""Data parallelism (algos.distributed): two gloo processes under torchrun train exactly what one process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import distributed_runs
import pytest
import torch
from safetensors.torch import load_file

from agents.collector import shard_range
from agents.models import tiny_model
from algos import distributed

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """Every run of `distributed_runs.RUNS`, played once by ``torchrun --nproc-per-node 2``."""
    out = tmp_path_factory.mktemp("dp2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(HERE / "distributed_runs.py"), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-5, msg=name)
    start, _ = tiny_model(seed=0, max_context=1024)  # the tiny preset's starting weights
    moved = max(float((wa[name] - p.detach()).abs().max()) for name, p in start.named_parameters() if name in wa)
    assert moved > 1e-5 * 5  # the tolerance is small against what two steps changed


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "wandb" not in p.parts)


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_two_processes_train_what_one_process_trains(name, two_processes, tmp_path, one_torch_thread):
    getattr(distributed_runs, name)(tmp_path / name)
    one, two = tmp_path / name, two_processes / name
    _assert_same_weights(one, two)
    rows_one, rows_two = _rows(one), _rows(two)
    assert [r["step"] for r in rows_two] == [1, 2]  # rank 0 alone logged: one row per step
    for a, b in zip(rows_one, rows_two, strict=True):  # metrics are reduced over the ranks: the global batch's
        for key in ("total_loss", "tokens/trained", "critic/rewards/mean", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    if name == "grpo":
        assert any(abs(r["loss_pg"]) > 0 for r in rows_two)  # the policy gradient did act
        assert rows_two[0]["train/questions"] == 2 and rows_two[0]["tokens/sampled"] == rows_one[0]["tokens/sampled"]
    assert _files(two) == _files(one)  # no second copy, no debris of a concurrent write


def test_evaluation_is_split_over_the_ranks_and_pooled(two_processes, tmp_path, one_torch_thread):
    distributed_runs.sft(tmp_path / "sft")
    one = json.loads((tmp_path / "sft" / "eval.json").read_text())
    two = json.loads((two_processes / "sft" / "eval.json").read_text())
    assert two["after"]["n"] == one["after"]["n"] == 4
    assert [p["actions"] for p in two["after"]["predictions"]] == [p["actions"] for p in one["after"]["predictions"]]
    assert two["after"]["metrics"] == one["after"]["metrics"]


def test_resume_in_two_processes_continues_exactly(two_processes, tmp_path, one_torch_thread):
    distributed_runs.red_grpo(tmp_path / "red")  # one process, 2 steps without a stop
    resumed = two_processes / "red_grpo_resumed"
    _assert_same_weights(tmp_path / "red", resumed)
    assert [r["step"] for r in _rows(resumed)] == [1, 2]
    for a, b in zip(_rows(tmp_path / "red"), _rows(resumed), strict=True):
        assert b["sft/weight"] == pytest.approx(a["sft/weight"], rel=1e-5)


def test_shards_cover_the_batch_once():
    for n in range(7):
        for ranks in (1, 2, 3):
            shares = [list(shard_range(n, r, ranks)) for r in range(ranks)]
            assert [i for s in shares for i in s] == list(range(n))
            assert shares == [distributed.shard(range(n), distributed.World(r, ranks)) for r in range(ranks)]
    assert distributed.all_sum(1.5, 2) == [1.5, 2.0]  # one process: identities
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
