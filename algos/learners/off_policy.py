"""The policy-gradient term of off-policy (expert) tokens: LUFFY's regularised importance sampling, as a pure function.

An expert episode that joins a GRPO group (`algos.learners.expert`) was not sampled from any policy the trainer
knows: the oracle writes its turns from the gold evidence and has no log-probs. Off-policy GRPO variants
(LUFFY, arXiv 2504.14945; David-GRPO, arXiv 2601.21699) then take the behaviour probability of every expert token
as 1, so the token's importance ratio is the current policy's probability ``pi = exp(logp)`` itself, and shape it:

    f(pi) = pi / (pi + gamma)                       # LUFFY's policy shaping, gamma = 0.1 by default
    loss_expert = token_mean(-adv * f(pi))          # over the expert tokens, no clipping

Why shaped and not plain: the gradient of ``pi`` with respect to ``logp`` is ``pi`` itself, so an expert token the
policy finds unlikely (``pi`` near 0, the very tokens it has to learn) would get almost no gradient; the gradient of
``f(pi)`` is ``gamma * pi / (pi + gamma)^2``, which is ``1/gamma`` times larger than ``pi``'s near ``pi = 0`` and
smaller near ``pi = 1`` (``gamma / (1 + gamma)^2``, 0.083 at gamma 0.1), so low-probability expert tokens keep
their gradient and tokens already learnt stop dominating. Why unclipped: PPO's clip bounds how far the policy moves
from the one that sampled the tokens; the expert's ratio is not a ratio to a sampling policy (its denominator is a
convention), and clipping it would silence exactly the tokens the policy is furthest from (LUFFY drops the clip for
off-policy tokens too).

The layout is `algos.objectives.losses`': ``(N, L)`` per-token tensors, a mask nonzero on the tokens the term sees,
and ``num_tokens`` the divisor (the batch's sampled tokens, on-policy and expert alike: with the policy term over the
on-policy tokens, one token mean over the batch).

    terms = policy_loss(logp, old_logp, adv, on_policy_mask, num_tokens=n)
    terms["loss_expert"] = shaped_expert_loss(logp, adv, expert_mask, gamma=0.1, num_tokens=n)["loss_expert"]
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from algos.objectives.losses import masked_mean

__all__ = ["shaped_expert_loss", "shaped_ratio"]


def shaped_ratio(logp: Tensor, gamma: float) -> Tensor:
    """LUFFY's shaped importance ratio of an expert token: ``f(pi) = pi / (pi + gamma)``, ``pi = exp(logp)``.

    Args:
        logp: Log-probs of the expert's tokens under the current policy, any shape, differentiable.
        gamma: The shaping constant (> 0); smaller lifts the gradient of low-probability tokens more.

    Returns:
        ``f(pi)`` in ``[0, 1 / (1 + gamma)]``, the shape of `logp`.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    prob = logp.exp()
    return prob / (prob + gamma)


def shaped_expert_loss(
    logp: Tensor, adv: Tensor, mask: Tensor, gamma: float = 0.1, num_tokens: float | Tensor | None = None
) -> TensorDict:
    """The expert tokens' policy-gradient term: ``-adv * f(pi)`` per token, unclipped, then the masked token mean.

    Args:
        logp: Log-probs of the taken (expert) tokens under the current policy, ``(N, L)``, differentiable.
        adv: Advantage per generation ``(N,)`` (broadcast over tokens) or per token ``(N, L)``.
        mask: ``(N, L)``, nonzero on the expert tokens (everything else is selected away, never multiplied by 0,
            so padding's garbage log-probs cannot leak into the loss or its gradient).
        gamma: LUFFY's shaping constant (`shaped_ratio`).
        num_tokens: Divisor instead of ``mask.sum()`` (see `algos.objectives.losses.masked_mean`).

    Returns:
        A TensorDict (batch size ``[]``) with ``loss_expert`` (differentiable scalar), and detached over the masked
        tokens: ``shaped_ratio`` (the mean of ``f(pi)``) and ``prob`` (the mean of ``pi``); both 0 on an empty mask.
    """
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)  # (N, 1), broadcasts over tokens
    keep = mask.bool()
    safe_logp = torch.where(keep, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))  # (N, L)
    shaped = shaped_ratio(safe_logp, gamma)  # (N, L)
    loss = masked_mean(-adv * shaped, mask, num_tokens)
    with torch.no_grad():
        ratio_mean = masked_mean(shaped, mask)
        prob_mean = masked_mean(safe_logp.exp(), mask)
    return TensorDict({"loss_expert": loss, "shaped_ratio": ratio_mean, "prob": prob_mean}, batch_size=[])
