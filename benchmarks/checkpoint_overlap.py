"""What a checkpoint costs the training loop: steps with no checkpoint, with each written in the loop, and with each
written beside the next steps (`algos.checkpoints.background`), at a model shape of `benchmarks.scale_step`.

A random-weight model of the shape (no download) trains on one fixed sequence of ``--tokens`` tokens: each step is a
forward and backward pass and an AdamW update, as the trainer's update is, and a checkpoint follows every step
(weights and AdamW state, `algos.checkpoints.store`, the newest two kept). Each mode runs a warm-up step, then
``--steps`` timed ones; the line per mode gives the loop's mean seconds per step, and for the checkpointed modes the
seconds the loop spent on the checkpoint (the copy, and any wait for the write before it). The writes go under
``--work`` (default: a temporary directory on the machine's disk).

    python -m benchmarks.checkpoint_overlap --shape qwen2.5-0.5b --param-dtype bfloat16
    python -m benchmarks.checkpoint_overlap --shape tiny --steps 2          # a smoke run of the script
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from algos.checkpoints.background import BackgroundWriter
from algos.checkpoints.store import snapshot_checkpoint
from benchmarks.scale_step import SHAPES

MODES = ("none", "in the loop", "beside the steps")


def _model(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(SHAPES[shape])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(sizes.pop("model_type"), **sizes)).to(dtype)


def run_mode(
    mode: str, model: torch.nn.Module, tokens: torch.Tensor, steps: int, root: Path
) -> tuple[float, float, float]:
    """Mean seconds per timed step, mean seconds of it spent on the checkpoint, and the timed steps' wall time up to
    the last checkpoint on disk, in `mode` (one of `MODES`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    writer = BackgroundWriter()
    step_times, checkpoint_times = [], []
    for step in range(steps + 1):  # the first warms up (AdamW's state is made, the allocator grows)
        start = time.perf_counter()
        if step == 1:
            first = start
        writer.check()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        saving = time.perf_counter()
        if mode != "none":
            weights = {name: p for name, p in model.named_parameters()}
            write = snapshot_checkpoint(
                root, step + 1, weights=weights, optimizer=optimizer.state_dict(), state={}, keep=2
            )
            if mode == "beside the steps":
                writer.submit(write)
            else:
                write()
        end = time.perf_counter()
        if step:
            step_times.append(end - start)
            checkpoint_times.append(end - saving)
    writer.wait()
    whole = time.perf_counter() - first
    return sum(step_times) / len(step_times), sum(checkpoint_times) / len(checkpoint_times), whole


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        return f"{names[0]} x {len(names)}"
    except (OSError, IndexError):
        return platform.machine()


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the sequence each step trains on")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--work", default=None, help="where the checkpoints go (default: a temporary directory)")
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    print(f"command: python -m benchmarks.checkpoint_overlap {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"machine: {_cpu()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, seed 0")
    model = _model(options.shape, getattr(torch, options.param_dtype))
    count = sum(p.numel() for p in model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**30  # weights and AdamW's moments
    print(f"{options.shape}: {count / 1e9:.2f}B parameters, a checkpoint {size:.2f} GiB")
    tokens = torch.randint(0, 1000, (1, options.tokens), generator=torch.Generator().manual_seed(0))
    lines = []
    with tempfile.TemporaryDirectory(dir=options.work) as tmp:
        for i, mode in enumerate(MODES):
            step, checkpoint, whole = run_mode(mode, model, tokens, options.steps, Path(tmp) / f"mode{i}")
            line = f"checkpoint {mode:<17} step {step:.2f} s" + (f" (checkpoint {checkpoint:.2f} s)" if i else "")
            line += f"; {options.steps} steps {whole:.1f} s to the last one on disk"
            print(line, flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
