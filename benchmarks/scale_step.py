"""One GRPO + RED step at the sizes users train: SmolLM2-135M, Qwen2.5-1.5B and Qwen2.5-3B shapes, side by side.

Each shape is built from its published config with random weights (no download) over the SmolLM2 tokenizer (its
ids lie inside every shape's vocabulary), saved as a local Hugging Face directory, and trained by the real entry
point, `python -m algos.red_grpo`, in a process of its own for two steps (the first warms up: CUDA graphs, kernel
selection, the allocator). Random weights tie every group's rewards, so GRPO's policy-gradient term is zero; RED's
SFT term still runs the whole update (forward, backward and AdamW over every parameter), which is what is timed.
The env uses the distractor corpus (no JVM, no index: retrieval is not what is measured here).

For each shape it prints the second step's split (generation, env and retrieval, old log-probs, forward/backward,
optimizer), the update's share of the step, peak GPU memory, sampled and trained tokens, trajectories per GPU
per second (the step's episodes over its wall time: every rank's episodes over the ranks), and generation tokens/s
against the bound the machine's measured memory bandwidth sets (`decode_bound`: every weight read once a decode
step for the sampler's rows). A second line says what the sampler's decoding levers did in that step (`levers`): its
rows per graph batch, the live rows and the rows run per decode step, the prefill tokens prefix sharing saved, and
the prefill's attention. Each trainer's whole
output is kept as `trainer.log` in its run directory (under ``--work``).

    python -m benchmarks.scale_step                                     # the three shapes, the gpu preset
    python -m benchmarks.scale_step --shapes qwen2.5-3b -- --gradient-checkpointing --sampler vllm
    python -m benchmarks.scale_step --shapes tiny --preset tiny         # a CPU smoke run of the script itself

Flags after ``--`` go to the trainer unchanged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # model_type and sizes as in each model's published config.json
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2.5-3b": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "tiny": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}
SPLIT = ("time/generation", "time/env_and_retrieval", "time/old_logp", "time/forward_backward", "time/optimizer")


def build(shape: str, out: Path, max_context: int = 4096) -> Path:
    """A random-weight model of `shape` with the SmolLM2 tokenizer, saved as a Hugging Face directory at `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from agents.models import fix_pad_token, smollm2_tokenizer

    transformers_logging.disable_progress_bar()  # a bar per shard in the benchmark's log

    tokenizer = smollm2_tokenizer()
    sizes = dict(SHAPES[shape])
    config = AutoConfig.for_model(
        sizes.pop("model_type"),
        **sizes,
        max_position_embeddings=max_context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):  # a 3B random init takes minutes on a CPU, a second on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else None)
    fix_pad_token(model, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def read_bandwidth() -> float:
    """Bytes/s at which this machine's accelerator (CUDA where there is one, else the CPU) reads memory: the best of
    a few sums over a 2 GiB bfloat16 tensor on a GPU (`benchmarks.roofline.memory_bandwidth` on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        from benchmarks.roofline import memory_bandwidth

        return memory_bandwidth(repeats=3)
    from benchmarks.timing import best_seconds

    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")

    def read() -> None:
        x.sum()
        torch.cuda.synchronize()

    return x.numel() * 2 / best_seconds(read, repeats=5, warmup=True)


def decode_bound(
    model: Path, preset: str, extra: Sequence[str], bandwidth: float, batch: int | None = None
) -> tuple[float, int, float]:
    """The sampled tokens/s that `bandwidth` allows a run's decode steps, its rows and the weight bytes a step reads.

    A decode step reads every weight once (in bfloat16 under ``--bf16`` or bfloat16 weights, else float32) for all
    of its rows, the sampler's batch (`batch`, the trainer's ``sampler/rows_per_batch``; None: ``--sampler-batch-size``
    or, where that chooses from the free memory, the most it may choose), at most the step's episodes; the keys and
    values it also reads are left out, so the bound is an upper one.
    """
    from transformers import AutoConfig

    from algos.run.cli import parse_config
    from algos.run.memory import Shape, count_parameters, sampler_rows

    config = parse_config(["--preset", preset, "--model", str(model), *extra], algo="red_grpo")
    half = config.model.use_bf16 or config.model.param_dtype == "bfloat16"
    model_config = AutoConfig.from_pretrained(model)
    parameters = count_parameters(model_config)
    weight_bytes = parameters * (2 if half else 4)
    if batch is None:
        batch = sampler_rows(config, Shape.of(model_config, parameters=parameters), None)[0]
    rows = min(batch, config.rl.questions_per_step * config.rl.group_size)
    return rows * bandwidth / weight_bytes, rows, weight_bytes


def run(shape: str, work: Path, preset: str, extra: Sequence[str], timeout: float | None = None) -> dict[str, Any]:
    """Two steps of `python -m algos.red_grpo` on `shape` (all of it, the model's build included, stopped after
    `timeout` seconds); the second step's metrics row, with the decode bound of `decode_bound` at this machine's
    `read_bandwidth` (``bound/*`` keys)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    model = work / f"{shape}-model"
    # built in a process of its own, which gives its GPU memory back when it ends (this one would hold it all along)
    builder = multiprocessing.get_context("spawn").Process(target=build, args=(shape, model))
    builder.start()
    builder.join(None if deadline is None else max(1.0, deadline - time.monotonic()))
    if builder.is_alive():
        builder.kill()
        raise RuntimeError(f"{shape}: building the model took more than {timeout:.0f} s")
    if builder.exitcode != 0:
        raise RuntimeError(f"{shape}: building the model failed (exit code {builder.exitcode})")
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its CUDA context ends with it
        bandwidth = pool.apply(read_bandwidth)
    run_dir = work / f"{shape}-run"
    command = [sys.executable, "-m", "algos.red_grpo", "--preset", preset, "--model", str(model)]
    command += ["--corpus", "distractor", "--steps", "2", "--save-every", "0", "--eval-questions", "0"]
    command += ["--validation-questions", "0", "--no-wandb", "--run-dir", str(run_dir), *extra]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "trainer.log"  # the trainer's whole output (its memory estimate at start, any traceback)
    with log.open("w") as out:
        env = {**os.environ, "WANDB_MODE": "disabled"}
        try:
            left = None if deadline is None else max(1.0, deadline - time.monotonic())
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=left)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{shape}: no second step inside {timeout:.0f} s (whole output: {log})") from None
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
        raise RuntimeError(f"{shape}: the trainer exited {done.returncode} (whole output: {log}):\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    batch = rows[-1].get("sampler/rows_per_batch")
    bound, decode_rows, weight_bytes = decode_bound(
        model, preset, extra, bandwidth, None if batch is None else int(batch)
    )
    bounds = {"bound/read_bytes_per_s": bandwidth, "bound/decode_tokens_per_s": bound, "bound/rows": decode_rows}
    return {**rows[-1], **bounds, "bound/weight_bytes": weight_bytes, "prefill_attention": prefill_attention(log)}


def prefill_attention(log: Path) -> str | None:
    """The prefill attention the trainer's sampler said it runs (`HFSampler`'s "sampler prefill attention: ..."
    line in its log), or None where it said none (another sampler)."""
    said = "sampler prefill attention: "
    for line in log.read_text(errors="replace").splitlines():
        if said in line:
            return line.split(said, 1)[1].split(" (", 1)[0].strip()
    return None


def levers(row: dict[str, Any]) -> str | None:
    """One line of what the transformers sampler's decoding levers did in the step (its ``sampler/*`` metrics and
    the prefill attention it said), or None for a sampler without them."""
    if "sampler/rows_per_batch" not in row:
        return None
    prefilled, saved = row["sampler/prefill_tokens"], row["sampler/prefill_tokens_saved"]
    share = saved / (prefilled + saved) if prefilled + saved else 0.0
    return (
        f"  levers: {row['sampler/rows_per_batch']:.0f} rows per batch (the largest graph bucket); "
        f"{row['sampler/live_rows_per_step']:.1f} live rows per decode step over {row['sampler/decode_steps']:.0f} "
        f"steps, {row['sampler/stepped_rows_per_step']:.1f} run (finished rows leaving the bucket); "
        f"prefill {prefilled:.0f} tokens, {saved:.0f} saved by prefix sharing ({share:.0%}); "
        f"prefill attention {row.get('prefill_attention') or 'not said'}"
    )


def report(shape: str, row: dict[str, Any], ranks: int) -> str:
    """One line: the step, its split, the update's share, memory, tokens and trajectories per GPU per second."""
    step = row["time/step"]
    update = row["time/forward_backward"] + row["time/optimizer"]
    split = " ".join(f"{k.removeprefix('time/')} {row[k]:.2f}" for k in SPLIT)
    memory = f"peak {row['memory/peak_gib']:.1f} GiB" if "memory/peak_gib" in row else "peak n/a (CPU)"
    per_gpu = row.get("train/episodes", 0) / step / ranks
    line = (
        f"{shape:<13} step {step:.2f} s ({split}); update {update / step:.0%}; {memory}; "
        f"sampled {row['tokens/sampled']:.0f}, trained {row['tokens/trained']:.0f} tokens; "
        f"{per_gpu:.2f} trajectories/GPU/s"
    )
    if "bound/decode_tokens_per_s" in row and row["time/generation"] > 0:
        rate, bound = row["tokens/sampled"] / row["time/generation"], row["bound/decode_tokens_per_s"]
        line += (
            f"; generation {rate:.0f} tok/s (prefill included), {rate / bound:.1%} of the {bound:.0f} tok/s that "
            f"reading {row['bound/weight_bytes'] / 1e9:.2f} GB of weights per step for {row['bound/rows']} rows at "
            f"{row['bound/read_bytes_per_s'] / 1e9:.0f} GB/s allows"
        )
    return line


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2-135m", "qwen2.5-1.5b", "qwen2.5-3b"]
    )
    parser.add_argument("--preset", default="gpu", choices=("gpu", "cpu", "tiny"))
    parser.add_argument("--work", default=None, help="where the models and runs go (default: a temporary directory)")
    options = parser.parse_args(args)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(options.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for shape in options.shapes:
            row = run(shape, work, options.preset, extra)
            line = report(shape, row, ranks)
            print(line, flush=True)
            lines.append(line)
            if (said := levers(row)) is not None:
                print(said, flush=True)
                lines.append(said)
    return lines


if __name__ == "__main__":
    main()
