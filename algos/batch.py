"""From trajectory records to padded tensors for the losses, and per-token log-probs of a causal LM.

Layout. Every batch is a `tensordict.TensorDict` with batch size ``(N,)``, one row per model context
(generation); sequences are right-padded to the longest, ``T`` tokens. Per-token training tensors
(``loss_mask``, ``old_logp``, and what `token_logprobs` returns) have ``T - 1`` columns and are
*shifted*: column ``t`` is about predicting ``input_ids[:, t + 1]`` from ``input_ids[:, : t + 1]``,
the position a causal LM's logits ``[:, t]`` score. So ``input_ids[:, 1:][loss_mask]`` are exactly the
tokens the loss trains on, and ``logp``, ``old_logp`` and ``loss_mask`` line up element by element.

    adv = group_advantages(rewards, group_id)  # (B,) done inside collate_trajectories
    batch = collate_trajectories(trajectories, pad_token_id=tok.pad_token_id)
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])  # (N, T-1)
    terms = policy_loss(logp, batch["old_logp"], batch["adv"], batch["loss_mask"])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn

from agents.records import Generation, Trajectory
from algos.losses import group_advantages

__all__ = [
    "ROLES",
    "answer_accuracy",
    "collate_sft",
    "collate_trajectories",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

ROLES: tuple[str, ...] = ("agent", "planner", "executor")
"""Generation roles; a batch's ``role_id`` is the index of the role in this tuple."""

SFTDemo = Generation | tuple[Sequence[int], Sequence[int]]
"""A demonstration: a `Generation` (its ``loss_mask`` marks the assistant tokens) or a pair
``(token_ids, assistant_mask)`` such as a chat template's ``input_ids`` and ``assistant_masks``."""


def _pad(rows: Sequence[Sequence[int | float]], length: int, value: int | float, dtype: torch.dtype) -> Tensor:
    """Right-pads ``rows`` to ``length`` into one ``(len(rows), length)`` tensor."""
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _check_first_token(loss_mask: Sequence[int], what: str) -> None:
    if len(loss_mask) and loss_mask[0]:
        raise ValueError(f"{what}: the first token is masked in, but nothing precedes it to predict it from")


def collate_trajectories(
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int = 0,
    adv: Tensor | None = None,
) -> TensorDict:
    """Pads every generation of every trajectory into one RL batch.

    Each generation inherits its episode's advantage (GRPO over episodes; a CoDA episode's planner and
    executor contexts share it, as CoDA's PECO does).

    Args:
        trajectories: Episodes, ``B`` of them, holding ``N`` generations in all.
        pad_token_id: Id written into padding (never attended to nor trained on).
        adv: Advantage per episode, ``(B,)``. None computes ``group_advantages(rewards, group_id)`` with its
            defaults from the trajectories' rewards and group ids.

    Returns:
        A TensorDict of batch size ``(N,)`` with ``input_ids`` ``(N, T)`` long, ``attention_mask``
        ``(N, T)`` long, ``loss_mask`` ``(N, T-1)`` bool (shifted, see the module docstring),
        ``old_logp`` ``(N, T-1)`` float (sampling log-probs, shifted likewise, 0 off the mask), and per
        generation ``(N,)``: ``adv`` and ``reward`` (float), ``group_id``, ``episode_id`` (index into
        ``trajectories``) and ``role_id`` (index into `ROLES`) (long).

    Raises:
        ValueError: No generations, an unknown role, a mask on a first token, or ``adv`` of the wrong shape.
    """
    rewards = torch.tensor([traj.reward for traj in trajectories], dtype=torch.float32)  # (B,)
    group_id = torch.tensor([traj.group_id for traj in trajectories], dtype=torch.long)  # (B,)
    if adv is None:
        adv = group_advantages(rewards, group_id)  # (B,)
    if adv.shape != rewards.shape:
        raise ValueError(f"adv must have shape {tuple(rewards.shape)} (one per trajectory), got {tuple(adv.shape)}")
    generations = [gen for traj in trajectories for gen in traj.generations]
    if not generations:
        raise ValueError("no generations to collate")
    episode_id = torch.tensor([b for b, traj in enumerate(trajectories) for _ in traj.generations])  # (N,)
    for gen in generations:
        if gen.role not in ROLES:
            raise ValueError(f"unknown role {gen.role!r}; expected one of {ROLES}")
        _check_first_token(gen.loss_mask, f"generation of role {gen.role!r}")
    length = max(len(gen.token_ids) for gen in generations)
    return TensorDict(
        {
            "input_ids": _pad([gen.token_ids for gen in generations], length, pad_token_id, torch.long),
            "attention_mask": _pad([[1] * len(gen.token_ids) for gen in generations], length, 0, torch.long),
            "loss_mask": _pad([gen.loss_mask[1:] for gen in generations], length - 1, 0, torch.bool),
            "old_logp": _pad([gen.sample_logprobs[1:] for gen in generations], length - 1, 0.0, torch.float32),
            "adv": adv.detach().to("cpu", torch.float32)[episode_id],
            "reward": rewards[episode_id],
            "group_id": group_id[episode_id],
            "episode_id": episode_id,
            "role_id": torch.tensor([ROLES.index(gen.role) for gen in generations], dtype=torch.long),
        },
        batch_size=[len(generations)],
    )


def collate_sft(demos: Sequence[SFTDemo], *, pad_token_id: int = 0) -> TensorDict:
    """Pads SFT demonstrations into the same layout as `collate_trajectories`.

    Args:
        demos: Chat-formatted token ids with 1 on the assistant tokens (see `SFTDemo`).
        pad_token_id: Id written into padding.

    Returns:
        A TensorDict of batch size ``(N,)`` with ``input_ids`` ``(N, T)``, ``attention_mask`` ``(N, T)``
        and the shifted ``loss_mask`` ``(N, T-1)`` bool.

    Raises:
        ValueError: No demos, ids and mask of different lengths, or a mask on a first token.
    """
    if not demos:
        raise ValueError("no demonstrations to collate")
    pairs = [(demo.token_ids, demo.loss_mask) if isinstance(demo, Generation) else demo for demo in demos]
    for i, (token_ids, mask) in enumerate(pairs):
        if len(token_ids) != len(mask):
            raise ValueError(f"demo {i}: {len(token_ids)} token ids but {len(mask)} mask entries")
        _check_first_token(mask, f"demo {i}")
    length = max(len(token_ids) for token_ids, _ in pairs)
    return TensorDict(
        {
            "input_ids": _pad([list(ids) for ids, _ in pairs], length, pad_token_id, torch.long),
            "attention_mask": _pad([[1] * len(ids) for ids, _ in pairs], length, 0, torch.long),
            "loss_mask": _pad([list(mask)[1:] for _, mask in pairs], length - 1, 0, torch.bool),
        },
        batch_size=[len(pairs)],
    )


def answer_accuracy(trajectories: Sequence[Trajectory]) -> float:
    """Share of episodes whose answer has F1 > 0 (``info["f1"]``; a missing F1 counts as 0): RED's acc."""
    if not trajectories:
        raise ValueError("no trajectories")
    return sum(float(traj.info.get("f1", 0.0)) > 0 for traj in trajectories) / len(trajectories)


def _logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """Shared loop of `token_logprobs` and `token_logprobs_and_entropy`; entropy is zeros unless asked."""
    device = next(model.parameters()).device
    length = input_ids.shape[1]
    logp_chunks, entropy_chunks = [], []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        ids = input_ids[start : start + micro_batch_size].to(device)
        attn = attention_mask[start : start + micro_batch_size].to(device)
        used = int(attn.sum(-1).max())  # right padding: later columns are padding in every row
        logp = torch.zeros(len(ids), max(length - 1, 0), device=device)  # (n, T-1)
        entropy = torch.zeros_like(logp)  # (n, T-1)
        if used >= 2:
            logits = model(input_ids=ids[:, :used], attention_mask=attn[:, :used], use_cache=False).logits
            logits = logits[:, :-1].float() / temperature  # (n, used-1, V): row t scores token t+1
            target = ids[:, 1:used].unsqueeze(-1)  # (n, used-1, 1)
            real = attn[:, 1:used].bool()  # (n, used-1)
            scored = logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)  # (n, used-1)
            logp = F.pad(torch.where(real, scored, 0.0), (0, length - used))
            if with_entropy:
                with torch.no_grad():
                    log_probs = logits.detach().log_softmax(-1)
                    h = -(log_probs.exp() * log_probs).sum(-1)  # (n, used-1)
                    entropy = F.pad(torch.where(real, h, 0.0), (0, length - used))
        logp_chunks.append(logp)
        entropy_chunks.append(entropy)
    return torch.cat(logp_chunks), torch.cat(entropy_chunks)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    micro_batch_size: int = 8,
    temperature: float = 1.0,
) -> Tensor:
    """Log-prob of every next token under a causal LM, in micro-batches.

    Differentiable when called with grad enabled. Under ``torch.no_grad`` (old or reference log-probs)
    micro-batches bound peak memory; with grad, every micro-batch's graph lives until ``backward``, so a
    trainer short of memory calls this once per micro-batch and accumulates gradients instead.

    Args:
        model: A Hugging Face causal LM (called with ``input_ids``, ``attention_mask``; returns ``.logits``).
        input_ids: ``(N, T)`` right-padded ids.
        attention_mask: ``(N, T)``, 1 on real tokens.
        micro_batch_size: Rows per forward pass; each micro-batch is trimmed to its longest row.
        temperature: Divides the logits, to score tokens under the distribution they were sampled from.

    Returns:
        ``(N, T-1)`` float32 on the model's device: column ``t`` is ``log p(input_ids[:, t+1] |
        input_ids[:, :t+1])``; 0 where ``input_ids[:, t+1]`` is padding.
    """
    logp, _ = _logprobs(model, input_ids, attention_mask, micro_batch_size, temperature, with_entropy=False)
    return logp


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    micro_batch_size: int = 8,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` plus the entropy of the predictive distribution at every position.

    One forward pass gives both, so the SFT step gets its loss and RED's SFT entropy together.

    Args:
        model: As in `token_logprobs`.
        input_ids: ``(N, T)`` right-padded ids.
        attention_mask: ``(N, T)``, 1 on real tokens.
        micro_batch_size: Rows per forward pass.
        temperature: Divides the logits.

    Returns:
        ``(logp, entropy)``, both ``(N, T-1)`` and shifted alike: ``entropy[:, t]`` is the entropy (nats)
        of the distribution that predicts token ``t+1``, 0 on padding. The entropy is detached: a
        measurement, never a loss.
    """
    return _logprobs(model, input_ids, attention_mask, micro_batch_size, temperature, with_entropy=True)
