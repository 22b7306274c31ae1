"""Steps whose RL term carries a gradient: which groups and rows hold a non-zero advantage, and DAPO's dynamic
sampling, which replaces tied groups with new questions before the update.

A GRPO group whose episodes all scored the same reward has advantage 0 on every token: it costs a rollout and,
under a token mean over the whole batch, shrinks the rest of the RL term. DAPO (arXiv 2503.14476) keeps only
groups with mixed rewards, sampling more questions until the batch is full; `Trainer.collect_rollouts` does so
within ``--max-resample-batches`` extra batches, each of only as many questions as are missing, and counts what it
cost (``train/episodes``, ``train/resample_batches``). A group tied on its reward still carries a signal when its
searches earned different per-search credit (`algos.objectives.credit`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDict
from torch import Tensor

from agents.records import Trajectory
from algos import distributed
from algos.objectives.credit import search_advantages

__all__ = ["play", "signal_groups", "signal_rows"]


def signal_groups(episodes: Sequence[Trajectory], search_credit: float = 0.0, repeat_penalty: float = 0.0) -> list[int]:
    """The group ids of `episodes` whose advantage is not 0 somewhere, in the order the groups first appear: the
    episodes' rewards differ or, with ``search_credit`` > 0, a search's centred credit is not 0."""
    rewards: dict[int, set[float]] = {}
    for t in episodes:
        rewards.setdefault(t.group_id, set()).add(float(t.reward))
    mixed = {group for group, values in rewards.items() if len(values) > 1}
    if search_credit > 0:
        credited = search_advantages(episodes, repeat_penalty)
        mixed |= {t.group_id for t, advs in zip(episodes, credited, strict=True) if any(a != 0 for a in advs)}
    return [group for group in rewards if group in mixed]


def signal_rows(batch: TensorDict) -> Tensor:
    """``(N,)`` bool: the rows (contexts) of an RL batch whose advantage is not 0 on some sampled token."""
    adv, mask = batch["adv"], batch["loss_mask"]
    if adv.ndim == 1:
        return adv != 0
    return ((adv != 0) & mask.bool()).any(-1)


def play(
    collector: Any, rl: Any, probe: int | None, autocast: Callable[[], contextlib.AbstractContextManager]
) -> tuple[list[Trajectory], list[Trajectory], list[Trajectory], int]:
    """Play a step's groups: this rank's episodes to train on, every rank's of them, every episode played, and how
    many extra batches dynamic sampling (``max_resample_batches``, one process) played for groups whose advantage is
    not 0; without it the first three are the one batch's.

    Args:
        collector: The run's collector (`agents.collector`): ``collect(n)`` plays n questions' groups.
        rl: The run's RL settings.
        probe: Questions of a tie probe batch; None: ``questions_per_step``.
        autocast: The learner's autocast (under bf16 the sampler runs in bf16 too).
    """
    with autocast():
        trajectories = collector.collect(probe)  # data parallel: this rank's share of the step's groups
    gathered = distributed.gather_episodes(trajectories)  # data parallel: every rank's episodes
    if not rl.max_resample_batches:
        return trajectories, gathered, gathered, 0
    wanted, played, rounds = probe or rl.questions_per_step, list(trajectories), 0
    keep = signal_groups(played, rl.search_credit, rl.repeat_penalty)
    while len(keep) < wanted and rounds < rl.max_resample_batches:
        with autocast():  # only as many new questions as are missing
            played += collector.collect(wanted - len(keep))
        keep, rounds = signal_groups(played, rl.search_credit, rl.repeat_penalty), rounds + 1
    if not keep:  # no group carries a signal: the first batch, all tied, as without dynamic sampling
        return trajectories, gathered, played, rounds
    chosen = set(keep[:wanted])
    kept = [t for t in played if t.group_id in chosen]
    return kept, kept, played, rounds
