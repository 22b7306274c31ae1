"""The rollout collector: GRPO groups of episodes as TensorDict batches, behind TorchRL's collector API.

`RolloutCollector` is a TorchRL collector: it initialises TorchRL's `BaseCollector` as TorchRL's own collectors
do, iterating it (or `next()`) yields one TensorDict batch at a time through the base class's iteration, `len()`
counts batches from its frames (a frame here is one episode), and `update_policy_weights_` is the base class's,
backed by a TorchRL weight-sync scheme (`SamplerWeightSync`), so its batches go straight into a TorchRL
`ReplayBuffer.extend` and it stands where TorchRL code expects a collector. It does not use TorchRL's LLMCollector:
that one resets finished envs mid-batch, which breaks batched multi-turn episodes of unequal length. Here every
batch is `questions_per_batch` questions x `group_size` episodes each, all played to the end by one batched agent
call. A batch holds our keys (`agents.collate.collate_trajectories`) and TorchRL's LLM keys beside them
(`agents.torchrl_layout`).

Data order is a seeded permutation of the question indices, reshuffled each epoch; the position in it is
part of `state_dict()`, so a resumed run sees exactly the questions an uninterrupted run would.

    collector = RolloutCollector(lambda: gym.make("RedCoda-HotpotQA-v0"), agent, questions_per_batch=4, group_size=2)
    for batch in collector:          # TensorDict of generations, TorchRL's LLM keys included
        replay_buffer.extend(batch)  # e.g. ReplayBuffer(storage=LazyTensorStorage(...)) for equal-length batches
        ...
        collector.update_policy_weights_(policy)

`collect()` plays one batch and returns its trajectories (records, not tensors) without collating them; `batch_of`
makes the TensorDict iteration yields of them. The trainers call these two (records and tensors of one batch, collated
once): docs/method.md, "TorchRL", says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDictBase
from torchrl.collectors import BaseCollector
from torchrl.weight_update import WeightSyncScheme

from agents.records import Trajectory
from agents.tree import TreeShape, play_trees


def shard_range(n: int, rank: int, ranks: int) -> range:
    """Rank `rank`'s contiguous share of `n` items split over `ranks` (sizes differ by at most one)."""
    return range(n * rank // ranks, n * (rank + 1) // ranks)


class RolloutCollector(BaseCollector):
    """Collects GRPO groups: G episodes per question, a batch of questions per iteration.

    Args:
        env_fn: builds one env (all envs share one retriever index).
        agent: a batched agent (`SearchR1Agent`, `CodaAgent`, `OracleAgent`, ...).
        questions_per_batch: distinct questions per batch.
        group_size: episodes per question (G).
        total_batches: stop after this many batches (-1: never).
        indices: question indices to draw from, or a function of the split's size that returns them (default: all
            of the env's split).
        seed: seeds the data order and the agent's sampling.
        shard: ``(rank, ranks)``: play only this rank's contiguous share of each batch's questions (whole groups;
            data order, group ids and sampling seeds stay the global batch's, so the ranks together play what
            one collector with ``(0, 1)`` plays).
        tree: play each group as trees of this shape (`agents.tree`: episodes that share their first turns, each
            with a ``tree_id``); None: independent episodes.
        pre_collect_hook: called before each batch is played (TorchRL's collector hook).
        post_collect_hook: called with each batch's TensorDict before it is yielded (TorchRL's collector hook).
    """

    def __init__(
        self,
        env_fn: Callable[[], Any],
        agent: Any,
        questions_per_batch: int,
        group_size: int,
        total_batches: int = -1,
        indices: Sequence[int] | Callable[[int], Sequence[int]] | None = None,
        seed: int = 0,
        shard: tuple[int, int] = (0, 1),
        tree: TreeShape | None = None,
        *,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
    ) -> None:
        if questions_per_batch < 1 or group_size < 1:
            raise ValueError("questions_per_batch and group_size must be >= 1")
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard must be (rank, ranks) with 0 <= rank < ranks, got {shard}")
        super().__init__(pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook)
        # TorchRL counts frames; a frame here is one episode of the global batch (every rank counts the same)
        self.frames_per_batch = self.requested_frames_per_batch = questions_per_batch * group_size
        self.total_frames = total_batches * self.frames_per_batch if total_batches >= 0 else -1
        self.shard = shard
        if tree is not None:
            tree.rounds(group_size)  # refuses a group size the trees cannot make
        self.tree = tree
        self.agent = agent
        self.questions_per_batch, self.group_size = questions_per_batch, group_size
        self.total_batches = total_batches
        self.envs = [env_fn() for _ in range(-(-questions_per_batch // shard[1]) * group_size)]  # the largest share
        if indices is None or callable(indices):
            size = self.envs[0].unwrapped.num_examples
            indices = range(size) if indices is None else indices(size)
        self.indices = np.asarray(indices)
        if len(self.indices) == 0:
            raise ValueError("no questions to collect on")
        self.set_seed(seed)
        self.batch_questions: int | None = None
        """Questions in each batch that iteration yields from here on, at most ``questions_per_batch`` (a trainer's
        smaller probe batch); None: ``questions_per_batch``."""
        # TorchRL's weight sync, set up as its single-process `Collector` sets up the schemes it is given
        self._weight_sync_schemes = {"policy": SamplerWeightSync(agent)}
        for model_id, scheme in self._weight_sync_schemes.items():
            scheme.init_on_sender(model_id=model_id, context=self)
            scheme.connect()

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        self.seed = int(seed)
        self.batches_done = 0
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)
        return self.seed

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.indices)

    def _next_questions(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self._position == len(self._order):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            out.append(int(self._order[self._position]))
            self._position += 1
        return out

    def collect(self, num_questions: int | None = None) -> list[Trajectory]:
        """Play the next batch of GRPO groups to the end and return its trajectories.

        Args:
            num_questions: questions in this batch, at most ``questions_per_batch`` (a trainer's smaller probe
                batch); None: ``questions_per_batch``. The data order goes on from where it stands either way.
        """
        n = self.questions_per_batch if num_questions is None else num_questions
        if not 1 <= n <= self.questions_per_batch:
            raise ValueError(f"num_questions must lie in [1, {self.questions_per_batch}], got {n}")
        questions = self._next_questions(n)  # every rank advances the data order by the whole batch
        mine = shard_range(n, *self.shard)
        indices = [questions[i] for i in mine for _ in range(self.group_size)]
        group_ids = [self.batches_done * self.questions_per_batch + i for i in mine for _ in range(self.group_size)]
        envs = self.envs[: len(indices)]
        seed = self.seed * 1_000_003 + self.batches_done
        if self.tree is not None:
            groups = [self.batches_done * self.questions_per_batch + i for i in mine]
            trajectories = play_trees(
                self.agent, envs, [questions[i] for i in mine], groups, self.group_size, self.tree, seed
            )
        else:
            trajectories = self.agent.rollout(envs, indices, group_ids, seed=seed)
        self.batches_done += 1
        return trajectories

    def batch_of(self, trajectories: Sequence[Trajectory]) -> TensorDictBase:
        """The TensorDict of `trajectories` that iteration yields: `agents.collate.collate_trajectories`'s keys
        (padded with the sampler's pad token) and TorchRL's LLM keys beside them (`agents.torchrl_layout`)."""
        from agents.collate import collate_trajectories
        from agents.torchrl_layout import add_torchrl_keys

        pad = getattr(getattr(getattr(self.agent, "sampler", None), "tokenizer", None), "pad_token_id", 0) or 0
        return add_torchrl_keys(collate_trajectories(trajectories, pad_token_id=pad))

    def iterator(self) -> Iterator[TensorDictBase]:
        """Yield `batch_of` one `collect()` at a time until `total_batches`; ``batch_questions`` is read before each
        batch is played. The records stay with whoever called `collect()`: a TensorDict is what TorchRL passes on.

        Iterate the collector itself (``for batch in collector``): TorchRL's `BaseCollector.__iter__` wraps this
        (it shuts the collector down if a batch fails).
        """
        while self.total_batches < 0 or self.batches_done < self.total_batches:
            if self._pre_collect_hook is not None:
                self._pre_collect_hook()
            batch = self.batch_of(self.collect(self.batch_questions))
            if self._post_collect_hook is not None:
                self._post_collect_hook(batch)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Where the data order stands (seed, epoch, position, batches done)."""
        return {"seed": self.seed, "epoch": self._epoch, "position": self._position, "batches_done": self.batches_done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = int(state_dict["seed"])
        self._epoch, self._position = int(state_dict["epoch"]), int(state_dict["position"])
        self.batches_done = int(state_dict["batches_done"])
        self._order = self._permutation(self._epoch)

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        for scheme in self._weight_sync_schemes.values():
            scheme.shutdown()
        if close_env:
            for env in self.envs:
                env.close()


class SamplerWeightSync(WeightSyncScheme):
    """TorchRL's weight-sync scheme for an agent's in-process sampler: `update_policy_weights_` sends through it.

    A sampler with its own copy of the weights (vLLM) exposes ``load_weights(named_tensors)``: sending hands it the
    weights, in every form `BaseCollector.update_policy_weights_` takes (a module, whose state dict is sent; a state
    dict or TensorDict of weights; ``(name, tensor)`` pairs). The transformers sampler samples from the trainer's
    model object itself, so there is nothing to send; nor when no weights are given (there is no server copy to
    fetch them from). One local agent: ``worker_ids`` name nothing.

    TorchRL 0.14 deprecates `WeightUpdaterBase` (the object behind ``collector.weight_updater``) for these schemes;
    its own single-process `Collector` keeps ``weight_updater`` None when given a scheme, as this collector does.

    Args:
        agent: The agent whose ``sampler`` gets the weights.
    """

    def __init__(self, agent: Any) -> None:
        super().__init__()
        self.agent = agent

    def _init_on_sender_impl(self, model_id: str, context: Any = None, **kwargs: Any) -> None:
        self.model_id = model_id
        self.context = context
        self.shared_transport = self.create_transport()

    def create_transport(self, **kwargs: Any) -> _SamplerTransport:
        return _SamplerTransport(self.agent)

    def prepare_weights(self, weights: Any, model_id: str, strategy: Any, context: Any = None) -> Any:
        """`(name, tensor)` pairs of `weights` (see `_named_tensors`), or None when none were given."""
        return None if weights is None else _named_tensors(weights)


class _SamplerTransport:
    """The transport of `SamplerWeightSync`: a call into the sampler's ``load_weights`` in this process."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def send_weights(self, weights: Iterable[tuple[str, Any]] | None) -> None:
        sampler = getattr(self.agent, "sampler", None)
        if weights is not None and hasattr(sampler, "load_weights"):
            sampler.load_weights(weights)

    def receive_weights(self, timeout: float | None = None, **kwargs: Any) -> None:
        return None

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing to connect: the sampler lives in this process."""

    def setup_connection_and_weights_on_receiver(self, **kwargs: Any) -> None:
        return None


def _named_tensors(source: Any) -> Iterable[tuple[str, Any]]:
    """`(name, tensor)` pairs of a module, a state dict, a TensorDict of weights (nested keys joined by ".") or
    an iterable of pairs."""
    if isinstance(source, TensorDictBase):
        return source.flatten_keys(".").items()
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return source.state_dict().items()
    if isinstance(source, Mapping):
        return source.items()
    return source
