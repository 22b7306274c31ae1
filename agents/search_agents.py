"""LLM agents that act in RAGEnv: the flat Search-R1 agent and the hierarchical CoDA agent.

Both act on a whole batch of envs at once: each turn, one `Sampler.generate` call over every active
episode's current context; finished episodes stop generating. Contexts are token ids, so the loss mask
is exact: the chat-template prompt and every observation the env inserts are mask 0, the tokens the
model sampled are mask 1 with their sampling log-probs.

Context routing follows the env's info: an observation is appended to the context of the role that acts
next (`info["role"]`); `info["new_context"]` opens a fresh context from `info["system_prompt"]` and
`info["user_message"]`. So the flat agent keeps one growing context (Search-R1), and the CoDA agent keeps
the planner's context for the whole episode while each executor task starts in a fresh context that is
closed (and forgotten) when its answer returns to the planner as <result>.

A sampler that keeps per-context state between calls (the transformers sampler keeps each context's KV
cache, so a turn prefills only what was appended) may offer `release(token_ids)`: the agent calls it when
a context closes (an executor's task returned, an episode ended), and never for a planner that waits for
its executor.

    agent = SearchR1Agent(HFSampler(*load_model()))
    trajectories = agent.rollout(envs, indices=[3, 3, 7, 7], group_ids=[0, 0, 1, 1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from agents.records import Completion, Generation, SamplingParams, SearchTurn, Trajectory
from agents.samplers import Sampler, encode_chat, overflow
from envs.batching import prefetch_searches

STOP = ("</search>", "</answer>", "</task>")
"""A tool call ends a turn: sampling stops right after its closing tag."""


class Agent(Protocol):
    """Anything that plays a batch of episodes to the end."""

    def rollout(
        self,
        envs: Sequence[Any],
        indices: Sequence[int],
        group_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Trajectory]:
        """Reset `envs[i]` on question `indices[i]`, act until every episode ends, return one Trajectory each."""
        ...


@dataclass
class _Context:
    """One model context being built: tokens, mask and log-probs stay aligned."""

    role: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    truncated_tokens: int = 0
    searches: list[SearchTurn] = field(default_factory=list)
    """This context's searches; their ``generation`` is set when the episode's contexts are ordered (`_searches`)."""

    def add_prompt(self, ids: Sequence[int]) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def add_sample(self, completion: Completion) -> None:
        self.token_ids.extend(completion.token_ids)
        self.loss_mask.extend([1] * len(completion.token_ids))
        self.logprobs.extend(completion.logprobs)

    def freeze(self) -> Generation:
        return Generation(
            tuple(self.token_ids), tuple(self.loss_mask), tuple(self.logprobs), self.role, self.truncated_tokens
        )


@dataclass
class _Slot:
    """One env's episode in the batch."""

    env: Any
    index: int
    group_id: int
    member: int
    """Which episode of its group this is (0..G-1): with the group id, what seeds its sampling."""
    context: _Context | None = None
    parked: list[_Context] = field(default_factory=list)
    """Contexts waiting for control to come back (a planner while its executor works)."""
    closed: list[Generation] = field(default_factory=list)
    closed_searches: list[list[SearchTurn]] = field(default_factory=list)
    """The searches of each closed context, in the order of ``closed``."""
    searches_made: int = 0
    """Searches of the episode that returned results so far."""
    actions: list[str] = field(default_factory=list)
    turns: list[Completion] = field(default_factory=list)
    """The completion behind each action, sampled or replayed."""
    search_ends: list[int] = field(default_factory=list)
    """Actions taken through each search that returned results, while the episode went on (where a branch starts)."""
    script: list[Completion] = field(default_factory=list)
    """Completions still to replay before this episode samples its own (a branch's shared turns, `agents.tree`)."""
    last_obs: str = ""
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    sampler_errors: int = 0
    sampler_error: str | None = None
    """The first sampler error's message."""


def _row_seed(turn_seed: int, group_id: int, member: int) -> int:
    """A 63-bit seed for one episode's sampling in one turn, mixed from the turn's seed, its group and member."""
    words = np.random.SeedSequence([turn_seed & (2**64 - 1), group_id & (2**64 - 1), member]).generate_state(2)
    return int((int(words[0]) << 31) ^ int(words[1])) & (2**63 - 1)


class ContextAgent:
    """A batched LLM agent whose contexts follow the env's role and new-context signals.

    Args:
        sampler: the policy's sampler.
        params: sampling parameters; `stop` defaults to the tool-call closing tags.
        executor_sampler: a different sampler for CoDA executor contexts (default: `sampler`).
        executor_params: sampling parameters for executor turns (default: `params`).
        max_context_tokens: a context that would grow past this many tokens ends its episode as truncated.
    """

    protocol: str | None = None
    _keep = False
    """Within a ``rollout(keep_contexts=True)``: closed contexts are not released."""

    def __init__(
        self,
        sampler: Sampler,
        params: SamplingParams = SamplingParams(max_new_tokens=128, temperature=1.0),
        *,
        executor_sampler: Sampler | None = None,
        executor_params: SamplingParams | None = None,
        max_context_tokens: int = 4096,
    ) -> None:
        self.sampler = sampler
        self.params = _with_stop(params)
        self.executor_sampler = executor_sampler or sampler
        self.executor_params = _with_stop(executor_params) if executor_params else self.params
        self.max_context_tokens = max_context_tokens

    def _check_env(self, env: Any) -> None:
        protocol = getattr(env.unwrapped, "protocol", None)
        if self.protocol is not None and protocol != self.protocol:
            raise ValueError(
                f"{type(self).__name__} acts in the {self.protocol!r} protocol; this env uses {protocol!r}"
            )

    def _tokenizer(self, role: str) -> Any:
        return (self.executor_sampler if role == "executor" else self.sampler).tokenizer

    def _open(self, role: str, info: dict[str, Any]) -> _Context:
        messages = [
            {"role": "system", "content": info["system_prompt"]},
            {"role": "user", "content": info["user_message"]},
        ]
        context = _Context(role, [], [], [])
        context.add_prompt(encode_chat(self._tokenizer(role), messages))
        return context

    def rollout(
        self,
        envs: Sequence[Any],
        indices: Sequence[int],
        group_ids: Sequence[int] | None = None,
        seed: int | None = None,
        *,
        members: Sequence[int] | None = None,
        scripts: Sequence[Sequence[Completion]] | None = None,
        keep_contexts: bool = False,
    ) -> list[Trajectory]:
        """Reset `envs[i]` on question `indices[i]`, act until every episode ends, return one Trajectory each.

        Args:
            envs: One env per episode.
            indices: The question of each episode.
            group_ids: Each episode's GRPO group (default: its question).
            seed: Seeds the envs' resets and the sampling; None continues the samplers' streams.
            members: Each episode's place in its group, which seeds its sampling with the group id (default: the
                order of the episodes of the group in this call).
            scripts: Completions each episode replays, in order, before it samples its own: an episode that branches
                from another after its first turns replays them (same tokens and log-probs, the env steps again) and
                samples only what follows (`agents.tree`).
            keep_contexts: Do not tell the sampler that a finished episode's contexts are done, so a later call that
                extends them (a branch) reuses what the sampler kept; the caller calls `release` after.
        """
        if len(envs) != len(indices):
            raise ValueError(f"{len(envs)} envs but {len(indices)} question indices")
        group_ids = list(group_ids) if group_ids is not None else list(indices)
        if members is None:  # each episode's place among its group's in this call
            counts: dict[int, int] = {}
            members = []
            for group in group_ids:
                members.append(counts.get(int(group), 0))
                counts[int(group)] = members[-1] + 1
        scripts = scripts if scripts is not None else [()] * len(envs)
        if not len(members) == len(scripts) == len(envs):
            raise ValueError(f"{len(envs)} envs but {len(members)} members and {len(scripts)} scripts")
        slots = []
        for i, (env, index, group, member) in enumerate(zip(envs, indices, group_ids, members, strict=True)):
            self._check_env(env)
            obs, info = env.reset(seed=None if seed is None else seed + i, options={"index": int(index)})
            slot = _Slot(env, int(index), int(group), int(member), context=self._open(info["role"], info))
            slot.script = list(scripts[i])
            slots.append(slot)

        turn = 0
        self._keep = keep_contexts
        try:
            while live := [slot for slot in slots if not slot.done]:
                self._turn(live, None if seed is None else seed + 7919 * (turn + 1))
                turn += 1
        finally:
            self._keep = False
        return [
            Trajectory(
                s.index,
                s.group_id,
                tuple(s.closed),
                s.reward,
                dict(s.info),
                tuple(s.actions),
                turns=tuple(s.turns),
                search_ends=tuple(s.search_ends),
                searches=_searches(s),
            )
            for s in slots
        ]

    def release(self, trajectory: Trajectory) -> None:
        """Tell the samplers that every context of a finished episode is done (after ``keep_contexts=True``)."""
        for generation in trajectory.generations:
            sampler = self.executor_sampler if generation.role == "executor" else self.sampler
            release = getattr(sampler, "release", None)
            if callable(release):
                release(generation.token_ids)

    def _turn(self, live: list[_Slot], seed: int | None) -> None:
        """One turn of every live episode: sample an action per context, then step its env.

        The turn's searches go to each shared retriever as one batch first (`envs.batching.prefetch_searches`),
        so the envs' own searches are answered from its cache: one request per turn to a retrieval server.
        """
        sampling = [slot for slot in live if not slot.script]
        sampled = iter(self._act(sampling, seed) if sampling else ())
        completions = [slot.script.pop(0) if slot.script else next(sampled) for slot in live]
        prefetch_searches([slot.env for slot in live], [completion.text for completion in completions])
        for slot, completion in zip(live, completions, strict=True):
            self._apply(slot, completion)

    def _act(self, live: list[_Slot], seed: int | None) -> list[Completion]:
        """Sample the next action of every live context: one generate call per sampler in use."""
        split_executors = self.executor_sampler is not self.sampler or self.executor_params != self.params
        groups: dict[bool, list[int]] = {}
        for i, slot in enumerate(live):
            groups.setdefault(split_executors and slot.context.role == "executor", []).append(i)
        out: list[Completion | None] = [None] * len(live)
        for is_executor, rows in groups.items():
            sampler = self.executor_sampler if is_executor else self.sampler
            params = self.executor_params if is_executor else self.params
            if seed is not None:
                # a row's stream is a function of the turn's seed, its group and its place in the group, never of
                # its batch: data-parallel ranks that split a step's groups sample exactly what one process would
                row_seeds = tuple(_row_seed(seed + int(is_executor), live[i].group_id, live[i].member) for i in rows)
                params = SamplingParams(**{**params.__dict__, "seed": seed + int(is_executor), "row_seeds": row_seeds})
            completions = sampler.generate([live[i].context.token_ids for i in rows], params)
            for i, completion in zip(rows, completions, strict=True):
                context = live[i].context
                dropped = overflow(len(context.token_ids), params.max_new_tokens, sampler.max_context)
                context.truncated_tokens = max(context.truncated_tokens, dropped)
                out[i] = completion
        return out  # type: ignore[return-value]

    def _apply(self, slot: _Slot, completion: Completion) -> None:
        if completion.finish_reason == "error":
            slot.sampler_errors += 1  # recorded; the env sees the empty action as an invalid turn
            slot.sampler_error = slot.sampler_error or completion.error
        start = len(slot.context.token_ids)
        slot.context.add_sample(completion)
        action = completion.text
        slot.actions.append(action)
        slot.turns.append(completion)
        obs, reward, terminated, truncated, info = slot.env.step(action)
        slot.last_obs, role = obs, info["role"]
        if "doc_ids" in info:  # a search that returned results: where its tokens are and what it brought
            slot.searches_made += 1
            search = SearchTurn(
                -1,
                start,
                len(slot.context.token_ids),
                slot.searches_made,
                int(info.get("new_gold_titles", 0)),
                int(info.get("gold_titles_total", 0)),
                bool(info.get("repeated_query", False)),
            )
            slot.context.searches.append(search)
        if terminated or truncated:
            self._finish(slot, float(reward), info)
            return
        if "doc_ids" in info:  # a search that returned results, and the episode goes on: a branch may start here
            slot.search_ends.append(len(slot.actions))
        if info["new_context"]:  # a planner hands a task to a fresh executor context; the planner waits
            slot.parked.append(slot.context)
            slot.context = self._open(role, info)
            return
        if role != slot.context.role:  # the executor answered: close its context, resume the planner's
            slot.closed.append(slot.context.freeze())
            slot.closed_searches.append(slot.context.searches)
            if not self._keep:
                self._release(slot.context)
            slot.context = slot.parked.pop()
        slot.context.add_prompt(self._tokenizer(role)(obs, add_special_tokens=False)["input_ids"])
        params = self.executor_params if role == "executor" else self.params
        if len(slot.context.token_ids) + params.max_new_tokens > self.max_context_tokens:
            reward, info = slot.env.unwrapped.end_episode("the agent's context is full")
            self._finish(slot, reward, {**info, "context_overflow": True})

    def _finish(self, slot: _Slot, reward: float, info: dict[str, Any]) -> None:
        for context in (slot.context, *reversed(slot.parked)):
            slot.closed.append(context.freeze())
            slot.closed_searches.append(context.searches)
        if not self._keep:
            for context in (slot.context, *slot.parked):
                self._release(context)
        errors = {
            "sampler_errors": slot.sampler_errors,
            **({"sampler_error": slot.sampler_error} if slot.sampler_error else {}),
        }
        slot.reward, slot.info, slot.done = reward, {**info, **errors}, True

    def _release(self, context: _Context) -> None:
        """Tell the context's sampler that it will not be extended again (if the sampler keeps state for it)."""
        # subclasses that act without a sampler (the oracle) have none to tell
        sampler = getattr(self, "executor_sampler" if context.role == "executor" else "sampler", None)
        release = getattr(sampler, "release", None)
        if callable(release):
            release(context.token_ids)


def _searches(slot: _Slot) -> tuple[SearchTurn, ...]:
    """The episode's searches in the order it made them, each naming its context's index in ``slot.closed``."""
    found = [replace(search, generation=g) for g, searches in enumerate(slot.closed_searches) for search in searches]
    return tuple(sorted(found, key=lambda search: search.position))


def _with_stop(params: SamplingParams) -> SamplingParams:
    return params if params.stop else SamplingParams(**{**params.__dict__, "stop": STOP})


class SearchR1Agent(ContextAgent):
    """The flat agent (Search-R1 / AutoRefine): one growing context per episode, for protocol="flat"."""

    protocol = "flat"


class CodaAgent(ContextAgent):
    """The hierarchical CoDA agent, for protocol="coda".

    The planner's context lives for the whole episode and sees only tasks and <result> answers; each
    executor task runs in a fresh context (instructions + task) that is closed when it answers, so its
    search results never enter the planner's context. Planner and executor may use different samplers
    (`executor_sampler`) and sampling parameters (`executor_params`); by default one model plays both
    roles (CoDA's shared-policy setting) and one generate call per turn covers both roles.
    """

    protocol = "coda"
