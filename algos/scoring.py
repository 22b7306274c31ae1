"""The policy's no-grad and training forward passes over a batch's rows: log-probs (and entropies) at the sampled
tokens (`logprobs`), and the step's one scoring pass before the update (`score_rows`: old log-probs recomputed by
the training model, `take_old_logp`, and a learner's own per-token scores)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from algos import distributed
from algos.batch import masked_token_logprobs, micro_batches, token_logprobs, token_logprobs_and_entropy
from algos.objectives.losses import sampler_mismatch, tis_weights

__all__ = ["logprobs", "score_pass", "score_rows", "take_old_logp"]


def logprobs(
    model: torch.nn.Module,
    part: TensorDict,
    *,
    masked_head: bool,
    context_grad: bool,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of a micro-batch at its loss-mask positions, ``(n, L-1)`` each.

    Args:
        model: The policy, or the frozen reference model.
        part: A micro-batch (``input_ids``, ``attention_mask``, ``loss_mask``) on the model's device.
        masked_head: The LM head runs at the loss-mask positions only (`algos.batch.masked_token_logprobs`).
        context_grad: With `masked_head`: whether the gradient flows through the context's tokens too.
        with_entropy: Also return the predictive entropies (else None).
        temperature: Divides the logits, as the sampler did.
    """
    ids, attn, mask = part["input_ids"], part["attention_mask"], part["loss_mask"]
    if masked_head:  # --fsdp: the decoder and the LM head, called apart, run inside the root's forward hooks
        return distributed.as_forward(
            model,
            masked_token_logprobs,
            model,
            ids,
            attn,
            mask,
            temperature=temperature,
            with_entropy=with_entropy,
            context_grad=context_grad,
        )
    if with_entropy:
        return token_logprobs_and_entropy(model, ids, attn, micro_batch_size=len(ids), temperature=temperature)
    return token_logprobs(model, ids, attn, micro_batch_size=len(ids), temperature=temperature), None


def score_rows(
    batch: TensorDict,
    score: Callable[[TensorDict], dict[str, torch.Tensor]],
    rows: Callable[[TensorDict, Sequence[int]], TensorDict],
    *,
    micro_batch_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, torch.Tensor]:
    """Per-token scores of every row of `batch` before the update (no grad), micro-batch by micro-batch: the one
    scoring pass of a step (old log-probs, and a learner's own, as PPO's values and reference log-probs).

    Args:
        batch: The RL batch.
        score: A micro-batch's scores by name, each ``(n, L-1)``.
        rows: The micro-batch of the given rows, on the model's device.
        micro_batch_tokens: Padded tokens per micro-batch at most.
        autocast: The run's autocast context.

    Returns:
        Each score ``(N, T-1)`` float32 on the CPU, 0 where no micro-batch wrote.
    """
    shape = batch["loss_mask"].shape
    out: dict[str, torch.Tensor] = {}
    lengths = batch["attention_mask"].sum(-1).tolist()
    with torch.no_grad(), autocast():
        for picked in micro_batches(lengths, micro_batch_tokens):
            index = torch.tensor(picked)
            for key, value in score(rows(batch, picked)).items():  # (n, L-1) each
                out.setdefault(key, torch.zeros(shape))[index, : value.shape[1]] = value.float().cpu()
    return out


def take_old_logp(batch: TensorDict, old_logp: torch.Tensor, *, tis_cap: float | None) -> dict[str, float]:
    """Replace the sampler's log-probs in `batch` by the training model's `old_logp` ``(N, T-1)``; return how far apart
    the two are (`sampler_mismatch`) and, with `tis_cap`, set each token's truncated importance weight
    (``is_weight``)."""
    sampler_logp = batch["old_logp"]  # (N, T-1): the sampler's
    mask = batch["loss_mask"]
    batch["old_logp"] = torch.where(mask, old_logp, torch.zeros_like(old_logp))
    found = sampler_mismatch(batch["old_logp"], sampler_logp, mask)
    if tis_cap is not None:
        batch["is_weight"] = tis_weights(batch["old_logp"], sampler_logp, mask, tis_cap)  # (N, T-1)
        capped = (batch["is_weight"] >= tis_cap) & mask
        found["mismatch/tis_weight_mean"] = float(batch["is_weight"][mask].mean()) if mask.any() else 1.0
        found["mismatch/tis_capped_fraction"] = float(capped.sum() / mask.sum().clamp(min=1))
    return found


def score_pass(
    batch: TensorDict,
    keys: Sequence[str],
    score: Callable[[TensorDict], dict[str, torch.Tensor]],
    rows: Callable[[TensorDict, Sequence[int]], TensorDict],
    picked: torch.Tensor | None,
    *,
    micro_batch_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    tis_cap: float | None,
) -> dict[str, float]:
    """A step's one scoring pass: `score_rows` over the rows `picked` (None: every row), setting `keys` on `batch`
    (``old_logp`` through `take_old_logp`); 0 on the rows not picked. Returns `take_old_logp`'s metrics."""
    if not keys:
        return {}
    part = batch if picked is None else batch[picked]
    scores = score_rows(part, score, rows, micro_batch_tokens=micro_batch_tokens, autocast=autocast)
    found = take_old_logp(part, scores.pop("old_logp"), tis_cap=tis_cap) if "old_logp" in scores else {}
    for key, value in scores.items():
        part[key] = value
    if picked is not None:  # back into the whole batch
        for key in {*keys, *(["is_weight"] if "is_weight" in part.keys() else [])}:
            if key not in batch.keys():
                batch[key] = torch.zeros(batch.batch_size[0], *part[key].shape[1:], dtype=part[key].dtype)
            batch[key][picked] = part[key]
    return found
