"""From trajectory records to padded token batches: what a trainer's losses read.

Layout. Every batch is a `tensordict.TensorDict` with batch size ``(N,)``, one row per model context
(generation); sequences are right-padded to the longest, ``T`` tokens. Per-token tensors (``loss_mask``,
``old_logp``) have ``T - 1`` columns and are *shifted*: column ``t`` is about predicting
``input_ids[:, t + 1]`` from ``input_ids[:, : t + 1]``, the position a causal LM's logits ``[:, t]`` score.
So ``input_ids[:, 1:][loss_mask]`` are exactly the tokens the loss trains on.

Batches carry no advantages: how to credit an episode is the learner's choice, so a trainer attaches them
(``batch["adv"] = adv[batch["episode_id"]]`` for one advantage per episode).

    batch = collate_trajectories(trajectories, pad_token_id=tokenizer.pad_token_id)
    batch["input_ids"][row, 1:][batch["loss_mask"][row]]   # the tokens the model sampled in context `row`
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from agents.records import ROLES, Generation, Trajectory

__all__ = ["SFTDemo", "collate_sft", "collate_trajectories"]

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


def collate_trajectories(trajectories: Sequence[Trajectory], *, pad_token_id: int = 0) -> TensorDict:
    """Pads every generation of every trajectory into one batch.

    Args:
        trajectories: Episodes, ``B`` of them, holding ``N`` generations in all.
        pad_token_id: Id written into padding (never attended to nor trained on).

    Returns:
        A TensorDict of batch size ``(N,)`` with ``input_ids`` ``(N, T)`` long, ``attention_mask``
        ``(N, T)`` long, ``loss_mask`` ``(N, T-1)`` bool (shifted, see the module docstring),
        ``old_logp`` ``(N, T-1)`` float (sampling log-probs, shifted likewise, 0 off the mask), and per
        generation ``(N,)``: ``reward`` (its episode's, float), ``group_id``, ``episode_id`` (index into
        ``trajectories``) and ``role_id`` (index into `ROLES`) (long).

    Raises:
        ValueError: No generations, an unknown role, or a mask on a first token.
    """
    generations = [gen for traj in trajectories for gen in traj.generations]
    if not generations:
        raise ValueError("no generations to collate")
    for gen in generations:
        if gen.role not in ROLES:
            raise ValueError(f"unknown role {gen.role!r}; expected one of {ROLES}")
        _check_first_token(gen.loss_mask, f"generation of role {gen.role!r}")
    episode_id = torch.tensor([b for b, traj in enumerate(trajectories) for _ in traj.generations])  # (N,)
    rewards = torch.tensor([traj.reward for traj in trajectories], dtype=torch.float32)  # (B,)
    group_id = torch.tensor([traj.group_id for traj in trajectories], dtype=torch.long)  # (B,)
    length = max(len(gen.token_ids) for gen in generations)
    return TensorDict(
        {
            "input_ids": _pad([gen.token_ids for gen in generations], length, pad_token_id, torch.long),
            "attention_mask": _pad([[1] * len(gen.token_ids) for gen in generations], length, 0, torch.long),
            "loss_mask": _pad([gen.loss_mask[1:] for gen in generations], length - 1, 0, torch.bool),
            "old_logp": _pad([gen.sample_logprobs[1:] for gen in generations], length - 1, 0.0, torch.float32),
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
