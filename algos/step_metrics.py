"""What one training step produced and how it is logged: the step's episodes and batch (`Rollouts`), and the
metrics row the `algos.learners.trainer.Trainer` learner returns for metrics.jsonl (`step_metrics`,
`sft_step_metrics`), from its run's counters (`algos.run.training_run.TrainingRun`: the step, the optimizer's lr, the
weighting rule, the sampler's clock)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from agents.records import Trajectory
from algos import distributed
from envs.metrics import episode_metrics

__all__ = ["Rollouts", "peak_memory", "rewards_tied", "sft_step_metrics", "step_metrics"]

_LOGGED_AS = {
    "f1": "answer_f1/mean",
    "em": "answer_em/mean",
    "format": "format_scores/mean",
    "refine": "refine_scores/mean",
}
"""Names of the episode metrics logged under the seed's names; the others are logged as ``env/<name>``."""


@dataclass(frozen=True)
class Rollouts:
    """One step's episodes and RL batch, measured and ready for the update (`Trainer.collect_rollouts`)."""

    batch: TensorDict
    """This rank's RL batch, advantages and old log-probs included (`Trainer.make_batch`), TorchRL's LLM keys beside
    ours (`agents.torchrl_layout`)."""
    episodes: list[Trajectory]
    """Every rank's episodes (data parallel: gathered)."""
    rewards: torch.Tensor
    """``(B,)``: every rank's episode rewards."""
    batch_metrics: dict[str, float]
    """What `Trainer.make_batch` measured, as the mean over the ranks."""
    rl_entropy: float
    """Token-mean entropy estimate of the sampled tokens, over the global batch."""
    accuracy: float
    """RED's batch accuracy: the share of every rank's episodes whose answer has F1 > 0 (`answer_accuracy`)."""
    retrieval_error_rate: float
    """Share of the step's searches that failed."""
    sampler_error_rate: float
    """Share of the step's episodes with a failed generation."""
    started: float
    """`time.perf_counter` when the step began."""
    t_rollout: float
    """Seconds of the rollouts (sampling, env and retrieval)."""
    t_old_logp: float
    """Seconds from the rollouts' end through `Trainer.make_batch`."""


def step_metrics(
    run: Any, rollouts: Rollouts, metrics: dict[str, float], grad_norm: float, timings: dict[str, float]
) -> dict[str, float]:
    """The metrics row of an RL step of `run`: the update's `metrics`, the episodes', the batch's, the timings."""
    batch, rewards, sampler = rollouts.batch, rollouts.rewards, run.sampler
    episodes = [episode_metrics(t.info) for t in rollouts.episodes]  # what the env reports: answered, em, f1...
    names = dict.fromkeys(name for episode in episodes for name in episode)
    sampled = int(distributed.all_sum(float(batch["loss_mask"].sum()))[0])  # data parallel: every rank's
    trained = metrics.pop("tokens/trained_rl") + metrics.pop("tokens/trained_sft", 0)
    t_fwd_bwd = timings["time/forward_backward"]
    metrics.update(
        {
            "step": run.step,
            "total_loss": sum(v for k, v in metrics.items() if k.startswith("loss_")),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/rewards/max": float(rewards.max()),
            "critic/rewards/min": float(rewards.min()),
            **rollouts.batch_metrics,
            **{_LOGGED_AS.get(k, f"env/{k}"): _mean([e[k] for e in episodes if k in e]) for k in names},
            "env/retrieval_error_rate": rollouts.retrieval_error_rate,
            "train/sampler_error_rate": rollouts.sampler_error_rate,
            "train/batch_accuracy": rollouts.accuracy,
            "train/questions": len({t.group_id for t in rollouts.episodes}),
            "train/episodes": len(rollouts.episodes),
            "train/rl_entropy": rollouts.rl_entropy,
            "train/grad_norm": grad_norm,
            "train/lr": run.optimizer.param_groups[0]["lr"],
            **run.weighting.metrics(),
            "time/step": time.perf_counter() - rollouts.started,
            "time/rollout": rollouts.t_rollout,
            "time/generation": sampler.seconds,
            "time/env_and_retrieval": rollouts.t_rollout - sampler.seconds,
            "time/old_logp": rollouts.t_old_logp,
            "time/forward_backward": t_fwd_bwd,
            **{k: v for k, v in timings.items() if k != "time/forward_backward"},
            "tokens/sampled": sampled,
            "tokens/trained": trained,
            "tokens/s": trained / t_fwd_bwd if t_fwd_bwd > 0 else 0.0,
            "tokens/s_generation": sampler.tokens / sampler.seconds if sampler.seconds else 0.0,
            **(sampler.lever_metrics() if hasattr(sampler, "lever_metrics") else {}),
            **peak_memory(run.device),
        }
    )
    return metrics


def sft_step_metrics(
    run: Any, metrics: dict[str, float], grad_norm: float, started: float, t_fwd_bwd: float
) -> dict[str, float]:
    """The metrics row of a supervised step (``python -m algos.sft``): no episodes, so reward and F1 are NaN."""
    trained = metrics.pop("tokens/trained_sft")
    metrics.update(
        {
            "step": run.step,
            "total_loss": metrics["loss_sft"],
            "sft/weight": 1.0,
            "critic/rewards/mean": float("nan"),
            "answer_f1/mean": float("nan"),
            "train/grad_norm": grad_norm,
            "train/lr": run.optimizer.param_groups[0]["lr"],
            "time/step": time.perf_counter() - started,
            "time/forward_backward": t_fwd_bwd,
            "tokens/trained": trained,
            "tokens/s": trained / t_fwd_bwd if t_fwd_bwd > 0 else 0.0,
        }
    )
    return metrics


def peak_memory(device: torch.device) -> dict[str, float]:
    """``memory/peak_gib``: the most GPU memory torch held since the last call (which starts the next window); {} on a
    CPU."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"memory/peak_gib": peak}


def rewards_tied(trajectories: Sequence[Trajectory]) -> bool:
    """Whether every GRPO group's episodes scored the same reward (so every group advantage is 0)."""
    groups: dict[int, set[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, set()).add(float(t.reward))
    return all(len(rewards) == 1 for rewards in groups.values())


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0
