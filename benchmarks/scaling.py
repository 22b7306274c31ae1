"""Data-parallel scaling: the step time of 1 process and of N processes (one torch thread each) on the same
global batch, side by side, from one command.

Each row is a real training run launched by ``torchrun --standalone`` (gloo on CPU, NCCL with ``--device
cuda``); the step time is the median ``time/step`` of rank 0's metrics.jsonl after the first (warm-up) steps.
Every run trains on the same questions, samples the same episodes and takes the same optimizer steps, so the
ratio is the data-parallel speed-up alone:

    python -m benchmarks.scaling                                   # tiny model: 1 x 1 thread vs 2 x 1 thread
    python -m benchmarks.scaling --procs 1 2 4 --model smollm2 --questions-per-step 8 --steps 4

Flags after ``--`` go to the trainer unchanged (e.g. ``-- --protocol coda``; ``-- --fsdp`` shards the model over the
ranks, FSDP2, where one process trains it whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(procs: int, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    """Train `args.steps` steps with `procs` ranks of one thread each; rank 0's median step timings."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    cmd += ["-m", f"algos.{args.algo}", "--preset", args.preset, "--run-dir", str(run_dir), "--steps", str(args.steps)]
    cmd += ["--questions-per-step", str(args.questions_per_step), "--sft-batch-size", str(args.sft_batch_size)]
    cmd += ["--torch-threads", "1", "--eval-questions", "0", "--save-every", "0", "--no-wandb", "--no-progress"]
    if args.model:
        cmd += ["--model", "None" if args.model == "smollm2" else args.model]
    cmd += args.trainer_args
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{procs} processes failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup :] or rows[-1:]
    keys = ("time/step", "time/rollout", "time/forward_backward", "time/optimizer")
    out = {key: statistics.median(r.get(key, 0.0) for r in timed) for key in keys}
    out["wall_s"] = time.perf_counter() - start
    out["tokens/trained"] = statistics.median(r["tokens/trained"] for r in timed)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="ranks per run (one torch thread each)")
    parser.add_argument("--algo", default="grpo_sft", help="grpo, grpo_sft, red_grpo, sft or ppo")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", default=None, help="None: the preset's (tiny); smollm2: the bundled model")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--questions-per-step", type=int, default=8)
    parser.add_argument("--sft-batch-size", type=int, default=8)
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.trainer_args = trainer_args
    results = {}
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        for procs in args.procs:
            results[procs] = run(procs, args, Path(tmp) / f"p{procs}")
    base = results[args.procs[0]]["time/step"]
    print(
        f"{args.algo}, preset {args.preset}, model {args.model or 'preset'}: {args.questions_per_step} questions "
        f"x group, {args.sft_batch_size} demonstrations per step; median of steps {args.warmup + 1}..{args.steps}"
    )
    print("| ranks x threads | step s | rollout s | forward+backward s | optimizer s | trained tokens | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for procs, r in results.items():
        print(
            f"| {procs} x 1 | {r['time/step']:.2f} | {r['time/rollout']:.2f} | {r['time/forward_backward']:.2f} | "
            f"{r['time/optimizer']:.2f} | {r['tokens/trained']:.0f} | {base / r['time/step']:.2f} |"
        )


if __name__ == "__main__":
    main()
