"""The seam between a run and its algorithm: `Learner`, the base class of every learner a run holds.

`algos.run.training_run.TrainingRun` builds the model, sampler, collector, demonstrations and optimizer, then the
learner its algorithm names (`algos.registry.Algorithm.learner_class`), and calls it: its parameter groups when the
optimizer is built, `Learner.train_step` or `Learner.sft_step` each step, its state in every checkpoint, its numbers
on the progress bar. The learner makes the batch, its loss terms and its metrics; it reaches the run's parts through
``self.run`` (``self.run.policy``, ``self.run.optimizer``, ``self.run.finish_update()``, ...). The GRPO family's
learner, which the others build on, is `algos.learners.trainer.Trainer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["Learner", "RunParts", "sync"]


def sync() -> None:
    """Wait for the GPU, so a timer around GPU work measures it (nothing to do on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class RunParts(Protocol):
    """The parts of a run a learner may use (`algos.run.training_run.TrainingRun` has them); no learner imports the
    run itself. The sampler's counters are the run's: a learner starts them (``sampler.reset()``) or leaves a block
    out of them (``sampler.uncounted()``), never writes them."""

    config: Any
    policy: torch.nn.Module
    ref_model: torch.nn.Module | None
    sampler: Any  # timed: .seconds, .tokens, .reset(), .uncounted()
    collector: Any  # agents.collector: .collect(n), .envs
    agent: Any
    tokenizer: Any
    demos: Sequence[Any]
    optimizer: torch.optim.Optimizer
    trainable: Sequence[torch.nn.Parameter]
    weighting: Any  # algos.objectives.weighting.SFTWeighting
    device: torch.device
    world: Any  # algos.distributed.World
    fsdp: bool
    masked_head: bool
    pad_id: int
    step: int

    def finish_update(self, push: bool = True) -> float | None: ...
    def sync_gradients(self) -> None: ...
    def matched_passes(self, passes: int) -> contextlib.AbstractContextManager: ...
    def full_weights(self) -> contextlib.AbstractContextManager: ...


class Learner:
    """What a run calls of its algorithm; a learner subclasses it (the run never imports a concrete one).

    A learner is built once its run has its model, sampler, collector and demonstrations, before the optimizer (so
    its own modules join it: `param_groups`).

    Args:
        run: The run that holds this learner (`RunParts`: what of it a learner may use).
    """

    def __init__(self, run: RunParts) -> None:
        self.run = run
        self.config = run.config

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups the run's optimizer trains besides the policy's (e.g. a value head, its own lr)."""
        return []

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The learner's checkpoint state: tensors by name (saved with the weights) and JSON-able values."""
        return {}, {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; state this learner does not know is refused."""
        if tensors or state:
            listing = sorted(tensors)[:3] or sorted(state)[:3]
            raise ValueError(f"checkpoint holds learner state ({listing}) that {self.config.run.algo} lacks")

    def train_step(self) -> dict[str, float]:
        """One RL step (rollouts and an update); returns the step's metrics row."""
        raise NotImplementedError(f"{type(self).__name__} has no RL step")

    def sft_step(self) -> dict[str, float]:
        """One supervised step on the run's demonstrations; returns the step's metrics row."""
        raise NotImplementedError(f"{type(self).__name__} has no SFT step")

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        """The few numbers the progress bar shows after a step: reward, answer F1 where the env scores answers,
        the SFT weight when the algorithm has an SFT term. Learners with their own key numbers extend it."""
        fields = {"reward": f"{metrics['critic/rewards/mean']:.2f}"}
        if "answer_f1/mean" in metrics:
            fields["f1"] = f"{metrics['answer_f1/mean']:.3f}"
        if self.run.weighting.uses_sft:
            fields["w"] = f"{metrics.get('sft/weight', 0.0):.2f}"
        return fields
