"""PPO: a token-level value head, GAE advantages and the clipped objective, on the shared training loop.

One step (the loop is the `algos.trainer.Trainer` learner's; this file only changes the advantages and the loss):

    trajectories = next(iter(collector)) records                   # B episodes (questions x group_size)
    batch = collate_trajectories(trajectories)                     # (N, T) contexts, (N, T-1) token tensors
    old_values = V(states)  [ref_logp = ref(tokens)]               # (N, T-1), no grad, before the update
    r_t = -kl_coef * kl(old_logp, ref_logp)_t  (+ episode reward on the episode's last sampled token)
    adv, returns = GAE(r, old_values; gamma, lambda)               # per episode, over its sampled tokens
    adv = whiten(adv)                                              # over the (global) batch's sampled tokens
    for epoch in range(update_epochs):                             # the same batch, one AdamW step each
        loss = loss_pg(logp, old_logp, adv; clip 0.2) + vf_coef * loss_value(V, old_values, returns; clip)

`PPOTrainer` says the choices a reader may need (critic, values, rewards, KL, data parallel).

Run (default env RedCoda-QueryRewrite-v0; the flat QA env with ``--env-id RedCoda-HotpotQA-v0``):

    python -m algos.ppo --preset tiny --run-dir /tmp/ppo-tiny
    python -m algos.ppo --preset cpu --torch-threads 1             # SmolLM2-135M on the query-rewrite task
    python -m algos.ppo --preset tiny --env-id RedCoda-HotpotQA-v0 --run-dir /tmp/ppo-qa
    python -m algos.ppo --help
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from agents.collate import collate_trajectories
from algos import distributed
from algos.batch import micro_batches
from algos.config import QUERY_REWRITE_ENV, Config
from algos.losses import kl_per_token, policy_loss
from algos.run.launch import main as train
from algos.run.training_run import TrainingRun
from algos.setting_checks import at_least, check_rules, positive, within
from algos.trainer import Trainer
from algos.value import ValueHead, episode_gae, logprobs_and_values, value_loss, whiten

__all__ = ["PPO_DEFAULTS", "PPO_PRESETS", "PPOConfig", "PPOTrainer", "main", "token_rewards"]


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


def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    episode_id: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every sampled token, plus each episode's reward on its last one.

    Args:
        rewards: ``(B,)`` episode rewards.
        mask: ``(N, T-1)`` bool, sampled tokens.
        episode_id: ``(N,)`` episode of each row; an episode's rows are in generation order.
        kl: ``(N, T-1)`` per-token KL estimate to the reference, or None.
        kl_coef: Its coefficient.

    Returns:
        ``(N, T-1)`` float32, 0 off the mask.
    """
    out = torch.zeros(mask.shape, dtype=torch.float32)
    if kl is not None and kl_coef:
        out = torch.where(mask, -kl_coef * kl.float().cpu(), out)
    for episode, reward in enumerate(rewards.tolist()):
        rows = (episode_id == episode).nonzero().flatten().tolist()
        last_row = next((row for row in reversed(rows) if mask[row].any()), None)
        if last_row is not None:  # an episode with no sampled token has no action to credit
            out[last_row, int(mask[last_row].nonzero().max())] += reward
    return out


class PPOTrainer(Trainer):
    """The shared loop with a value head, GAE advantages and a clipped value loss (the step: the module docstring).

    Choices a reader may need:

    - Critic: `algos.value.ValueHead`, one linear layer on the policy's last hidden state (shared backbone; the
      value loss also trains the backbone). It has its own learning rate (``--value-lr``); the backbone trains at
      ``--lr``. Its weights and AdamW state are in every checkpoint (``learner/value_head.*``).
    - Values are token-level: the value of the context up to each sampled token's predecessor (`algos.value`).
    - Rewards: the episode reward sits on the last sampled token of the episode's last generation. A
      multi-generation episode (CoDA: executor contexts, then the planner's) is chained in record order: GAE runs
      over the concatenation of its generations' sampled tokens, each generation's last token bootstrapping from
      the next generation's first (`algos.value.episode_gae`). Env observations are not steps.
    - KL to the frozen initial model (``--kl-coef`` > 0) is a per-token reward penalty (InstructGPT, TRL), with
      ``--kl-estimator`` k1 (``old_logp - ref_logp``), k2 or k3 (``exp(ref - old) - (ref - old) - 1``) at the
      sampled tokens: the GRPO family's ``loss_kl`` estimators (`algos.losses.kl_per_token`); not a loss term.
    - GRPO's groups are not needed (the value head is the baseline): the entry point defaults to group_size 1.
    - Data parallel (torchrun): each rank runs GAE on its own episodes (an episode never spans ranks) and the
      whitening's mean and std are the global batch's (one all-reduce of count, sum and sum of squares), so N ranks
      train what one process trains.
    """

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        explained = metrics.get("critic/explained_variance", float("nan"))
        return {**super().progress_fields(metrics), "ev": f"{explained:.3f}"}

    def __init__(self, run: TrainingRun) -> None:
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

    def make_batch(self, trajectories: Sequence[Any]) -> tuple[TensorDict, dict[str, float]]:
        cfg = self.config
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (B,)
        batch = collate_trajectories(trajectories, pad_token_id=self.run.pad_id)
        mask = batch["loss_mask"]  # (N, T-1)
        old_values = torch.zeros(mask.shape)  # (N, T-1)
        old_logp = torch.zeros(mask.shape)  # (N, T-1)
        ref_logp = torch.zeros(mask.shape) if self.run.ref_model is not None else None  # (N, T-1)
        lengths = batch["attention_mask"].sum(-1).tolist()
        with torch.no_grad(), self.autocast():
            for rows in micro_batches(lengths, cfg.optim.micro_batch_tokens):
                part = self._rows(batch, rows)
                index = torch.tensor(rows)
                logp, values = self._forward(part)  # (n, L-1) each
                old_values[index, : values.shape[1]] = values.float().cpu()
                old_logp[index, : logp.shape[1]] = logp.float().cpu()
                if ref_logp is not None:
                    ref, _ = self._logprobs(self.run.ref_model, part, temperature=cfg.rl.temperature)
                    ref_logp[index, : ref.shape[1]] = ref.float().cpu()
        if cfg.recompute_old_logp:
            batch["old_logp"] = torch.where(mask, old_logp, torch.zeros_like(old_logp))
        kl = None  # (N, T-1): KL(sampling policy || reference) at the sampled tokens
        if ref_logp is not None:
            kl = kl_per_token(batch["old_logp"], ref_logp, mask, cfg.rl.kl_estimator)
        rewards_t = token_rewards(rewards, mask, batch["episode_id"], kl, cfg.rl.kl_coef)  # (N, T-1)
        adv, returns = episode_gae(rewards_t, old_values, mask, batch["episode_id"], cfg.gamma, cfg.gae_lambda)
        raw_adv = adv
        if cfg.whiten_advantages:  # data parallel: over every rank's sampled tokens
            adv = whiten(adv, mask, all_sum=distributed.all_sum if self.run.world.enabled else None)
        batch["adv"] = adv  # (N, T-1)
        batch["returns"] = returns  # (N, T-1)
        batch["old_values"] = old_values  # (N, T-1)
        n = mask.sum().clamp_min(1)
        metrics = {
            "critic/advantages/abs_mean": float(raw_adv[mask].abs().sum() / n),
            "critic/values/mean": float(old_values[mask].sum() / n),
            "critic/returns/mean": float(returns[mask].sum() / n),
            "critic/explained_variance": _explained_variance(old_values[mask], returns[mask]),
        }
        if kl is not None:
            metrics["rl/kl_to_ref"] = float(kl[mask].sum() / n)
        return batch, metrics

    def rl_loss_terms(self, part: TensorDict, num_tokens: float) -> TensorDict:
        cfg = self.config
        mask = part["loss_mask"]  # (n, L-1)
        logp, values = self._forward(part)  # (n, L-1) each
        terms = policy_loss(
            logp, part["old_logp"], part["adv"], mask, cfg.rl.clip_eps, cfg.rl.clip_eps_high, num_tokens=num_tokens
        )
        loss_value, value_clip = value_loss(
            values, part["old_values"], part["returns"], mask, cfg.vf_clip, num_tokens=num_tokens
        )
        terms["loss_value"] = cfg.vf_coef * loss_value
        terms["value_clip_fraction"] = value_clip
        return terms


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R): how much of the returns' variance the value head explains (NaN if Var(R) = 0)."""
    if returns.numel() < 2 or float(returns.var()) == 0.0:
        return float("nan")
    return float(1.0 - (returns - values).var() / returns.var())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with PPO; returns the run summary."""
    return train(argv, algo="ppo", description=__doc__)


if __name__ == "__main__":
    main()
