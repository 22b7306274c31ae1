"""Tree rollouts (Tree-GRPO, arXiv 2509.21240): a question's episodes as trees that share their first turns.

A question's ``group_size`` episodes are played as ``roots`` trees. Each tree starts as one independent episode (its
root chain); then, round after round, each tree picks ``branches`` nodes among its episodes' branch points and plays
one new episode from each: the episode replays the shared turns (the same completions, tokens and log-probs; the env
steps through them again) and samples only what follows. A node is the point right after a search that returned
results (Tree-GRPO's node is a whole thought-action-observation step; here the observation that may change what the
agent does next is a search's), restricted to the searches ``branch_turns`` names; a tree with no such node plays a
fresh episode instead, so every group holds ``group_size`` episodes whatever the trees look like.

    shape = TreeShape(roots=2, branches=1)                           # group_size 4 = 2 x (1 + 1 round x 1)
    episodes = play_trees(agent, envs, questions=[3, 7], group_ids=[0, 1], group_size=4, shape=shape, seed=0)
    episodes[0].tree_id, episodes[0].group_id                        # each episode's tree and question group

The shared turns are replayed, never sampled again, and the sampler is told to keep what it holds of the finished
episodes' contexts until the last round (`ContextAgent.rollout`'s ``keep_contexts``): a branch's first sampled turn
then prefills only the tokens after what its parent's context had, where the sampler reuses kept prefixes (the
transformers sampler's `PrefixStore`; vLLM's prefix cache). Advantages follow in
`algos.objectives.losses.tree_advantages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from agents.records import Completion, Trajectory

__all__ = ["TreeShape", "branch_points", "play_trees"]


@dataclass(frozen=True)
class TreeShape:
    """How a question's episodes form trees."""

    roots: int = 2
    """Independent episodes (trees) per question (Tree-GRPO's M)."""
    branches: int = 1
    """Nodes each tree expands in a round, one new episode each (Tree-GRPO's N)."""
    branch_turns: tuple[int, ...] = ()
    """After which of an episode's searches it may branch (1: the first search's results); empty: any."""

    def rounds(self, group_size: int) -> int:
        """Expansion rounds that make `group_size` episodes per question (Tree-GRPO's L).

        Raises:
            ValueError: `group_size` is not ``roots x (1 + rounds x branches)`` with at least one round.
        """
        if self.roots < 1 or self.branches < 1:
            raise ValueError(f"roots and branches must be >= 1, got {self.roots} and {self.branches}")
        per_tree, rest = divmod(group_size, self.roots)
        if rest or per_tree < 1 + self.branches or (per_tree - 1) % self.branches:
            raise ValueError(
                f"group_size {group_size} is not roots ({self.roots}) x (1 + rounds x branches ({self.branches})) "
                "with at least one round"
            )
        return (per_tree - 1) // self.branches


def branch_points(episode: Trajectory, branch_turns: Sequence[int] = ()) -> list[tuple[Completion, ...]]:
    """The turns a branch of `episode` would replay, one prefix per allowed branch point, shortest first.

    Args:
        episode: A finished episode (its ``turns`` and ``search_ends`` recorded by `ContextAgent.rollout`).
        branch_turns: The searches after which it may branch (1: the first); empty: after any.
    """
    return [
        episode.turns[:end]
        for number, end in enumerate(episode.search_ends, start=1)
        if not branch_turns or number in branch_turns
    ]


def play_trees(
    agent: Any,
    envs: Sequence[Any],
    questions: Sequence[int],
    group_ids: Sequence[int],
    group_size: int,
    shape: TreeShape,
    seed: int,
) -> list[Trajectory]:
    """Play `group_size` episodes of each question as trees; return them grouped by question, trees in order.

    Args:
        agent: A `agents.search_agents.ContextAgent` (its ``rollout`` replays scripts).
        envs: At least ``len(questions) x roots x branches`` envs (one per episode of a round).
        questions: Each group's question index.
        group_ids: Each group's id (unique in the step): the episodes' ``group_id``; tree ids are
            ``group_id x roots + tree``.
        group_size: Episodes per question.
        shape: The trees' shape.
        seed: Seeds the sampling (each round its own streams) and the choice of nodes.
    """
    rounds = shape.rounds(group_size)
    needed = len(questions) * shape.roots * shape.branches
    if len(envs) < needed:
        raise ValueError(f"{len(envs)} envs for {len(questions)} questions of {shape}: a round plays {needed} episodes")
    trees: list[list[Trajectory]] = []  # per tree, its episodes in the order they were played
    roots = [(q, g, t) for q, g in zip(questions, group_ids, strict=True) for t in range(shape.roots)]
    try:
        played = agent.rollout(
            envs[: len(roots)],
            [q for q, _, _ in roots],
            [g for _, g, _ in roots],
            seed=seed,
            members=[t for _, _, t in roots],
            keep_contexts=rounds > 0,
        )
        trees = [[replace(e, tree_id=g * shape.roots + t)] for e, (_, g, t) in zip(played, roots, strict=True)]
        for round_ in range(1, rounds + 1):
            starts = []  # (tree, member, script)
            for k, tree in enumerate(trees):
                # a tree's picks depend on the seed, the round and the tree only: ranks that split the groups pick
                # what one process would
                rng = np.random.default_rng([seed & (2**63 - 1), round_, tree[0].tree_id])
                nodes = list({_key(p): p for e in tree for p in branch_points(e, shape.branch_turns)}.values())
                if nodes:  # distinct nodes where the tree has enough
                    picks = rng.choice(len(nodes), size=shape.branches, replace=len(nodes) < shape.branches)
                    scripts = [nodes[int(i)] for i in picks]
                else:  # no node to branch from: fresh episodes
                    scripts = [()] * shape.branches
                first = shape.roots + ((round_ - 1) * shape.roots + k % shape.roots) * shape.branches
                starts += [(k, first + j, script) for j, script in enumerate(scripts)]
            played = agent.rollout(
                envs[: len(starts)],
                [trees[k][0].example_index for k, _, _ in starts],
                [trees[k][0].group_id for k, _, _ in starts],
                seed=seed + 1_000_003 * round_,
                members=[member for _, member, _ in starts],
                scripts=[script for _, _, script in starts],
                keep_contexts=round_ < rounds,
            )
            for (k, _, _), episode in zip(starts, played, strict=True):
                trees[k].append(replace(episode, tree_id=trees[k][0].tree_id))
    finally:  # what the sampler kept of the episodes' contexts for the branches (releasing twice is harmless)
        for tree in trees:
            for episode in tree:
                agent.release(episode)
    return [episode for tree in trees for episode in tree]


def _key(prefix: Sequence[Completion]) -> tuple[tuple[int, ...], ...]:
    """Identifies a node by the tokens of its turns (two episodes that share them share the node)."""
    return tuple(c.token_ids for c in prefix)
