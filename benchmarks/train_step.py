"""Where a training step's time goes, and how close the trainer's forward/backward is to a bare one.

Runs the RED trainer (same flags as ``python -m algos.red_grpo``; default preset cpu without CUDA, gpu
with it) for a warm-up step and one measured step, then times a bare forward + backward of the same
model on the same token batch (the step's RL micro-batches and its SFT minibatch: logits, plain
cross-entropy, backward; no masking, no loss terms). Prints the split of the measured step and the
checks against the targets:

- env + retrieval (rollout time outside the sampler) <= 5% of the step;
- the trainer's forward/backward tokens/s >= 0.8 x the bare forward/backward tokens/s.

The two forward/backward passes are timed alternately (``--repeats`` times each, after the measured
step) and the best of each is compared, so a busy shared machine skews neither side.

Every RL context runs forward/backward here (``skip_zero_advantage`` off), so the measured step does
the full work even when all rewards of a group tie.

    python -m benchmarks.train_step                       # cpu preset sizes on CPU, SmolLM2-135M
    python -m benchmarks.train_step --preset tiny         # seconds; a smoke test of the script
    python -m benchmarks.train_step --old-logp recompute  # include recomputed old log-probs
    python -m benchmarks.train_step --repeats 3           # more alternating fwd/bwd timings
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from algos.config import parse_config
from algos.trainer import Trainer, micro_batches

ENV_SHARE_TARGET = 0.05
FWD_BWD_RATIO_TARGET = 0.8


def bare_forward_backward(trainer: Trainer, batches: Sequence[tuple[TensorDict, list[list[int]]]]) -> tuple[float, int]:
    """Time forward + cross-entropy + backward of the trainer's model over the given micro-batches.

    Args:
        trainer: Supplies the model, device and autocast setting.
        batches: (padded batch, micro-batches of its row indices) pairs.

    Returns:
        (seconds, real tokens processed). Gradients are discarded.
    """
    model = trainer.policy
    model.train()
    tokens = 0
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch, groups in batches:
        for rows in groups:
            part = trainer._rows(batch, rows)
            ids, attn = part["input_ids"], part["attention_mask"]  # (n, L)
            with trainer._autocast():
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # (n, L, V)
                labels = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)  # (n, L-1)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss.backward()
            tokens += int(attn.sum())
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainer.optimizer.zero_grad(set_to_none=True)
    model.eval()
    return seconds, tokens


def trainer_forward_backward(trainer: Trainer, batch: TensorDict, sft: TensorDict | None, sft_coef: float) -> float:
    """Time the trainer's own forward/backward (RL micro-batches, then the SFT minibatch) on a given batch.

    Returns:
        Seconds. Gradients are discarded.
    """
    trainer.policy.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer._rl_backward(batch)
    if sft is not None:
        trainer._sft_backward(sft, sft_coef)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.policy.eval()
    return seconds


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and return its numbers."""
    import argparse
    import sys

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--repeats", type=int, default=2)
    own, argv = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    config = parse_config(argv, algo="red_grpo", description=__doc__)
    run_dir = tempfile.mkdtemp(prefix="train-step-bench-")
    config = dataclasses.replace(
        config, steps=2, save_every=0, run_dir=run_dir, wandb=False, progress=False, skip_zero_advantage=False
    )
    trainer = Trainer(config)
    try:
        trainer.train_step()  # warm-up: first-call allocations, lazy initialisation
        metrics = trainer.train_step()
        batch, sft = trainer.last_batch, None
        batches = [(batch, trainer.last_micro_batches)]
        if "loss_sft" in metrics:
            sft = trainer.sft_minibatch(trainer.step - 1)
            batches.append((sft, micro_batches(sft["attention_mask"].sum(-1).tolist(), config.micro_batch_tokens)))
        sft_coef = metrics.get("sft/weight", 1.0) * config.sft_coef
        # alternate bare and trainer passes on the same batch; best of each (the machine may be shared)
        trainer_seconds, bare_seconds = [metrics["time/forward_backward"]], []
        for _ in range(own.repeats):
            seconds, bare_tokens = bare_forward_backward(trainer, batches)
            bare_seconds.append(seconds)
            trainer_seconds.append(trainer_forward_backward(trainer, batch, sft, sft_coef))
        bare_seconds = min(bare_seconds)
    finally:
        trainer.close()
        shutil.rmtree(run_dir, ignore_errors=True)

    step = metrics["time/step"]
    trainer_tps = metrics["tokens/trained"] / min(trainer_seconds)
    bare_tps = bare_tokens / bare_seconds
    env_share = metrics["time/env_and_retrieval"] / step
    ratio = trainer_tps / bare_tps
    result = {
        "device": str(trainer.device),
        "model": config.model or "SmolLM2-135M-Instruct",
        "preset": config.preset,
        "questions_per_step": config.questions_per_step,
        "group_size": config.group_size,
        "contexts": int(trainer.last_batch.batch_size[0]),
        "tokens_sampled": metrics["tokens/sampled"],
        "tokens_trained": metrics["tokens/trained"],
        "time": {k.split("/", 1)[1]: metrics[k] for k in metrics if k.startswith("time/") and k != "time/elapsed"},
        "trainer_fwd_bwd_tokens_per_s": trainer_tps,
        "bare_fwd_bwd_tokens_per_s": bare_tps,
        "bare_tokens": bare_tokens,
        "trainer_fwd_bwd_seconds": trainer_seconds,
        "repeats": own.repeats,
        "env_share": env_share,
        "fwd_bwd_ratio": ratio,
    }
    print(
        f"train step on {result['device']}: {result['model']}, preset {config.preset}, "
        f"{config.questions_per_step} questions x {config.group_size} episodes = {result['contexts']} contexts, "
        f"{result['tokens_sampled']} sampled tokens, {result['tokens_trained']} trained tokens (RL + SFT)"
    )
    print(f"{'part':<28}{'seconds':>10}{'share':>9}")
    for key in ("generation", "env_and_retrieval", "old_logp", "forward_backward", "optimizer"):
        seconds = metrics[f"time/{key}"]
        print(f"{key:<28}{seconds:>10.2f}{seconds / step:>9.1%}")
    print(f"{'step (total)':<28}{step:>10.2f}{1:>9.1%}")
    print(f"training tokens/s in the step (trainer fwd/bwd): {metrics['tokens/s']:.0f}")
    print(
        f"trainer fwd/bwd tokens/s, best of {len(trainer_seconds)}:     {trainer_tps:.0f} "
        f"({metrics['tokens/trained']} tokens in {min(trainer_seconds):.2f} s)"
    )
    print(
        f"bare fwd/bwd tokens/s, same batch, best of {own.repeats}: {bare_tps:.0f} "
        f"({bare_tokens} tokens in {bare_seconds:.2f} s)"
    )
    verdict = lambda ok: "ok" if ok else "MISSED"
    print(
        f"env+retrieval share of the step: {env_share:.1%} (target <= {ENV_SHARE_TARGET:.0%}: "
        f"{verdict(env_share <= ENV_SHARE_TARGET)})"
    )
    print(
        f"trainer / bare fwd+bwd tokens/s: {ratio:.2f} (target >= {FWD_BWD_RATIO_TARGET}: "
        f"{verdict(ratio >= FWD_BWD_RATIO_TARGET)})"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
