"""RolloutCollector: TensorDict batches of GRPO groups, seeded and resumable data order, TorchRL's API."""

from __future__ import annotations

from types import SimpleNamespace

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import BaseCollector
from torchrl.weight_update import WeightSyncScheme

import envs  # noqa: F401  (registers the ids)
from agents.collector import RolloutCollector
from agents.oracle import OracleAgent
from agents.records import ROLES, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    from agents.models import smollm2_tokenizer

    return smollm2_tokenizer()


def env_fn(bm25, protocol: str = "flat"):
    env_id = "RedCoda-HotpotQA-v0" if protocol == "flat" else "RedCoda-HotpotQA-CoDA-v0"
    return lambda: gym.make(env_id, split="dev", retriever=bm25, max_turns=6, max_planner_turns=6)


def questions(collector: RolloutCollector, batches: int) -> list[list[tuple[int, int]]]:
    """(question index, group id) of every episode of the next `batches` batches."""
    return [[(t.example_index, t.group_id) for t in collector.collect()] for _ in range(batches)]


def test_batches_are_tensordicts_of_groups(bm25, tokenizer):
    collector = RolloutCollector(
        env_fn(bm25), OracleAgent(tokenizer), questions_per_batch=3, group_size=2, total_batches=2, indices=range(20)
    )
    assert isinstance(collector, BaseCollector)
    batches = list(collector)
    assert len(batches) == 2 and collector.batches_done == 2
    for b, batch in enumerate(batches):
        assert isinstance(batch, TensorDict) and batch.batch_size == torch.Size([6])  # flat: one context each
        n, t = batch["input_ids"].shape
        assert batch["attention_mask"].shape == (n, t) and batch["attention_mask"].dtype == torch.long
        assert (
            batch["loss_mask"].shape == batch["old_logp"].shape == (n, t - 1) and batch["loss_mask"].dtype == torch.bool
        )
        assert "adv" not in batch.keys()  # advantages are the learner's to attach
        for key in ("reward", "group_id", "episode_id", "role_id"):
            assert batch[key].shape == (n,)
        assert batch["group_id"].tolist() == [3 * b + g for g in range(3) for _ in range(2)]
        assert batch["episode_id"].tolist() == list(range(6))
        # the oracle plays a question the same way every time: a group's rewards tie
        assert torch.all(batch["reward"][0::2] == batch["reward"][1::2])
    collector.total_batches = 3
    trajectories = collector.collect()  # the records, and the batch iteration would have yielded of them
    last = collector.batch_of(trajectories)  # its trained-on tokens are exactly the oracle's actions
    assert last["group_id"].tolist() == [3 * 2 + g for g in range(3) for _ in range(2)]
    for row, trajectory in enumerate(trajectories):
        assert [trajectory.example_index] * 2 == [t.example_index for t in trajectories[row // 2 * 2 :][:2]]
        ids = last["input_ids"][row, 1:][last["loss_mask"][row]].tolist()
        assert tokenizer.decode(ids) == "".join(trajectory.actions)
        # TorchRL's layout (agents.torchrl_layout): unshifted, its assistant mask picks the same tokens
        assert last["tokens", "full"][row][last["masks", "all_assistant_mask"][row]].tolist() == ids
    collector.shutdown()


def test_coda_batches_hold_every_context_with_its_role(bm25, tokenizer):
    collector = RolloutCollector(env_fn(bm25, "coda"), OracleAgent(tokenizer), questions_per_batch=2, group_size=2)
    trajectories = collector.collect()
    batch = collector.batch_of(trajectories)
    assert batch.batch_size[0] == sum(len(t.generations) for t in trajectories) > len(trajectories)
    roles = [ROLES[i] for i in batch["role_id"].tolist()]
    assert roles == [g.role for t in trajectories for g in t.generations]
    assert set(roles) == {"planner", "executor"}
    episode_groups = {e: g for e, g in zip(batch["episode_id"].tolist(), batch["group_id"].tolist(), strict=True)}
    assert [episode_groups[e] for e in range(4)] == [0, 0, 1, 1]
    collector.shutdown()


def test_data_order_is_seeded_and_resumable(bm25, tokenizer):
    def make(seed: int) -> RolloutCollector:
        return RolloutCollector(
            env_fn(bm25), OracleAgent(tokenizer), questions_per_batch=2, group_size=1, indices=range(7), seed=seed
        )

    uninterrupted = questions(make(3), 6)
    assert questions(make(3), 6) == uninterrupted
    assert questions(make(4), 6) != uninterrupted
    drawn = [q for batch in uninterrupted for q, _ in batch]
    assert sorted(drawn[:7]) == list(range(7))  # an epoch is a permutation
    assert len(set(drawn[7:12])) == 5 and drawn[7:12] != drawn[:5]  # the next one is reshuffled
    assert [g for batch in uninterrupted for _, g in batch] == list(range(12))

    first = make(3)
    assert questions(first, 2) == uninterrupted[:2]
    state = first.state_dict()
    assert state == {"seed": 3, "epoch": 0, "position": 4, "batches_done": 2}
    resumed = make(99)  # a different seed: the state brings the right one back
    resumed.load_state_dict(state)
    assert questions(resumed, 4) == uninterrupted[2:]
    resumed.set_seed(3)  # reseeding restarts the order from the beginning
    assert questions(resumed, 1) == uninterrupted[:1]


def test_tiny_model_batches_record_sampling_logprobs(bm25):
    from agents.models import tiny_model
    from agents.samplers import HFSampler
    from agents.search_agents import SearchR1Agent

    model, tokenizer = tiny_model(seed=0)
    agent = SearchR1Agent(HFSampler(model, tokenizer), SamplingParams(max_new_tokens=8, temperature=1.0))
    make_env = lambda: gym.make("RedCoda-HotpotQA-v0", split="dev", retriever=bm25, max_turns=2)
    collector = RolloutCollector(make_env, agent, questions_per_batch=2, group_size=2, total_batches=1, seed=1)
    trajectories = collector.collect()
    batch = collector.batch_of(trajectories)
    mask = batch["loss_mask"]
    assert int(mask.sum()) == sum(g.num_sampled for t in trajectories for g in t.generations) > 0
    assert torch.all(batch["old_logp"][mask] < 0) and torch.all(batch["old_logp"][~mask] == 0)
    assert torch.all(batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id)
    assert batch["group_id"].tolist() == [0, 0, 1, 1]
    collector.update_policy_weights_()  # the HF sampler shares the model object: nothing to copy
    collector.shutdown()


def test_torchrl_code_can_drive_it_as_a_collector(bm25, tokenizer):
    """Iteration, next(), len(), hooks and a TorchRL replay buffer, as TorchRL code uses its own collectors."""
    from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer

    hooks = []
    collector = RolloutCollector(
        env_fn(bm25),
        OracleAgent(tokenizer),
        questions_per_batch=2,
        group_size=2,
        total_batches=3,
        indices=range(20),
        pre_collect_hook=lambda: hooks.append("pre"),
        post_collect_hook=lambda batch: hooks.append(batch.batch_size[0]),
    )
    assert len(collector) == 3 and collector.total_frames == 12 and collector.frames_per_batch == 4
    first = collector.next()  # BaseCollector's next(): one batch from its iterator
    assert isinstance(first, TensorDict) and first.batch_size == torch.Size([4])
    buffer = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=3)
    buffer.extend(first)
    sample = buffer.sample()
    assert sample.batch_size == torch.Size([3]) and set(sample.keys()) >= {"input_ids", "loss_mask", "reward"}
    rest = list(collector)  # the base class's iteration goes on from the collector's state
    assert len(rest) == 2 and collector.batches_done == 3
    episodes = ReplayBuffer(storage=ListStorage(16))  # batches of unequal padded lengths: one row per item
    for batch in rest:
        for row in batch.unbind(0):
            episodes.add(row)
    assert len(episodes) == 8 and len(buffer) == 4
    assert hooks == ["pre", 4] * 3
    assert collector.next() is None  # total_batches reached
    collector.shutdown()
    with pytest.raises(RuntimeError):
        len(RolloutCollector(env_fn(bm25), OracleAgent(tokenizer), questions_per_batch=1, group_size=1))


def test_a_smaller_batch_when_the_trainer_asks_for_one(bm25, tokenizer):
    """``batch_questions``: the batches iteration yields from then on hold that many questions (a probe batch)."""
    collector = RolloutCollector(
        env_fn(bm25), OracleAgent(tokenizer), questions_per_batch=2, group_size=2, indices=range(20), seed=5
    )
    batches = iter(collector)
    collector.batch_questions = 1
    probe = next(batches)
    assert probe.batch_size == torch.Size([2]) and probe["group_id"].tolist() == [0, 0]
    collector.batch_questions = None
    full = next(batches)
    assert full.batch_size == torch.Size([4]) and full["group_id"].tolist() == [2, 2, 3, 3]
    assert collector.state_dict()["position"] == 3 and collector.batches_done == 2
    collector.shutdown()


class _RecordingSampler:
    """A sampler with its own copy of the weights (as vLLM's): records what `load_weights` got."""

    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights) -> None:
        self.loads.append(dict(weights))


def _bare_collector(agent) -> RolloutCollector:
    return RolloutCollector(lambda: SimpleNamespace(close=lambda: None), agent, 1, 1, indices=range(3))


def test_weights_reach_a_sampler_through_torchrl_weight_sync_in_every_form():
    """`update_policy_weights_` is TorchRL's own, backed by a weight-sync scheme that calls the sampler's push."""
    sampler = _RecordingSampler()
    collector = _bare_collector(SimpleNamespace(sampler=sampler))
    assert isinstance(collector._weight_sync_schemes["policy"], WeightSyncScheme)
    assert collector.weight_updater is None  # TorchRL 0.14's single-process Collector also leaves it None
    module = torch.nn.Linear(2, 3)
    expected = {name: value for name, value in module.state_dict().items()}
    collector.update_policy_weights_(module)
    collector.update_policy_weights_(policy=module)
    collector.update_policy_weights_(weights=module.state_dict())
    collector.update_policy_weights_(list(module.named_parameters()))
    collector.update_policy_weights_(TensorDict({"weight": module.weight.detach(), "bias": module.bias.detach()}, []))
    assert len(sampler.loads) == 5
    for got in sampler.loads:
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    collector.update_policy_weights_()  # no weights given: nothing to send (no server copy to fetch them from)
    assert len(sampler.loads) == 5
    # a sampler that samples from the trainer's model itself (transformers) has nothing to receive
    _bare_collector(SimpleNamespace(sampler=object())).update_policy_weights_(module)
    collector.update_policy_weights_(TensorDict({"layer": {"weight": module.weight.detach()}}, []))
    assert list(sampler.loads[-1]) == ["layer.weight"]  # nested TensorDict keys joined by "."
    collector.shutdown()
