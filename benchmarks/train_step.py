"""Where a training step's time goes, how close the trainer's forward/backward is to a bare one and to the
machine's matmul peak, and how much of it is padding.

Runs the RED trainer (same flags as ``python -m algos.red_grpo``; default preset cpu without CUDA, gpu with it)
for a warm-up step and one measured step, then times a bare forward + backward of the same model on the same
token batch (the step's RL micro-batches and its SFT minibatch: logits, plain cross-entropy, backward), alternating
with the trainer's own passes (`measure`). Prints the split of the measured step and the checks against the targets:

- env + retrieval (rollout time outside the sampler) <= 5% of the step;
- the trainer's forward/backward tokens/s >= 0.8 x the bare forward/backward tokens/s;
- padding <= 5% of the tokens through forward/backward (`algos.batch.micro_batches`), RL and SFT alike, beside the
  earlier grouping (longest first, by the token budget alone: ``max_padding=1``) on the same lengths;
- the trainer's useful forward/backward FLOP/s (real tokens only, `benchmarks.roofline.train_flops`) >= 0.5 of
  this machine's fp32 matmul peak (`benchmarks.roofline.matmul_peak`), for both groupings.

The targets are about full-gradient passes (``--context-grad``); the gradient through the model's own tokens only
(``--no-context-grad``) is timed beside them. Every RL context runs (``skip_zero_advantage`` off).

    python -m benchmarks.train_step                       # cpu preset sizes on CPU, SmolLM2-135M
    python -m benchmarks.train_step --preset tiny         # seconds; a smoke test of the script
    python -m benchmarks.train_step --old-logp recompute  # include recomputed old log-probs
    python -m benchmarks.train_step --repeats 3           # more alternating fwd/bwd timings
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

import algos.learners.trainer
import algos.scoring
from algos.batch import micro_batches, trim_rows
from algos.config import Config
from algos.learners.trainer import Trainer
from algos.run.cli import parse_config
from algos.run.training_run import TrainingRun
from benchmarks.roofline import matmul_peak, train_flops

ENV_SHARE_TARGET = 0.05
FWD_BWD_RATIO_TARGET = 0.8
PADDING_TARGET = 0.05
PEAK_SHARE_TARGET = 0.5
SFT_STEPS = 256
"""SFT minibatches (steps 0..SFT_STEPS-1 of the run's seed) whose padding is measured."""


def padding_share(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(padding tokens, padded tokens) of micro-batches that each run trimmed to their longest row."""
    padded = sum(len(rows) * max(lengths[i] for i in rows) for rows in groups)
    return padded - sum(lengths[i] for rows in groups for i in rows), padded


def padding_of(batches: Sequence[Sequence[int]], max_tokens: int, max_padding: float) -> float:
    """Share of padding over several batches' micro-batches (each batch given by its rows' real lengths)."""
    pad = total = 0
    for lengths in batches:
        p, t = padding_share(lengths, micro_batches(lengths, max_tokens, max_padding))
        pad, total = pad + p, total + t
    return pad / max(total, 1)


@contextmanager
def earlier_grouping() -> Iterator[None]:
    """Run the trainer with the earlier grouping (longest first, by the token budget alone) inside the block."""
    current = algos.learners.trainer.micro_batches
    earlier = functools.partial(current, max_padding=1.0)
    algos.learners.trainer.micro_batches = algos.scoring.micro_batches = (
        earlier  # the update's and old log-probs' passes
    )
    try:
        yield
    finally:
        algos.learners.trainer.micro_batches = algos.scoring.micro_batches = current


def useful_flops(trainer: Trainer, batch: TensorDict, sft: TensorDict | None) -> float:
    """FLOPs of the trainer's forward/backward counted on real tokens (LM head on loss-mask positions)."""
    flops = 0.0
    for part in (batch, sft):
        if part is None:
            continue
        lengths = part["attention_mask"].sum(-1).tolist()
        head = int(part["loss_mask"].sum()) if trainer.run.masked_head else None
        flops += train_flops(trainer.run.policy, lengths, head)
    return flops


def bare_forward_backward(trainer: Trainer, batches: Sequence[tuple[TensorDict, list[list[int]]]]) -> tuple[float, int]:
    """Time forward + cross-entropy + backward of the trainer's model over the given micro-batches.

    Args:
        trainer: The learner: its autocast setting, and its run's model and device.
        batches: (padded batch, micro-batches of its row indices) pairs.

    Returns:
        (seconds, real tokens processed). Gradients are discarded.
    """
    model = trainer.run.policy
    model.train()
    tokens = 0
    trainer.run.optimizer.zero_grad(set_to_none=True)
    if trainer.run.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch, groups in batches:
        for rows in groups:
            part = trim_rows(batch, rows, trainer.run.device)
            ids, attn = part["input_ids"], part["attention_mask"]  # (n, L)
            with trainer.autocast():
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # (n, L, V)
                labels = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)  # (n, L-1)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss.backward()
            tokens += int(attn.sum())
    if trainer.run.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainer.run.optimizer.zero_grad(set_to_none=True)
    model.eval()
    return seconds, tokens


def trainer_forward_backward(trainer: Trainer, batch: TensorDict, sft: TensorDict | None, sft_coef: float) -> float:
    """Time the trainer's own forward/backward (RL micro-batches, then the SFT minibatch) on a given batch.

    Returns:
        Seconds. Gradients are discarded.
    """
    trainer.run.policy.train()
    trainer.run.optimizer.zero_grad(set_to_none=True)
    if trainer.run.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.accumulate_gradients(batch, sft, sft_coef)
    if trainer.run.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainer.run.optimizer.zero_grad(set_to_none=True)
    trainer.run.policy.eval()
    return seconds


@dataclass
class Measured:
    """What one benchmark run measured, before it is summed up (`measure`)."""

    metrics: dict[str, float]
    """The measured step's metrics row."""
    contexts: int
    """RL contexts of the measured step."""
    rl_lengths: list[list[int]]
    """Real lengths of the RL rows, one list per step (warm-up, measured)."""
    sft_lengths: list[list[int]]
    """Real lengths of the SFT minibatches of steps 0..SFT_STEPS-1 ([] without demonstrations)."""
    seconds: dict[str, list[float]]
    """Forward/backward timings by side: ``bare``, ``trainer``, ``earlier`` (grouping), ``narrow`` (gradient)."""
    bare_tokens: int
    """Real tokens through the bare forward/backward."""
    device: str
    """The trainer's device."""
    peak: float | None
    """This machine's fp32 matmul peak in FLOP/s (CPU only; None on a GPU)."""
    flops: float
    """Useful FLOPs of the trainer's forward/backward on the measured batch."""


def measure(config: Config, repeats: int) -> Measured:
    """Run a warm-up step and a measured step of `config`'s trainer, then time the forward/backward passes.

    Bare and trainer passes (and the trainer with the earlier grouping, and without the context's gradient)
    alternate on the same batch, `repeats` times each: the best of each is compared, as the machine may be shared.
    The targets compare full-gradient passes; the gradient through the model's own tokens only
    (``--no-context-grad``) is timed beside them on the same batch.
    """
    run = TrainingRun(config)
    trainer = run.learner  # the GRPO family's learner: its passes are timed
    try:
        warm_up = trainer.collect_rollouts()  # first-call allocations, lazy initialisation
        trainer.update(warm_up)
        rollouts = trainer.collect_rollouts()
        metrics = trainer.update(rollouts)
        batch, sft = rollouts.batch, None
        rl_lengths = [warm_up.batch["attention_mask"].sum(-1).tolist(), batch["attention_mask"].sum(-1).tolist()]
        batches = [(batch, trainer.rl_micro_batches(batch))]
        sft_lengths: list[list[int]] = []
        if "loss_sft" in metrics:
            sft = trainer.sft_minibatch(run.step - 1)
            batches.append(
                (sft, micro_batches(sft["attention_mask"].sum(-1).tolist(), config.optim.micro_batch_tokens))
            )
            demo_lengths = [len(demo.token_ids) for demo in run.demos]
            sft_lengths = [[demo_lengths[i] for i in trainer.sft_indices(step)] for step in range(SFT_STEPS)]
        sft_coef = metrics.get("sft/weight", 1.0) * config.sft.sft_coef
        peak = matmul_peak(run.policy)["peak"] if run.device.type == "cpu" else None
        full, narrow = config.with_values(context_grad=True), config.with_values(context_grad=False)
        seconds: dict[str, list[float]] = {"bare": [], "trainer": [], "earlier": [], "narrow": []}
        seconds["trainer" if config.optim.context_grad else "narrow"].append(metrics["time/forward_backward"])
        for _ in range(repeats):
            bare, bare_tokens = bare_forward_backward(trainer, batches)
            seconds["bare"].append(bare)
            trainer.config = full
            seconds["trainer"].append(trainer_forward_backward(trainer, batch, sft, sft_coef))
            with earlier_grouping():
                seconds["earlier"].append(trainer_forward_backward(trainer, batch, sft, sft_coef))
            trainer.config = narrow
            seconds["narrow"].append(trainer_forward_backward(trainer, batch, sft, sft_coef))
        trainer.config = config
        flops = useful_flops(trainer, batch, sft)
        contexts = int(batch.batch_size[0])
        return Measured(metrics, contexts, rl_lengths, sft_lengths, seconds, bare_tokens, str(run.device), peak, flops)
    finally:
        run.close()


def summarise(config: Config, measured: Measured, repeats: int) -> dict[str, Any]:
    """The benchmark's result: the step's split, tokens/s, padding and FLOP shares, as `main` prints them."""
    metrics, seconds = measured.metrics, measured.seconds
    trainer_seconds = min(seconds["trainer"])
    trainer_tps = metrics["tokens/trained"] / trainer_seconds
    bare_tps = measured.bare_tokens / min(seconds["bare"])
    budget = config.optim.micro_batch_tokens
    padding = {
        "rl": padding_of(measured.rl_lengths, budget, 0.05),
        "rl_earlier": padding_of(measured.rl_lengths, budget, 1.0),
        "sft": padding_of(measured.sft_lengths, budget, 0.05),
        "sft_earlier": padding_of(measured.sft_lengths, budget, 1.0),
    }
    flops_share = None
    if measured.peak is not None:
        flops_share = {
            "trainer": measured.flops / trainer_seconds / measured.peak,
            "trainer_earlier_grouping": measured.flops / min(seconds["earlier"]) / measured.peak,
        }
    return {
        "device": measured.device,
        "model": config.model.model or "SmolLM2-135M-Instruct",
        "preset": config.run.preset,
        "questions_per_step": config.rl.questions_per_step,
        "group_size": config.rl.group_size,
        "contexts": measured.contexts,
        "tokens_sampled": metrics["tokens/sampled"],
        "tokens_trained": metrics["tokens/trained"],
        "time": {k.split("/", 1)[1]: metrics[k] for k in metrics if k.startswith("time/") and k != "time/elapsed"},
        "trainer_fwd_bwd_tokens_per_s": trainer_tps,
        "bare_fwd_bwd_tokens_per_s": bare_tps,
        "bare_tokens": measured.bare_tokens,
        "trainer_fwd_bwd_seconds": seconds["trainer"],
        "repeats": repeats,
        "env_share": metrics["time/env_and_retrieval"] / metrics["time/step"],
        "fwd_bwd_ratio": trainer_tps / bare_tps,
        "earlier_grouping_fwd_bwd_seconds": seconds["earlier"],
        "no_context_grad_fwd_bwd_seconds": seconds["narrow"],
        "no_context_grad_speedup": trainer_seconds / min(seconds["narrow"]),
        "padding_share": padding,
        "rl_lengths": measured.rl_lengths,
        "matmul_peak_flops": measured.peak,
        "useful_fwd_bwd_flops": measured.flops,
        "fwd_bwd_share_of_matmul_peak": flops_share,
    }


def print_split(config: Config, result: dict[str, Any], metrics: dict[str, float], bare_seconds: float) -> None:
    """Print the measured step's split and the forward/backward speeds."""
    step = metrics["time/step"]
    trainer_seconds, narrow_seconds = result["trainer_fwd_bwd_seconds"], result["no_context_grad_fwd_bwd_seconds"]
    print(
        f"train step on {result['device']}: {result['model']}, preset {config.run.preset}, "
        f"{config.rl.questions_per_step} questions x {config.rl.group_size} episodes = {result['contexts']} contexts, "
        f"{result['tokens_sampled']} sampled tokens, {result['tokens_trained']} trained tokens (RL + SFT)"
    )
    print(f"{'part':<28}{'seconds':>10}{'share':>9}")
    for key in ("generation", "env_and_retrieval", "old_logp", "forward_backward", "optimizer"):
        seconds = metrics[f"time/{key}"]
        print(f"{key:<28}{seconds:>10.2f}{seconds / step:>9.1%}")
    print(f"{'step (total)':<28}{step:>10.2f}{1:>9.1%}")
    print(f"training tokens/s in the step (trainer fwd/bwd): {metrics['tokens/s']:.0f}")
    print(
        f"trainer fwd/bwd tokens/s, best of {len(trainer_seconds)}:     {result['trainer_fwd_bwd_tokens_per_s']:.0f} "
        f"({metrics['tokens/trained']} tokens in {min(trainer_seconds):.2f} s)"
    )
    print(
        f"bare fwd/bwd tokens/s, same batch, best of {result['repeats']}: {result['bare_fwd_bwd_tokens_per_s']:.0f} "
        f"({result['bare_tokens']} tokens in {bare_seconds:.2f} s)"
    )
    print(
        f"trainer fwd/bwd with gradient through the model's own tokens only (--no-context-grad), best of "
        f"{len(narrow_seconds)}: {min(narrow_seconds):.2f} s = {result['no_context_grad_speedup']:.2f}x the full "
        f"gradient's speed, same batch, same log-probs"
    )


def print_checks(result: dict[str, Any]) -> None:
    """Print the checks against the targets."""
    verdict = lambda ok: "ok" if ok else "MISSED"
    env_share, ratio, padding = result["env_share"], result["fwd_bwd_ratio"], result["padding_share"]
    print(
        f"env+retrieval share of the step: {env_share:.1%} (target <= {ENV_SHARE_TARGET:.0%}: "
        f"{verdict(env_share <= ENV_SHARE_TARGET)})"
    )
    print(
        f"trainer / bare fwd+bwd tokens/s: {ratio:.2f} (target >= {FWD_BWD_RATIO_TARGET}: "
        f"{verdict(ratio >= FWD_BWD_RATIO_TARGET)})"
    )
    for part, what in (("rl", "RL batches of the 2 steps"), ("sft", f"SFT minibatches of steps 0-{SFT_STEPS - 1}")):
        share = padding[part]
        print(
            f"padding share of fwd/bwd tokens, {what}: {share:.1%} (earlier grouping: "
            f"{padding[part + '_earlier']:.1%}; target <= {PADDING_TARGET:.0%}: {verdict(share <= PADDING_TARGET)})"
        )
    flops_share = result["fwd_bwd_share_of_matmul_peak"]
    if flops_share is not None:
        share, peak, flops = flops_share["trainer"], result["matmul_peak_flops"], result["useful_fwd_bwd_flops"]
        trainer_seconds = min(result["trainer_fwd_bwd_seconds"])
        print(
            f"trainer fwd/bwd useful FLOP/s: {flops / trainer_seconds / 1e9:.1f} GFLOP/s = {share:.2f} of the "
            f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (target >= {PEAK_SHARE_TARGET}: "
            f"{verdict(share >= PEAK_SHARE_TARGET)}); earlier grouping {flops_share['trainer_earlier_grouping']:.2f}"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and return its numbers."""
    import argparse
    import sys

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--repeats", type=int, default=2)
    own, argv = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    config = parse_config(argv, algo="red_grpo", description=__doc__)
    run_dir = tempfile.mkdtemp(prefix="train-step-bench-")
    config = config.with_values(
        steps=2, save_every=0, run_dir=run_dir, wandb=False, progress=False, skip_zero_advantage=False
    )
    try:
        measured = measure(config, own.repeats)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    result = summarise(config, measured, own.repeats)
    print_split(config, result, measured.metrics, min(measured.seconds["bare"]))
    print_checks(result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
