"""Record types that flow from samplers through agents to trainers.

`Completion` is what a sampler returns for one prompt. `Generation` is one model context as the
trainer sees it: the full token sequence, a loss mask that is 1 exactly on the tokens the model
sampled (never on the prompt or on anything the env inserted), and the sampling log-probs aligned with
it. `Trajectory` is one episode: its generations (a flat agent has one growing context; a CoDA agent
has the planner's context plus one fresh context per executor task), the episode reward shared by all
of them, and the env's terminal info.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES: tuple[str, ...] = ("agent", "planner", "executor")
"""Who wrote a generation: the flat protocol's agent, or CoDA's planner and executor (`Generation.role`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions."""

    max_new_tokens: int = 256
    """Upper bound on generated tokens per completion."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    stop: tuple[str, ...] = ()
    """Stop strings; the completion ends right after the first one (it is kept in the text)."""
    seed: int | None = None
    """Seed for the sampler's random generator; None continues its current stream."""
    row_seeds: tuple[int, ...] | None = None
    """One seed per prompt (over `seed`): each row's sample then depends on its own prompt and seed only, not on
    which other rows share its batch (data-parallel ranks that split a batch sample what one process would)."""


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    text: str
    """Decoded completion (up to and including a stop string)."""
    token_ids: tuple[int, ...]
    """Sampled token ids, in order."""
    logprobs: tuple[float, ...]
    """Log-probability of each sampled token under the sampling distribution."""
    finish_reason: str
    """"stop" (stop string or end-of-turn token), "length" (max_new_tokens) or "error"."""
    error: str | None = None
    """What went wrong when finish_reason is "error" (the batch itself never fails)."""


@dataclass(frozen=True)
class Generation:
    """One model context with what the model wrote in it, ready for a token-level loss."""

    token_ids: tuple[int, ...]
    """The whole context: prompt, then sampled turns interleaved with env observations."""
    loss_mask: tuple[int, ...]
    """1 on tokens the model sampled, 0 on the prompt and on every observation the env inserted."""
    sample_logprobs: tuple[float, ...]
    """Sampling log-prob of each token where loss_mask is 1, 0.0 elsewhere."""
    role: str
    """One of `ROLES`: "agent" (flat protocol), "planner" or "executor" (CoDA)."""
    truncated_tokens: int = 0
    """Tokens dropped from the left of a prompt that exceeded the model's context (0 if none)."""

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.loss_mask) == len(self.sample_logprobs)):
            raise ValueError("token_ids, loss_mask and sample_logprobs must align")

    @property
    def num_sampled(self) -> int:
        """How many tokens the model sampled in this context."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class SearchTurn:
    """One search an episode made that returned results: where its tokens lie and what it brought (the env's info)."""

    generation: int
    """Index into `Trajectory.generations` of the context that wrote the search (an executor's under CoDA)."""
    start: int
    """First token of the search turn's completion in that generation's ``token_ids``."""
    end: int
    """One past its last token."""
    position: int
    """1 for the episode's first search that returned results, 2 for its second, ..."""
    new_gold_titles: int
    """Gold titles among its passages that no earlier search of the episode returned."""
    gold_titles_total: int
    """The question's gold titles (0 where the data has none)."""
    repeated_query: bool
    """Its query, normalized, was searched before in the episode."""


@dataclass(frozen=True)
class Trajectory:
    """One episode of one agent in one env."""

    example_index: int
    """Index of the question in the env's dataset."""
    group_id: int
    """Episodes with the same group_id answer the same question (a GRPO group)."""
    generations: tuple[Generation, ...]
    """Every model context of the episode."""
    reward: float
    """Episode reward (the env's terminal reward), shared by all generations."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The env's terminal-step info (em, f1, format, refine, num_searches, ...)."""
    actions: tuple[str, ...] = ()
    """Every action text sent to the env, in order."""
    turns: tuple[Completion, ...] = ()
    """The completion behind each action, in order: what a branch of this episode replays (`agents.tree`)."""
    search_ends: tuple[int, ...] = ()
    """For each search that returned results while the episode went on: how many actions it had taken through it
    (the points where a branch may start)."""
    searches: tuple[SearchTurn, ...] = ()
    """Every search that returned results, in order (what per-search credit reads, `algos.objectives.credit`)."""
    tree_id: int | None = None
    """Episodes of one tree (`agents.tree`: a root episode and its branches) share it; None: played independently."""
