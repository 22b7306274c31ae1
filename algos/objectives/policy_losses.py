"""The built-in policy losses and loss aggregations, and `pg_terms`, which joins one of each into ``loss_pg``.

A policy loss gives each sampled token's value and its metrics; an aggregation reduces the values to one number
over the whole batch (every micro-batch and rank: `LossScale` holds the batch's counts):

    clip       max(-A r, -A clip(r, 1 - eps, 1 + eps_high)),  r = exp(logp - old_logp)       PPO / GRPO / DAPO
    gspo       the same with r = s_i: exp of the context's mean log-ratio, one per context  GSPO (arXiv 2507.18071)
    reinforce  -A logp                                                                       REINFORCE

    token-mean           sum of every context's token values / every sampled token of the batch
    signal-token-mean    the same over the tokens of the contexts whose advantage is not 0
    seq-mean-token-mean  mean over contexts of each context's token mean
    seq-mean-token-sum   mean over contexts of each context's token sum                     Dr. GRPO

GSPO here is its token form (each token's value is s_i x A_t, its gradient s_i x A_t x grad logp_t): with
``seq-mean-token-mean`` and one advantage per context it is the paper's sequence objective, and it takes per-token
advantages (credit, GAE) too. The KL term is always a token mean over every sampled token (`LossScale.all_tokens`),
whatever the aggregation: an all-tied step under ``signal-token-mean`` has no signal tokens, and dividing the KL
term by their count would turn it into a sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from algos.objectives.losses import clipped_objective, masked_mean
from algos.objectives.registry import Aggregation, PolicyLoss

__all__ = [
    "LossScale",
    "clipped_ratio",
    "pg_terms",
    "reinforce",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "sequence_ratio",
    "token_mean",
]


@dataclass(frozen=True)
class LossScale:
    """The whole batch's divisors (every rank's, every micro-batch's).

    Args:
        tokens: Sampled tokens of the rows the aggregation counts.
        rows: Those rows (contexts with a sampled token).
        all_tokens: Every sampled token of the batch: the divisor of the token means beside the policy term (KL, a
            value head's loss, an expert term).
    """

    tokens: float
    rows: float
    all_tokens: float


# --- losses: (logp, old_logp, adv, mask, rl) -> per-token values (n, L) and micro-batch metrics ---------------------
def clipped_ratio(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, rl: Any) -> tuple[Tensor, dict]:
    """The clipped token ratio (`losses.clipped_objective`), ``clip_eps`` below, ``clip_eps_high`` above."""
    per_token, clip_fraction, approx_kl = clipped_objective(logp, old_logp, adv, mask, rl.clip_eps, rl.clip_eps_high)
    return per_token, {"clip_fraction": clip_fraction, "approx_kl": approx_kl}


def sequence_ratio(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, rl: Any) -> tuple[Tensor, dict]:
    """GSPO: each context's ratio ``s = exp(mean log-ratio over its sampled tokens)``, clipped at the context level."""
    keep = mask.bool()
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)  # (n, 1)
    high = rl.clip_eps if rl.clip_eps_high is None else rl.clip_eps_high
    log_ratio = torch.where(keep, logp - old_logp.detach(), torch.zeros((), dtype=logp.dtype, device=logp.device))
    seq = log_ratio.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(1)  # (n, 1)
    ratio = torch.exp(seq.detach() + logp - logp.detach())  # (n, L): value s_i, gradient s_i * grad logp_t
    ratio = torch.where(keep, ratio, torch.ones_like(ratio))
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - rl.clip_eps, 1.0 + high))
    with torch.no_grad():
        outside = ((ratio < 1.0 - rl.clip_eps) | (ratio > 1.0 + high)).to(logp.dtype)
        metrics = {
            "clip_fraction": masked_mean(outside, mask),
            "approx_kl": masked_mean(log_ratio.exp() - 1 - log_ratio, mask),
        }
    return per_token, metrics


def reinforce(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, rl: Any) -> tuple[Tensor, dict]:
    """REINFORCE: ``-A logp`` on every sampled token (no ratio, no clip)."""
    keep = mask.bool()
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    per_token = torch.where(keep, -adv * logp, zero)
    with torch.no_grad():
        log_ratio = torch.where(keep, logp - old_logp, zero)
        metrics = {
            "clip_fraction": torch.zeros((), dtype=logp.dtype),
            "approx_kl": masked_mean(log_ratio.exp() - 1 - log_ratio, mask),
        }
    return per_token, metrics


# --- aggregations: (values, mask, scale) -> scalar ------------------------------------------------------------------
def token_mean(values: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """Every counted token weighs the same: the token sum over `scale.tokens`."""
    return masked_mean(values, mask, scale.tokens)


def _row_sums(values: Tensor, mask: Tensor) -> Tensor:
    keep = mask.bool()
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)  # (n,)


def seq_mean_token_mean(values: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """Every context weighs the same: its token mean, summed over the micro-batch's rows, over `scale.rows`."""
    lengths = mask.bool().sum(-1).clamp_min(1).to(values.dtype)  # (n,)
    return (_row_sums(values, mask) / lengths).sum() / max(scale.rows, 1.0)


def seq_mean_token_sum(values: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """Every token weighs the same within a context, and the sum over contexts is over `scale.rows` (Dr. GRPO)."""
    return _row_sums(values, mask).sum() / max(scale.rows, 1.0)


def pg_terms(
    loss: PolicyLoss,
    agg: Aggregation,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    scale: LossScale,
    rl: Any,
    is_weight: Tensor | None = None,
) -> TensorDict:
    """``loss_pg`` of one micro-batch: `loss`'s per-token values, times the truncated importance weights where
    given (``--tis-cap``), reduced by `agg`; with the loss's metrics (micro-batch token means, detached)."""
    per_token, metrics = loss.function()(logp, old_logp, adv, mask, rl)  # (n, L)
    if is_weight is not None:
        per_token = per_token * is_weight.detach().to(per_token.dtype)
    terms = {"loss_pg": agg.function()(per_token, mask, scale), **metrics}
    return TensorDict(terms, batch_size=[])
