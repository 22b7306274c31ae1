"""The built-in advantage estimators, each a function of one step's episodes: `StepInput` in, `Advantages` out.

    group         A_i = (r_i - mean_g r) / (std_g r + eps)      GRPO; --no-advantage-std-scale: r_i - mean_g r
    dr_grpo       A_i = r_i - mean_g r                          Dr. GRPO (arXiv 2503.20783)
    rloo          A_i = r_i - mean_{j in g, j != i} r_j         RLOO (Ahmadian et al. 2024)
    tree          A_i = group term + the same within i's tree   Tree-GRPO (arXiv 2509.21240)
    reinforce_pp  A_t = whiten over the batch's sampled tokens of the episode's reward      REINFORCE++ (2501.03262)
    gae           A_t = GAE(lambda) over the value head's per-token values, whitened        PPO
    q_minus_v     A_t = min(Q1, Q2)(s_k, a_k) - V(s_k) of the turn k holding token t, whitened over turns   ArCHer

A group whose rewards are all equal (or that holds one episode) gets advantage 0 exactly under group, dr_grpo,
rloo and tree. Episode advantages (``per="episode"``, ``(B,)``) are broadcast to every context of the episode, and
per-search credit (`algos.objectives.credit`) may add to them; token advantages are ``(N, T-1)`` in the collated layout
(column t scores token t+1). How to add one: `algos.objectives.registry`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from agents.records import Trajectory
from algos.objectives.losses import group_advantages, tree_advantages

__all__ = [
    "Advantages",
    "StepInput",
    "dr_grpo",
    "episode_gae",
    "gae",
    "gae_steps",
    "group",
    "leave_one_out",
    "q_minus_v",
    "reinforce_pp",
    "rloo",
    "token_rewards",
    "tree",
    "whiten",
]


@dataclass(frozen=True)
class StepInput:
    """What an estimator sees of one step.

    Args:
        episodes: The step's episodes (this rank's), in the order the batch's rows were collated.
        rewards: ``(B,)`` their rewards.
        group_id: ``(B,)`` their question groups.
        tree_id: ``(B,)`` their trees under ``--rollout tree`` (an episode of no tree, an expert member, is a tree of
            its own: ids -1, -2, ...); None when no episode belongs to a tree.
        batch: The collated rows ``(N,)``: ``episode_id``, ``loss_mask`` and ``old_logp`` ``(N, T-1)``, ...
        config: The run's settings (an estimator reads only those it honours).
        inputs: What the learner's own modules computed for its estimator (``needs``): PPO's ``old_values`` and
            ``kl`` ``(N, T-1)``; ArCHer's ``turn_adv`` ``(K,)`` and ``turn_spans`` ``(K, 3)`` (row, start, end).
        all_sum: Sums numbers over the data-parallel ranks (`algos.distributed.all_sum`); None: one process.
    """

    episodes: Sequence[Trajectory]
    rewards: Tensor
    group_id: Tensor
    tree_id: Tensor | None
    batch: TensorDict
    config: Any
    inputs: Mapping[str, Tensor] = field(default_factory=dict)
    all_sum: Callable[..., list[float]] | None = None

    @classmethod
    def of(cls, episodes: Sequence[Trajectory], batch: TensorDict, config: Any, **more: Any) -> StepInput:
        """The input of `episodes` and their collated `batch`, ids and rewards read off the episodes."""
        rewards = torch.tensor([t.reward for t in episodes], dtype=torch.float32)  # (B,)
        group_id = torch.tensor([t.group_id for t in episodes], dtype=torch.long)  # (B,)
        tree_id = None
        if any(t.tree_id is not None for t in episodes):
            own = iter(range(-1, -len(episodes) - 1, -1))  # the trees of their own, -1, -2, ...
            tree_id = torch.tensor([next(own) if t.tree_id is None else t.tree_id for t in episodes], dtype=torch.long)
        return cls(episodes, rewards, group_id, tree_id, batch, config, **more)


@dataclass(frozen=True)
class Advantages:
    """An estimator's output.

    Args:
        values: ``(B,)`` per episode or ``(N, T-1)`` per token (0 off the loss mask).
        metrics: Its metrics, ``critic/advantages/abs_mean`` among them (of its own advantages).
        tensors: More per-token tensors the learner's loss reads, set on the batch (GAE's ``returns``).
    """

    values: Tensor
    metrics: dict[str, float]
    tensors: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def per_token(self) -> bool:
        return self.values.ndim == 2


def _episode(adv: Tensor) -> Advantages:
    return Advantages(adv, {"critic/advantages/abs_mean": float(adv.abs().mean())})


def group(step: StepInput) -> Advantages:
    """GRPO's group-normalised advantage (`losses.group_advantages`); ``advantage_std_scale`` False centres."""
    return _episode(group_advantages(step.rewards, step.group_id, scale=step.config.rl.advantage_std_scale))


def dr_grpo(step: StepInput) -> Advantages:
    """Dr. GRPO: the reward minus its group's mean, with no std division."""
    return _episode(group_advantages(step.rewards, step.group_id, scale=False))


def tree(step: StepInput) -> Advantages:
    """Tree-GRPO: within the tree plus within the group (`losses.tree_advantages`); without trees, group."""
    scale = step.config.rl.advantage_std_scale
    if step.tree_id is None:
        return _episode(group_advantages(step.rewards, step.group_id, scale=scale))
    return _episode(tree_advantages(step.rewards, step.group_id, step.tree_id, scale=scale))


def leave_one_out(rewards: Tensor, group_id: Tensor) -> Tensor:
    """``(B,)``: each reward minus the mean of the other rewards of its group; 0 for a tied or one-episode group."""
    _, index = torch.unique(group_id, return_inverse=True)  # (B,) in 0..groups-1
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups).index_add_(0, index, torch.ones_like(rewards))  # (groups,)
    total = torch.zeros(groups).index_add_(0, index, rewards)  # (groups,)
    others = (total[index] - rewards) / (count[index] - 1).clamp_min(1)  # (B,)
    hi = torch.full((groups,), -math.inf).scatter_reduce(0, index, rewards, "amax")
    lo = torch.full((groups,), math.inf).scatter_reduce(0, index, rewards, "amin")
    flat = (hi == lo)[index]  # exact: a sum of equal floats over G - 1 can be off by an ulp
    return torch.where(flat, torch.zeros_like(rewards), rewards - others)


def rloo(step: StepInput) -> Advantages:
    """RLOO: the reward minus the mean of its group's other episodes (`leave_one_out`)."""
    return _episode(leave_one_out(step.rewards.float(), step.group_id))


def _token_metrics(adv: Tensor, mask: Tensor) -> dict[str, float]:
    return {"critic/advantages/abs_mean": float(adv[mask].abs().sum() / mask.sum().clamp_min(1))}


def reinforce_pp(step: StepInput) -> Advantages:
    """REINFORCE++: each sampled token's return (its episode's reward: one terminal reward, no discount) whitened over
    every sampled token of the batch, every rank's (verl's ``reinforce_plus_plus`` with the KL outside the reward)."""
    mask = step.batch["loss_mask"].bool()  # (N, T-1)
    returns = step.rewards.float()[step.batch["episode_id"]].unsqueeze(-1).expand(mask.shape)  # (N, T-1)
    adv = whiten(returns, mask, all_sum=step.all_sum)
    return Advantages(adv, _token_metrics(adv, mask))


def token_rewards(
    rewards: Tensor, mask: Tensor, episode_id: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
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


def gae_steps(rewards: Tensor, values: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over one trajectory of n steps (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_n = 0``: the last step is terminal),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns_t = A_t + V_t``.

    Args:
        rewards: ``(n,)`` per-step rewards.
        values: ``(n,)`` value estimates; treated as constants.

    Returns:
        ``(adv, returns)``, ``(n,)`` float32 each.
    """
    r, v = rewards.detach().double().tolist(), values.detach().double().tolist()
    adv = [0.0] * len(r)
    running = 0.0
    for t in reversed(range(len(r))):
        next_value = v[t + 1] if t + 1 < len(r) else 0.0
        running = r[t] + gamma * next_value - v[t] + gamma * lam * running
        adv[t] = running
    adv_t = torch.tensor(adv, dtype=torch.float32, device=values.device)  # (n,)
    return adv_t, adv_t + values.float()


def episode_gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, episode_id: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """`gae_steps` per episode over its sampled tokens, back in the padded ``(N, T-1)`` layout.

    An episode's steps are its sampled tokens (mask 1) in order: row by row in batch order (the order of
    ``Trajectory.generations``), left to right inside a row; prompt and observation tokens are not steps. The last
    sampled token of a generation bootstraps from the first of the episode's next generation; only the episode's
    last token is terminal.

    Returns:
        ``(adv, returns)``, ``(N, T-1)`` float32 each, 0 off the mask.
    """
    adv = torch.zeros(mask.shape, dtype=torch.float32)
    returns = torch.zeros(mask.shape, dtype=torch.float32)
    mask, token_rewards, values = mask.cpu().bool(), token_rewards.cpu(), values.cpu()
    for episode in episode_id.unique().tolist():
        rows = (episode_id.cpu() == episode).nonzero().flatten()
        keep = torch.zeros_like(mask)
        keep[rows] = mask[rows]  # row-major order of True positions = the episode's token order
        if not keep.any():
            continue
        a, r = gae_steps(token_rewards[keep], values[keep], gamma, lam)
        adv[keep], returns[keep] = a, r
    return adv, returns


def whiten(
    values: Tensor, mask: Tensor, eps: float = 1e-8, *, all_sum: Callable[..., list[float]] | None = None
) -> Tensor:
    """``(values - mean) / std`` over the masked entries (0 elsewhere); fewer than two entries: only centred.

    Args:
        values: Any shape.
        mask: Same shape; the entries that count.
        eps: Added to the std.
        all_sum: Sums numbers over the data-parallel ranks (`algos.distributed.all_sum`); given, the mean and the
            (unbiased) std are those of every rank's masked entries, from one all-reduce of their count, sum and
            sum of squares (float64), so N ranks whiten their shares as one process whitens the whole batch.
    """
    keep = mask.bool()
    picked = values[keep]
    if all_sum is not None:
        wide = picked.double()
        count, total, squares = all_sum(picked.numel(), float(wide.sum()), float(wide.square().sum()))
        if count == 0:
            return torch.zeros_like(values)
        mean = total / count
        centred = (wide - mean).to(values.dtype)
        if count > 1:
            std = math.sqrt(max(squares - total * mean, 0.0) / (count - 1))
            centred = centred / (std + eps)
        return torch.zeros_like(values).masked_scatter(keep, centred)
    if picked.numel() == 0:
        return torch.zeros_like(values)
    centred = picked - picked.mean()
    scaled = centred / (picked.std() + eps) if picked.numel() > 1 else centred
    return torch.zeros_like(values).masked_scatter(keep, scaled)


def _explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(R - V) / Var(R): how much of the returns' variance the value head explains (NaN if Var(R) = 0)."""
    if returns.numel() < 2 or float(returns.var()) == 0.0:
        return float("nan")
    return float(1.0 - (returns - values).var() / returns.var())


def gae(step: StepInput) -> Advantages:
    """PPO's GAE over per-token rewards (the episode's reward on its last sampled token, ``-kl_coef * kl`` on every
    one) and the value head's old values (``inputs["old_values"]``); whitened over every rank's sampled tokens with
    ``whiten_advantages``. ``returns`` go to the batch for the value loss."""
    cfg, batch = step.config, step.batch
    mask, old_values = batch["loss_mask"], step.inputs["old_values"]  # (N, T-1) each
    rewards_t = token_rewards(step.rewards, mask, batch["episode_id"], step.inputs.get("kl"), cfg.rl.kl_coef)
    adv, returns = episode_gae(rewards_t, old_values, mask, batch["episode_id"], cfg.gamma, cfg.gae_lambda)
    n = mask.sum().clamp_min(1)
    metrics = {
        "critic/advantages/abs_mean": float(adv[mask].abs().sum() / n),  # before whitening: GAE's own scale
        "critic/values/mean": float(old_values[mask].sum() / n),
        "critic/returns/mean": float(returns[mask].sum() / n),
        "critic/explained_variance": _explained_variance(old_values[mask], returns[mask]),
    }
    if cfg.whiten_advantages:  # data parallel: over every rank's sampled tokens
        adv = whiten(adv, mask, all_sum=step.all_sum)
    return Advantages(adv, metrics, {"returns": returns})


def q_minus_v(step: StepInput) -> Advantages:
    """ArCHer: each turn's ``min(Q1, Q2) - V`` (``inputs["turn_adv"]``, ``(K,)``), whitened over the batch's turns with
    ``whiten_advantages``, on every token the model sampled in the turn (``inputs["turn_spans"]``)."""
    turn_adv, mask = step.inputs["turn_adv"], step.batch["loss_mask"]  # (K,), (N, T-1)
    scaled = (
        whiten(turn_adv, torch.ones_like(turn_adv, dtype=torch.bool)) if step.config.whiten_advantages else turn_adv
    )
    adv = torch.zeros(mask.shape)  # (N, T-1)
    for (row, start, end), value in zip(step.inputs["turn_spans"].tolist(), scaled.tolist(), strict=True):
        adv[row, start - 1 : end - 1] = value  # column t scores token t+1
    return Advantages(
        torch.where(mask, adv, torch.zeros_like(adv)), {"critic/advantages/abs_mean": float(turn_adv.abs().mean())}
    )
