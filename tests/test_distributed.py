"""Data parallelism (algos.distributed): two gloo processes under torchrun train exactly what one process does,
with the model replicated (DDP) or sharded (FSDP2, ``--fsdp``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import distributed_runs
import pytest
import torch
from distributed_runs import checkpoint_tensors
from safetensors.torch import load_file

from agents.collector import shard_range
from agents.models import tiny_model
from algos import distributed
from algos.config import preset_config
from algos.learners.archer import ArCHerConfig
from algos.objectives.advantages import whiten
from algos.run.cli import parse_config

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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run of a `distributed_runs` function by name, played once per module (``*_fsdp`` runs are the
    plain runs in one process, so they share it)."""
    out = tmp_path_factory.mktemp("dp1")
    threads = torch.get_num_threads()

    def run(name: str) -> Path:
        name = name.removesuffix("_fsdp")
        if not (out / name / "final").is_dir():
            torch.set_num_threads(1)
            try:
                getattr(distributed_runs, name)(out / name)
            finally:
                torch.set_num_threads(threads)
        return out / name

    return run


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
    """Every file and directory of a run, a checkpoint's contents left out (they differ by layout, compared apart)."""
    found = [p.relative_to(run_dir).parts for p in run_dir.rglob("*")]
    return sorted("/".join(f) for f in found if "wandb" not in f and not (f[0] == "checkpoints" and len(f) > 2))


@pytest.mark.parametrize("name", ["sft", "grpo", "grpo_tree", "ppo", "sft_fsdp", "grpo_fsdp", "ppo_fsdp"])
def test_two_processes_train_what_one_process_trains(name, two_processes, one_process):
    one, two = one_process(name), two_processes / name
    _assert_same_weights(one, two)
    rows_one, rows_two = _rows(one), _rows(two)
    assert [r["step"] for r in rows_two] == [1, 2]  # rank 0 alone logged: one row per step
    for a, b in zip(rows_one, rows_two, strict=True):  # metrics are reduced over the ranks: the global batch's
        for key in ("total_loss", "tokens/trained", "critic/rewards/mean", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6, nan_ok=True), key
        terms = ("rl/grad_norm", "sft/grad_norm", "rl/signal_rows")  # each term's norm, the share: every rank's
        assert [key in b for key in terms] == [key in a for key in terms]
        for key in (key for key in terms if key in a):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    if name.startswith(("grpo", "ppo")):
        assert any(abs(r["loss_pg"]) > 0 for r in rows_two)  # the policy gradient did act
    if name.startswith("grpo"):
        assert rows_two[0]["train/questions"] == 2 and rows_two[0]["tokens/sampled"] == rows_one[0]["tokens/sampled"]
    assert _files(two) == _files(one)  # no second copy, no debris of a concurrent write
    # a checkpoint holds what one process's holds: the same tensors, the same optimizer state (sharded ones read whole)
    ckpt_one, ckpt_two = one / "checkpoints" / "step_000002", two / "checkpoints" / "step_000002"
    assert (ckpt_two / "shards").is_dir() == name.endswith("_fsdp")  # --fsdp: each rank wrote its shards
    assert (ckpt_two / "rng_rank1.safetensors").is_file()  # rank 1's RNG states, beside rank 0's
    weights_one, opt_one = checkpoint_tensors(ckpt_one)
    weights_two, opt_two = checkpoint_tensors(ckpt_two)
    assert weights_two.keys() == weights_one.keys()
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=0, atol=1e-5, msg=key)
    assert opt_two.keys() == opt_one.keys()
    for index, state in opt_one.items():
        for key, value in state.items():
            torch.testing.assert_close(opt_two[index][key], value, rtol=1e-3, atol=1e-6, msg=f"{index} {key}")


@pytest.mark.parametrize("name", ["sft", "sft_fsdp"])
def test_evaluation_is_split_over_the_ranks_and_pooled(name, two_processes, one_process):
    one = json.loads((one_process(name) / "eval.json").read_text())
    two = json.loads((two_processes / name / "eval.json").read_text())
    assert two["after"]["n"] == one["after"]["n"] == 4
    assert [p["actions"] for p in two["after"]["predictions"]] == [p["actions"] for p in one["after"]["predictions"]]
    assert two["after"]["metrics"] == one["after"]["metrics"]


def test_resume_in_two_processes_continues_exactly(two_processes, one_process):
    """DDP (the sharded runs' resumes: tests/test_sharded_checkpoint.py). Each rank gets back its own RNG streams,
    which had parted (`distributed_runs.RankDraws`)."""
    one = one_process("red_grpo")  # one process, 2 steps without a stop
    resumed = two_processes / "red_grpo_resumed"
    _assert_same_weights(one, resumed)
    assert [r["step"] for r in _rows(resumed)] == [1, 2]
    for a, b in zip(_rows(one), _rows(resumed), strict=True):
        assert b["sft/weight"] == pytest.approx(a["sft/weight"], rel=1e-5)
    trace = two_processes / "red_grpo_resumed_rng"
    saved = [torch.load(trace / f"saved_step1_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in (0, 1):
        back = torch.load(trace / f"resumed_step1_rank{rank}.pt", weights_only=False)
        assert torch.equal(back["torch"], saved[rank]["torch"]), rank
        assert back["python"] == saved[rank]["python"] and back["numpy"] == saved[rank]["numpy"], rank
    assert not torch.equal(saved[0]["torch"], saved[1]["torch"])


def test_archer_refuses_data_parallel(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="archer does not run data-parallel"):
        preset_config("tiny", ArCHerConfig, algo="archer")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny"], algo="archer")
    assert exit_info.value.code == 2
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preset_config("tiny", ArCHerConfig, algo="archer").run.algo == "archer"


def test_fsdp_refuses_lora():
    with pytest.raises(ValueError, match="--fsdp with --lora"):
        preset_config("tiny", algo="grpo", fsdp=True, lora=True)


def test_fsdp_refuses_no_context_grad(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--fsdp with --no-context-grad"):
        preset_config("tiny", algo="grpo", fsdp=True, context_grad=False)
    assert not preset_config("tiny", algo="grpo", context_grad=False).optim.context_grad  # DDP takes it


def test_global_whitening_equals_whitening_the_whole_batch():
    """PPO's whitening with `all_sum`: two shares whitened with their summed statistics are the whole batch whitened
    at once (what two ranks do), and one share with the identity sum is the plain whitening."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 9, generator=gen) * 3 + 1  # (N, T-1)
    mask = torch.rand(6, 9, generator=gen) > 0.3
    whole = whiten(values, mask)

    def stats(v, m):
        picked = v[m].double()
        return [picked.numel(), float(picked.sum()), float(picked.square().sum())]

    halves = [(values[:2], mask[:2]), (values[2:], mask[2:])]  # unequal shares, as ranks may hold
    parts = []
    for i, (v, m) in enumerate(halves):
        other = stats(*halves[1 - i])
        parts.append(whiten(v, m, all_sum=lambda *mine, other=other: [a + b for a, b in zip(mine, other, strict=True)]))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    alone = whiten(values, mask, all_sum=lambda *v: [float(x) for x in v])
    torch.testing.assert_close(alone, whole, rtol=1e-5, atol=1e-6)


def test_shards_cover_the_batch_once():
    for n in range(7):
        for ranks in (1, 2, 3):
            shares = [list(shard_range(n, r, ranks)) for r in range(ranks)]
            assert [i for s in shares for i in s] == list(range(n))
            assert shares == [distributed.shard(range(n), distributed.World(r, ranks)) for r in range(ranks)]
    assert distributed.all_sum(1.5, 2) == [1.5, 2.0]  # one process: identities
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
