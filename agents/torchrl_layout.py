"""The key layout of TorchRL's LLM objectives (`torchrl.objectives.llm`), added to our batches.

Our batches (`agents.collate`) are right-padded and their per-token tensors are *shifted*: column ``t`` of
``loss_mask`` / ``old_logp`` ``(N, T-1)`` is about token ``t + 1``. TorchRL's LLM batches are not shifted: position
``t`` of ``("log_probs", "full")`` and ``("masks", "all_assistant_mask")`` ``(N, T)`` is about token ``t`` of
``("tokens", "full")``. `add_torchrl_keys` writes TorchRL's keys beside ours (ours with a leading column of 0 /
False, since nothing predicts a first token), so TorchRL's ``GRPOLoss`` (``masking_strategy="rlhf"``, a
``TransformersWrapper`` in ``input_mode="tokens"``) reads a batch as it reads its own:

    batch = next(iter(collector))                          # agents.collector.RolloutCollector
    batch["adv"] = adv[batch["episode_id"]]                # (N,): the learner's
    add_torchrl_keys(batch)                                # + ("tokens", "full"), "advantage", ...
    GRPOLoss(TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, pad_output=True),
             masking_strategy="rlhf", entropy_bonus=False)(batch)

Padding stays on the right: TorchRL pads left by convention, but its losses read dense tensors as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

__all__ = ["TORCHRL_KEYS", "add_torchrl_keys"]

TORCHRL_KEYS = (
    ("tokens", "full"),
    ("masks", "all_attention_mask"),
    ("masks", "all_assistant_mask"),
    ("log_probs", "full"),
    "advantage",
    ("next", "ref_log_probs", "full"),
)
"""Every key `add_torchrl_keys` may write (the last two only when the batch holds ``adv`` / ``ref_logp``)."""


def add_torchrl_keys(batch: TensorDictBase) -> TensorDictBase:
    """Write TorchRL's LLM keys into `batch` (in place, from its current ``old_logp`` and ``adv``); return it.

    - ``("tokens", "full")`` ``(N, T)`` long: ``input_ids`` itself (the same tensor).
    - ``("masks", "all_attention_mask")`` ``(N, T)`` bool: ``attention_mask``.
    - ``("masks", "all_assistant_mask")`` ``(N, T)`` bool: the tokens the model sampled (``loss_mask`` unshifted).
    - ``("log_probs", "full")`` ``(N, T)`` float: ``old_logp`` unshifted (the sampler's, or the trainer's where it
      recomputed them), 0 off the mask.
    - ``"advantage"`` ``(N, T, 1)``, when the batch holds ``adv``: a generation's advantage ``(N,)`` broadcast over
      its tokens, or a per-token one ``(N, T-1)`` unshifted (0 at the first position).
    - ``("next", "ref_log_probs", "full")`` ``(N, T)``, when the batch holds ``ref_logp`` ``(N, T-1)``: unshifted.

    Calling it again after ``old_logp`` or ``adv`` changed rewrites the keys from the new values.
    """
    n, width = batch["input_ids"].shape
    batch["tokens", "full"] = batch["input_ids"]
    batch["masks", "all_attention_mask"] = batch["attention_mask"].bool()
    batch["masks", "all_assistant_mask"] = _unshift(batch["loss_mask"].bool(), False)
    batch["log_probs", "full"] = _unshift(batch["old_logp"], 0.0)
    if "adv" in batch.keys():
        adv = batch["adv"]
        if adv.ndim == 1:  # (N,): every token of a generation gets its advantage
            batch["advantage"] = adv.reshape(n, 1, 1).expand(n, width, 1)
        else:  # (N, T-1): per token
            batch["advantage"] = _unshift(adv, 0.0).unsqueeze(-1)
    if "ref_logp" in batch.keys():
        batch["next", "ref_log_probs", "full"] = _unshift(batch["ref_logp"], 0.0)
    return batch


def _unshift(values: torch.Tensor, first: bool | float) -> torch.Tensor:
    """``(N, T-1)`` shifted per-token values as ``(N, T)`` aligned with the tokens: `first` in front."""
    return F.pad(values, (1, 0), value=first)
