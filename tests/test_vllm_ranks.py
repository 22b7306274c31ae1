"""Two ranks, two real vLLM engines: ``torchrun --nproc-per-node 2`` of ``--sampler vllm`` on vLLM's CPU build, with
the policy replicated (DDP) and sharded (``--fsdp``). Each rank builds its own engine (``external_launcher``, a KV
cache of ``--vllm-kv-cache-gib`` each, so that both fit one machine), pushes into it after every step, and the ranks'
engines hold the same weights after every push; the run's final weights are a one-process run's within the
tolerance of the data-parallel tests (tests/test_distributed.py). Marked ``vllm``: CI's vLLM stage runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vLLM is not installed (docs/install.md: vLLM on a CPU)")

HERE = Path(__file__).resolve().parent
STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from agents.models import tiny_model

    # 4 heads of 32: the CPU build's attention has no kernel for the default tiny model's heads of 16
    model, tokenizer = tiny_model(seed=0, hidden_size=128, architecture="llama")
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _run(out: Path, model_dir: Path, ranks: int, *flags: str) -> Path:
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), str(HERE / "vllm_ranks.py"), str(out), str(model_dir)]
    done = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # the engines' teardown included
    return out


def _digests(out: Path, rank: int) -> list[str]:
    return [json.loads(line)["digest"] for line in (out / f"engine-rank{rank}.jsonl").read_text().splitlines()]


def _final(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "run" / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, model_dir) -> Path:
    return _run(tmp_path_factory.mktemp("vllm1") / "out", model_dir, 1)


@pytest.mark.parametrize("flags", [(), ("--fsdp",)], ids=["ddp", "fsdp"])
def test_two_ranks_push_the_same_weights_into_their_engines_and_train_what_one_process_trains(
    tmp_path, model_dir, one_process, flags
):
    two = _run(tmp_path / "out", model_dir, 2, *flags)
    first, second = _digests(two, 0), _digests(two, 1)
    assert len(first) == STEPS + 1  # the push at start and one after each step
    assert first == second  # both engines hold the same weights after every push
    assert len(set(first)) == STEPS + 1  # and every push changed them (lr 1e-3 moves the weights)
    rows = [json.loads(line) for line in (two / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)) and all(r["time/weight_push"] > 0 for r in rows)
    alone, together = _final(one_process), _final(two)
    assert alone.keys() == together.keys()
    for name, value in alone.items():
        torch.testing.assert_close(together[name], value, rtol=0, atol=1e-5, msg=name)
