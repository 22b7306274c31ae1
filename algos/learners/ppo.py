"""PPO's learner and settings (`python -m algos.ppo` trains it; its step: that module's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from algos import distributed
from algos.config import QUERY_REWRITE_ENV, Config
from algos.learners.trainer import Trainer
from algos.learners.value import ValueHead, logprobs_and_values, value_loss
from algos.objectives.losses import kl_per_token
from algos.objectives.policy_losses import LossScale
from algos.run.learner import RunParts
from algos.setting_checks import at_least, check_rules, positive, within

__all__ = ["PPO_DEFAULTS", "PPO_PRESETS", "PPOConfig", "PPOTrainer"]


@dataclass(frozen=True)
class PPOConfig(Config):
    """Settings of a PPO run: the shared ones and the value head's."""

    gamma: float = 1.0
    """Discount per sampled token in GAE."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    vf_coef: float = 0.1
    """Coefficient of the value loss."""
    value_lr: float = 1e-4
    """AdamW learning rate of the value head (the shared backbone trains at lr)."""
    vf_clip: float | None = 0.2
    """Clip of the new value around the old one in the value loss; None: no value clipping."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch's sampled tokens (mean 0, std 1)."""

    def validate(self) -> None:
        super().validate()
        check_rules(
            self,
            (
                ("gamma", within(0, 1), "in [0, 1]"),
                ("gae_lambda", within(0, 1), "in [0, 1]"),
                ("vf_coef", at_least(0), ">= 0"),
                ("value_lr", positive, "> 0"),
                ("vf_clip", positive, "> 0"),
            ),
        )


PPO_DEFAULTS: dict[str, object] = {
    "env": QUERY_REWRITE_ENV,
    "protocol": "flat",  # whatever the preset's: the query-rewrite env has no other, and PPO scores flat episodes
    "group_size": 1,
    "update_epochs": 2,
    "kl_coef": 0.02,
    "kl_estimator": "k1",
    "value_lr": 1e-4,
}
"""PPO's defaults over every preset's (`algos.registry`: the precedence rule of `Algorithm.defaults_for`)."""

PPO_PRESETS: dict[str, dict[str, object]] = {
    "gpu": {"questions_per_step": 64, "lr": 1e-6},
    "cpu": {
        "steps": 8,
        "questions_per_step": 8,
        "max_new_tokens": 48,
        "max_context_tokens": 1024,
        "lr": 2e-6,
        "save_every": 4,
    },
    "tiny": {"questions_per_step": 4, "max_new_tokens": 12, "value_lr": 1e-2},
}
"""Per-preset PPO defaults over `PPO_DEFAULTS` (flags still override them)."""


class PPOTrainer(Trainer):
    """The shared loop with a value head, GAE advantages and a clipped value loss (the step: the module docstring).

    Choices a reader may need:

    - Critic: `algos.learners.value.ValueHead`, one linear layer on the policy's last hidden state (shared backbone; the
      value loss also trains the backbone). It has its own learning rate (``--value-lr``); the backbone trains at
      ``--lr``. Its weights and AdamW state are in every checkpoint (``learner/value_head.*``).
    - Values are token-level: the value of the context up to each sampled token's predecessor (`algos.learners.value`).
    - Rewards: the episode reward sits on the last sampled token of the episode's last generation. A
      multi-generation episode (CoDA: executor contexts, then the planner's) is chained in record order: GAE runs
      over the concatenation of its generations' sampled tokens, each generation's last token bootstrapping from
      the next generation's first (`algos.learners.value.episode_gae`). Env observations are not steps.
    - KL to the frozen initial model (``--kl-coef`` > 0) is a per-token reward penalty (InstructGPT, TRL), with
      ``--kl-estimator`` k1 (``old_logp - ref_logp``), k2 or k3 (``exp(ref - old) - (ref - old) - 1``) at the
      sampled tokens: the GRPO family's ``loss_kl`` estimators (`algos.objectives.losses.kl_per_token`); not a loss
      term.
    - GRPO's groups are not needed (the value head is the baseline): the entry point defaults to group_size 1.
    - Data parallel (torchrun): each rank runs GAE on its own episodes (an episode never spans ranks) and the
      whitening's mean and std are the global batch's (one all-reduce of count, sum and sum of squares), so N ranks
      train what one process trains.
    """

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        explained = metrics.get("critic/explained_variance", float("nan"))
        return {**super().progress_fields(metrics), "ev": f"{explained:.3f}"}

    def __init__(self, run: RunParts) -> None:
        super().__init__(run)
        policy = run.policy
        if not (hasattr(policy, "get_decoder") and hasattr(policy, "get_output_embeddings")):
            raise ValueError("PPO needs a causal LM with get_decoder() and get_output_embeddings() for its value head")
        self.value_head = ValueHead(int(policy.config.hidden_size)).to(run.device)

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": list(self.value_head.parameters()), "lr": self.config.value_lr, "weight_decay": 0.0}]

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, state = super().state_dict()
        return {**tensors, **{f"value_head.{k}": v for k, v in self.value_head.state_dict().items()}}, state

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        weights = {k.removeprefix("value_head."): v for k, v in tensors.items() if k.startswith("value_head.")}
        self.value_head.load_state_dict(weights)
        super().load_state_dict({k: v for k, v in tensors.items() if not k.startswith("value_head.")}, state)

    def _forward(self, part: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        return distributed.as_forward(  # --fsdp: decoder and LM head called apart, inside the root's forward hooks
            self.run.policy,
            logprobs_and_values,
            self.run.policy,
            self.value_head,
            part["input_ids"],
            part["attention_mask"],
            part["loss_mask"],
            temperature=self.config.rl.temperature,
            context_grad=self.config.optim.context_grad,
        )

    # --- the shared make_batch's steps: values (and reference log-probs) in the one scoring pass, then GAE -------
    def scored_keys(self) -> tuple[str, ...]:
        ref = ("ref_logp",) if self.run.ref_model is not None else ()
        return (*super().scored_keys(), "old_values", *ref)

    def old_scores(self, part: TensorDict) -> dict[str, torch.Tensor]:
        logp, values = self._forward(part)  # (n, L-1) each: the old log-probs and values from one pass
        scores = {"old_logp": logp, "old_values": values}
        if self.run.ref_model is not None:
            scores["ref_logp"], _ = self._logprobs(self.run.ref_model, part, temperature=self.config.rl.temperature)
        if not self.config.recompute_old_logp:
            del scores["old_logp"]
        return scores

    def advantage_inputs(
        self, episodes: Sequence[Any], batch: TensorDict, metrics: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """The value head's old values, and the per-token KL(sampling policy || reference) that GAE's rewards take
        (`algos.objectives.advantages.gae`)."""
        inputs = {"old_values": batch["old_values"]}
        if "ref_logp" in batch.keys():
            mask = batch["loss_mask"]
            kl = kl_per_token(batch["old_logp"], batch["ref_logp"], mask, self.config.rl.kl_estimator)  # (N, T-1)
            inputs["kl"] = kl
            metrics["rl/kl_to_ref"] = float(kl[mask].sum() / mask.sum().clamp_min(1))
        return inputs

    def rl_loss_terms(self, part: TensorDict, scale: LossScale) -> TensorDict:
        cfg = self.config
        mask = part["loss_mask"]  # (n, L-1)
        logp, values = self._forward(part)  # (n, L-1) each
        terms = self.pg_terms(part, logp, mask, scale)
        loss_value, value_clip = value_loss(
            values, part["old_values"], part["returns"], mask, cfg.vf_clip, num_tokens=scale.all_tokens
        )
        terms["loss_value"] = cfg.vf_coef * loss_value
        terms["value_clip_fraction"] = value_clip
        return terms
