"""GRPO loss terms as pure functions of tensors.

Every function here takes per-token tensors in the layout made by `algos.batch` (position t of a
`(N, T-1)` tensor is about token t+1 of `input_ids`) and a float or bool mask of the same shape that is
1 on the tokens the loss sees. Loss terms are returned under keys named ``loss_*`` and summed by
`total_loss`, as TorchRL objectives do, so a trainer adds a term by adding a key (how the step uses them:
`algos.learners.trainer`'s docstring, the one statement of the step; its SFT term runs as a pass of its own):

    terms = policy_loss(logp, batch["old_logp"], batch["adv"], batch["loss_mask"])
    total_loss(terms).backward()

Normalization: token-level mean over every masked token of the batch (DAPO, Search-R1's
``token-mean``), not a per-sequence mean. Each sampled token then carries the same weight whatever the
length of the context it sits in: a CoDA episode's short executor answers do not outweigh the
planner's long reasoning, and how many contexts an episode was split into does not change how much its
tokens count. Every function takes ``num_tokens`` so a trainer that splits a batch into micro-batches
(gradient accumulation) can divide by the token count of the whole batch and get the same gradient.

TorchRL's ``GRPOLoss`` computes the same clipped objective over the TorchRL keys every batch also carries
(`agents.torchrl_layout`), with its own actor wrapper and ``masking_strategy="rlhf"``; ``tests/test_torchrl_loss.py``
checks it against `loss_pg`, and docs/method.md ("TorchRL") says where the two differ. These functions work on
the plain tensors, so that the SFT, expert and value terms sit beside the policy term.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

__all__ = [
    "clipped_objective",
    "entropy_estimate",
    "group_advantages",
    "kl_penalty",
    "kl_per_token",
    "masked_mean",
    "policy_loss",
    "sampler_mismatch",
    "sft_loss",
    "tis_weights",
    "total_loss",
    "tree_advantages",
]


def masked_mean(values: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Sum of ``values`` over masked positions divided by the number of masked positions.

    Unmasked positions are selected away (not multiplied by 0), so inf or NaN there never leak into the
    result or its gradient.

    Args:
        values: Per-token values, any shape.
        mask: Same shape as ``values``; nonzero where a token counts.
        num_tokens: Divisor to use instead of ``mask.sum()`` (the whole batch's count when ``values`` is
            one micro-batch of it). An empty mask gives 0, never NaN.

    Returns:
        A scalar tensor.
    """
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    if num_tokens is None:
        num_tokens = keep.sum()
    return total / torch.as_tensor(num_tokens, dtype=values.dtype, device=values.device).clamp_min(1)


def group_advantages(rewards: Tensor, group_id: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO advantages: each episode's reward minus its group's mean, divided by the group's std.

    A group is the G rollouts of one question. The std is the unbiased sample std (``torch.std``, as
    verl's GRPO estimator, which Search-R1 trains with). A group whose rewards are all equal (or that
    holds a single episode) has no signal and gets advantage 0 exactly, whatever ``eps``.

    Args:
        rewards: Episode rewards, shape ``(B,)``.
        group_id: Integer group of each episode, shape ``(B,)``; any values, need not be contiguous.
        eps: Added to the std before dividing.
        scale: Divide by the group std (GRPO). False keeps only the mean-centering (Dr. GRPO).

    Returns:
        Advantages, shape ``(B,)``, same dtype as ``rewards``.
    """
    if rewards.ndim != 1 or rewards.shape != group_id.shape:
        raise ValueError(f"rewards and group_id must both be (B,), got {rewards.shape} and {group_id.shape}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    _, group = torch.unique(group_id, return_inverse=True)  # (B,) in 0..num_groups-1
    num_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group, torch.ones_like(rewards)
    )  # (num_groups,)
    mean = torch.zeros_like(count).index_add_(0, group, rewards) / count  # (num_groups,)
    centered = rewards - mean[group]  # (B,)
    sq = torch.zeros_like(count).index_add_(0, group, centered.square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()  # (num_groups,)
    # Exact equality, not std < tol: a mean of equal floats can be off by one ulp.
    hi = torch.full_like(count, -torch.inf).scatter_reduce(0, group, rewards, "amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce(0, group, rewards, "amin")
    flat = (hi == lo)[group]  # (B,)
    adv = centered / (std[group] + eps) if scale else centered
    return torch.where(flat, torch.zeros_like(adv), adv)


def tree_advantages(
    rewards: Tensor, group_id: Tensor, tree_id: Tensor, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """Tree-GRPO advantages (arXiv 2509.21240): the episode's advantage within its tree plus within its question's
    group, each as `group_advantages` computes it.

    A tree's episodes share their first turns (`agents.tree`), so the within-tree term compares continuations of
    the same turns: trained on every episode's tokens, the shared turns collect the sum of their episodes' terms and
    the turns where the episodes part get each branch's own (Tree-GRPO shows the within-tree objective equals
    step-level preference learning). The within-group term compares the trees. A tree of one episode, or of equal
    rewards, adds 0.

    Args:
        rewards: Episode rewards, shape ``(B,)``.
        group_id: Each episode's question group, ``(B,)``.
        tree_id: Each episode's tree, ``(B,)``; a tree lies within one group.
        eps: Added to each std before dividing.
        scale: Divide each term by its std (GRPO); False only centres them (Dr. GRPO).

    Returns:
        Advantages, shape ``(B,)``.
    """
    within_tree = group_advantages(rewards, tree_id, eps=eps, scale=scale)
    return within_tree + group_advantages(rewards, group_id, eps=eps, scale=scale)


def clipped_objective(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per token, with ``r = exp(logp - old_logp)``: ``max(-adv * r, -adv * clip(r, 1 - clip_eps, 1 + clip_eps_high))``.

    Args: as `policy_loss`'s.

    Returns:
        ``(per_token (N, L), clip_fraction, approx_kl)``: the objective at every position (off the mask the ratio is
        1), the share of masked tokens whose ratio lies outside the clip window and the k3 estimate of
        KL(old || current) over them (both detached scalars).
    """
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)  # (N, 1), broadcasts over tokens
    keep = mask.bool()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    # Zero the log-ratio off the mask before exp: garbage there (e.g. -inf padding) would give inf * 0.
    log_ratio = torch.where(keep, logp - old_logp.detach(), torch.zeros((), dtype=logp.dtype, device=logp.device))
    ratio = log_ratio.exp()  # (N, L)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(pg_unclipped, pg_clipped)  # (N, L)
    with torch.no_grad():
        outside = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)).to(logp.dtype)
        clip_fraction = masked_mean(outside, mask)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mask)
    return per_token, clip_fraction, approx_kl


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    num_tokens: float | Tensor | None = None,
    is_weight: Tensor | None = None,
) -> TensorDict:
    """Clipped token-level policy-gradient loss (PPO/GRPO), averaged over masked tokens.

    Per token, with ``r = exp(logp - old_logp)``: ``max(-adv * r, -adv * clip(r, 1 - clip_eps,
    1 + clip_eps_high))``, times the token's importance weight when one is given (`tis_weights`); then the
    masked token mean (see the module docstring).

    Args:
        logp: Log-probs of the taken tokens under the current policy, ``(N, L)``, differentiable.
        old_logp: Log-probs under the sampling policy, ``(N, L)``; treated as constants.
        adv: Advantage per generation ``(N,)`` (broadcast over tokens) or per token ``(N, L)``.
        mask: ``(N, L)``, nonzero on tokens the loss sees.
        clip_eps: Lower clip, ratio floor ``1 - clip_eps``.
        clip_eps_high: Upper clip, ratio ceiling ``1 + clip_eps_high``; None uses ``clip_eps``
            (DAPO's clip-higher sets it larger, e.g. 0.28).
        num_tokens: Divisor instead of ``mask.sum()`` (see `masked_mean`).
        is_weight: Per-token weights ``(N, L)`` of a sampler that is not the policy ``old_logp`` came from
            (truncated importance sampling, `tis_weights`); treated as constants. None: all 1.

    Returns:
        A TensorDict (batch size ``[]``) with ``loss_pg`` (differentiable scalar), ``clip_fraction``
        (share of masked tokens whose ratio lies outside the clip window) and ``approx_kl`` (k3 estimate of
        KL(old || current) over masked tokens, ``mean(r - 1 - log r)``), both detached.
    """
    per_token, clip_fraction, approx_kl = clipped_objective(logp, old_logp, adv, mask, clip_eps, clip_eps_high)
    if is_weight is not None:
        per_token = per_token * is_weight.detach().to(per_token.dtype)
    loss_pg = masked_mean(per_token, mask, num_tokens)
    return TensorDict({"loss_pg": loss_pg, "clip_fraction": clip_fraction, "approx_kl": approx_kl}, batch_size=[])


def sampler_mismatch(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far a sampler's log-probs are from the trainer's on the tokens the sampler drew.

    With ``d = old_logp - sampler_logp`` per masked token (the trainer's minus the sampler's): the mean ``|d|``, and
    the k3 estimate ``mean(exp(d) - d - 1)`` of KL(sampler || trainer), unbiased and >= 0 because the tokens were
    drawn from the sampler. Tokens whose sampler log-prob is not finite (a backend that returned none) are left out
    and counted.

    Args:
        old_logp: The trainer's log-probs of the sampled tokens ``(N, L)``.
        sampler_logp: The sampler's ``(N, L)``.
        mask: ``(N, L)``, nonzero on sampled tokens.

    Returns:
        ``mismatch/logp_abs_diff``, ``mismatch/kl`` and ``mismatch/missing`` (share of tokens left out).
    """
    keep = mask.bool()
    finite = keep & torch.isfinite(sampler_logp)
    # float64 and expm1: at the differences of float rounding (1e-6) exp(d) - d - 1 in float32 is all cancellation
    d = torch.where(finite, old_logp.detach().double() - sampler_logp.double(), torch.zeros((), dtype=torch.float64))
    count = int(finite.sum())
    if count == 0:
        return {"mismatch/logp_abs_diff": float("nan"), "mismatch/kl": float("nan"), "mismatch/missing": 1.0}
    return {
        "mismatch/logp_abs_diff": float(d.abs()[finite].mean()),
        "mismatch/kl": float((torch.expm1(d) - d)[finite].mean()),
        "mismatch/missing": 1.0 - count / max(int(keep.sum()), 1),
    }


def tis_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance weights ``min(exp(old_logp - sampler_logp), cap)`` per sampled token, 0 off the mask.

    The tokens were drawn by a sampler whose distribution differs slightly from the trainer's (other kernels, or
    weights pushed a few updates ago); weighting each token's policy-gradient term by this ratio corrects the
    expectation to the trainer's ``old_logp`` policy, and the cap bounds the variance (truncated importance sampling,
    as in Ionides 2008 and the TIS of verl and TRL). A token without a finite sampler log-prob gets weight 1.

    Args:
        old_logp: The trainer's log-probs of the sampled tokens ``(N, L)``.
        sampler_logp: The sampler's ``(N, L)``.
        mask: ``(N, L)``, nonzero on sampled tokens.
        cap: ``C``, the largest weight.

    Returns:
        ``(N, L)`` float weights, detached.
    """
    keep = mask.bool()
    d = torch.where(keep & torch.isfinite(sampler_logp), old_logp.float() - sampler_logp.float(), torch.zeros(()))
    return torch.where(keep, d.exp().clamp(max=cap), torch.zeros(())).detach()


def kl_per_token(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: Literal["k1", "k2", "k3"] = "k3") -> Tensor:
    """A sampled estimate of KL(current || reference) at each masked token (Schulman's estimators).

    With ``d = ref_logp - logp`` on tokens sampled from the current policy: k1 ``= -d`` (unbiased, high variance,
    can be negative), k2 ``= d**2 / 2``, k3 ``= exp(d) - d - 1`` (unbiased, always >= 0; the GRPO paper's choice).
    `kl_penalty` is its masked token mean (a loss term); PPO puts it into its per-token rewards.

    Args:
        logp: Current log-probs ``(N, L)``, differentiable (or the sampling policy's, as PPO's rewards use it).
        ref_logp: Reference-model log-probs ``(N, L)``; treated as constants.
        mask: ``(N, L)``, nonzero on tokens the estimate is for.
        kind: Which estimator.

    Returns:
        ``(N, L)``, 0 off the mask (where ``d`` is set to 0 before the estimator, so garbage there never leaks).
    """
    keep = mask.bool()
    d = torch.where(keep, ref_logp.detach() - logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return d.exp() - d - 1.0
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: Literal["k1", "k2", "k3"] = "k3",
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Masked token mean of a sampled estimate of KL(current || reference) (`kl_per_token`'s estimators).

    Args:
        logp: Current log-probs ``(N, L)``, differentiable.
        ref_logp: Reference-model log-probs ``(N, L)``; treated as constants.
        mask: ``(N, L)``, nonzero on tokens the penalty sees.
        kind: Which estimator: k1, k2 or k3 (`kl_per_token`).
        num_tokens: Divisor instead of ``mask.sum()`` (see `masked_mean`).

    Returns:
        A scalar tensor (multiply by a coefficient and store it as ``loss_kl``).
    """
    return masked_mean(kl_per_token(logp, ref_logp, mask, kind), mask, num_tokens)


def sft_loss(logp: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Masked cross-entropy: minus the token mean of the demonstration tokens' log-probs.

    Args:
        logp: Log-probs of the demonstration's next tokens ``(N, L)``, from `algos.batch.token_logprobs`
            (which is where logits become log-probs).
        mask: ``(N, L)``, nonzero on the assistant tokens.
        num_tokens: Divisor instead of ``mask.sum()`` (see `masked_mean`).

    Returns:
        A differentiable scalar tensor.
    """
    return -masked_mean(logp, mask, num_tokens)


def entropy_estimate(old_logp: Tensor, mask: Tensor) -> Tensor:
    """Entropy estimate of the sampling policy on an RL batch: ``-mean(old_logp)`` over masked tokens.

    Tokens sampled from a distribution have expected ``-log p`` equal to its entropy, so this needs no
    forward pass (RED's H_rl input).

    Args:
        old_logp: Sampling log-probs ``(N, L)``.
        mask: ``(N, L)``, nonzero on sampled tokens.

    Returns:
        A detached scalar tensor, in nats.
    """
    return -masked_mean(old_logp.detach(), mask)


def total_loss(terms: Mapping[str, Tensor] | TensorDictBase) -> Tensor:
    """Sum of the entries whose key starts with ``loss_`` (metrics under other keys are ignored).

    Args:
        terms: Named scalars, e.g. the output of `policy_loss` with ``loss_sft`` and ``loss_kl`` added.

    Returns:
        The scalar to call ``backward`` on.

    Raises:
        ValueError: No key starts with ``loss_``.
    """
    losses = [terms[key] for key in terms.keys() if isinstance(key, str) and key.startswith("loss_")]
    if not losses:
        raise ValueError(f"no loss_* term among keys {list(terms.keys())}")
    return sum(losses[1:], start=losses[0])
