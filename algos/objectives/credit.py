"""Credit for each search: a per-turn reward on the search turn's own tokens, beside the episode's advantage.

An episode reward credits every token of the episode alike, so a search that found the missing evidence and one
that repeated the question get the same push (and a recall term in the episode reward pays for searching more,
on the answer's and the planner's tokens too). Here each search that returned results gets its own reward, as
StepSearch (arXiv 2505.15107) does with its information gain and redundancy penalty:

    r_search = new_gold_titles / gold_titles_total - repeat_penalty * repeated_query    # the env's search-step info

centred within its GRPO group among the searches made at the same position (every episode's first search against
the others' first searches, second against second: a later search is not compared with an easier first one); a
search alone at its position keeps its reward (nothing to compare it with, and 0 for a search that brought nothing
new). The token advantage of a search turn is then

    adv[token] = episode_adv + search_credit * centred r_search    # on that turn's sampled tokens only

and every other token (the answer turn, the planner's tokens under CoDA) keeps the episode's advantage alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from agents.records import Trajectory

__all__ = ["search_advantages", "search_rewards", "token_advantages"]


def search_rewards(trajectories: Sequence[Trajectory], repeat_penalty: float) -> list[list[float]]:
    """Each episode's per-search rewards, in the order of its searches: the share of the question's gold titles the
    search brought first, minus ``repeat_penalty`` for a query the episode had searched before."""
    return [
        [
            (s.new_gold_titles / s.gold_titles_total if s.gold_titles_total else 0.0)
            - (repeat_penalty if s.repeated_query else 0.0)
            for s in t.searches
        ]
        for t in trajectories
    ]


def search_advantages(trajectories: Sequence[Trajectory], repeat_penalty: float) -> list[list[float]]:
    """Per-search rewards (`search_rewards`) centred within each (group, position): minus the mean of the rewards of
    that group's searches at that position, where there are two or more; a search alone at its position keeps its
    reward."""
    rewards = search_rewards(trajectories, repeat_penalty)
    by_slot: dict[tuple[int, int], list[float]] = {}
    for t, episode in zip(trajectories, rewards, strict=True):
        for s, r in zip(t.searches, episode, strict=True):
            by_slot.setdefault((t.group_id, s.position), []).append(r)
    means = {slot: sum(values) / len(values) for slot, values in by_slot.items() if len(values) > 1}
    return [
        [r - means.get((t.group_id, s.position), 0.0) for s, r in zip(t.searches, episode, strict=True)]
        for t, episode in zip(trajectories, rewards, strict=True)
    ]


def token_advantages(
    trajectories: Sequence[Trajectory],
    episode_adv: Tensor,
    batch: TensorDict,
    search_credit: float,
    repeat_penalty: float,
) -> Tensor:
    """Per-token advantages of a collated batch: the episode's on every sampled token, plus ``search_credit`` times
    the search's centred reward on each search turn's tokens.

    Args:
        trajectories: The batch's episodes, in the order `agents.collate.collate_trajectories` laid out their rows.
        episode_adv: ``(B,)`` episode advantages (`algos.objectives.losses.group_advantages`).
        batch: Their collated batch (its ``episode_id`` and shifted ``loss_mask``).
        search_credit: Weight of the search term.
        repeat_penalty: Subtracted from a repeated query's reward.

    Returns:
        ``(N, T-1)`` float advantages, 0 off the mask.
    """
    loss_mask = batch["loss_mask"]
    adv = episode_adv.to(torch.float32)[batch["episode_id"]].unsqueeze(-1).expand(loss_mask.shape).clone()  # (N, T-1)
    first_row = 0
    for t, episode in zip(trajectories, search_advantages(trajectories, repeat_penalty), strict=True):
        for s, a in zip(t.searches, episode, strict=True):
            # token j of a generation is column j - 1 of the shifted layout
            adv[first_row + s.generation, s.start - 1 : s.end - 1] += search_credit * a
        first_row += len(t.generations)
    return torch.where(loss_mask.bool(), adv, torch.zeros((), dtype=adv.dtype))
