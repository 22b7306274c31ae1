"""The registered advantage estimators, policy losses and aggregations against values worked out by hand."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from agents.records import Trajectory
from algos.objectives import advantages as adv_fns
from algos.objectives import policy_losses as pl
from algos.objectives.advantages import StepInput
from algos.objectives.registry import (
    Estimator,
    UnknownPiece,
    aggregation_names,
    estimator,
    estimator_names,
    policy_loss_names,
    register_advantage,
)

S = 1 / math.sqrt(3)  # the unbiased std of (1, 0, 0)


def _config(scale: bool = True, **own: object) -> SimpleNamespace:
    rl = SimpleNamespace(advantage_std_scale=scale, kl_coef=0.0, clip_eps=0.2, clip_eps_high=None)
    return SimpleNamespace(rl=rl, **own)


def _step(rewards, groups, trees=None, batch=None, config=None, **inputs) -> StepInput:
    episodes = [Trajectory(0, g, (), r) for r, g in zip(rewards, groups, strict=True)]
    if trees is not None:
        episodes = [dataclasses.replace(t, tree_id=tree) for t, tree in zip(episodes, trees, strict=True)]
    batch = batch if batch is not None else TensorDict({}, batch_size=[0])
    return StepInput.of(episodes, batch, config or _config(), inputs=inputs)


def test_the_built_in_names():
    assert estimator_names()[:7] == ["group", "dr_grpo", "rloo", "tree", "reinforce_pp", "gae", "q_minus_v"]
    assert policy_loss_names()[:3] == ["clip", "gspo", "reinforce"]
    assert aggregation_names()[:4] == ["token-mean", "signal-token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
    with pytest.raises(UnknownPiece, match="--advantage: unknown 'nope'; registered: group, dr_grpo"):
        estimator("nope")


def test_group_dr_grpo_and_rloo_by_hand():
    step = _step([1.0, 0.0, 0.0, 2.0, 2.0], [0, 0, 0, 1, 1])  # group 1 ties
    group = adv_fns.group(step).values
    # mean 1/3, centred (2/3, -1/3, -1/3), unbiased std 1/sqrt(3)
    assert group.tolist() == pytest.approx([2 / 3 / S, -1 / 3 / S, -1 / 3 / S, 0.0, 0.0], rel=1e-5)
    centred = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0]
    assert adv_fns.dr_grpo(step).values.tolist() == pytest.approx(centred, abs=1e-6)
    unscaled = _step([1.0, 0.0, 0.0, 2.0, 2.0], [0, 0, 0, 1, 1], config=_config(scale=False))
    assert adv_fns.group(unscaled).values.tolist() == pytest.approx(centred, abs=1e-6)
    # RLOO: 1 - (0 + 0) / 2, 0 - (1 + 0) / 2, ...; a tied group is exactly 0
    loo = adv_fns.rloo(step)
    assert loo.values.tolist() == [1.0, -0.5, -0.5, 0.0, 0.0]
    assert loo.metrics["critic/advantages/abs_mean"] == pytest.approx(2.0 / 5)
    assert adv_fns.rloo(_step([0.1, 0.1, 0.1], [4, 4, 4])).values.tolist() == [0.0, 0.0, 0.0]
    assert adv_fns.rloo(_step([3.0], [0])).values.tolist() == [0.0]  # a group of one: nothing to compare


def test_tree_adds_the_trees_term_and_a_member_without_a_tree_is_its_own():
    config = _config(scale=False)
    # trees (0: rewards 1, 0) and (1: 0, 1): within-tree (.5, -.5, -.5, .5), within-group the same
    step = _step([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], trees=[0, 0, 1, 1], config=config)
    assert adv_fns.tree(step).values.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # the last two have no tree (an expert member): trees of their own, only the group's term (mean 0.5)
    members = _step([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], trees=[0, 0, None, None], config=config)
    assert members.tree_id.tolist() == [0, 0, -1, -2]
    assert adv_fns.tree(members).values.tolist() == pytest.approx([1.0, -1.0, -0.5, 0.5])
    assert adv_fns.tree(_step([1.0, 0.0], [0, 0], config=config)).values.tolist() == [0.5, -0.5]  # no trees: group


def _rows(episode_id, mask) -> TensorDict:
    mask = torch.tensor(mask, dtype=torch.bool)
    return TensorDict({"episode_id": torch.tensor(episode_id), "loss_mask": mask}, batch_size=[len(episode_id)])


def test_reinforce_pp_whitens_the_episode_reward_over_the_sampled_tokens():
    batch = _rows([0, 1], [[1, 1, 0], [1, 1, 0]])
    step = _step([1.0, 0.0], [0, 1], batch=batch)  # two groups of one: a group baseline would give 0
    adv = adv_fns.reinforce_pp(step).values
    half = 0.5 / math.sqrt(1 / 3)  # returns (1, 1, 0, 0): mean 0.5, unbiased std sqrt(1/3)
    assert adv.flatten().tolist() == pytest.approx([half, half, 0.0, -half, -half, 0.0], rel=1e-5)


def test_gae_and_q_minus_v_by_hand():
    batch = _rows([0], [[1, 1, 0]])
    config = _config(gamma=1.0, gae_lambda=1.0, whiten_advantages=False)
    step = _step([1.0], [0], batch=batch, config=config, old_values=torch.tensor([[0.5, 0.5, 0.0]]))
    out = adv_fns.gae(step)  # deltas (0 + 0.5 - 0.5, 1 - 0.5): A = (0.5, 0.5), returns A + V = (1, 1)
    assert out.values.tolist() == [[0.5, 0.5, 0.0]] and out.tensors["returns"].tolist() == [[1.0, 1.0, 0.0]]
    batch = _rows([0, 0], [[1, 1, 0], [1, 0, 0]])
    spans = torch.tensor([[0, 1, 3], [1, 1, 2]])  # turn 0: tokens 1-2 of row 0; turn 1: token 1 of row 1
    step = _step([1.0], [0], batch=batch, config=_config(whiten_advantages=False), turn_adv=torch.tensor([1.0, 3.0]),
                 turn_spans=spans)  # fmt: skip
    assert adv_fns.q_minus_v(step).values.tolist() == [[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]]
    whitened = dataclasses.replace(step, config=_config(whiten_advantages=True))
    r = 1 / math.sqrt(2)  # (1, 3): mean 2, std sqrt(2)
    assert adv_fns.q_minus_v(whitened).values.flatten().tolist() == pytest.approx([-r, -r, 0.0, r, 0.0, 0.0], rel=1e-5)


def test_the_policy_losses_by_hand():
    rl = SimpleNamespace(clip_eps=0.2, clip_eps_high=None)
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    mask = torch.tensor([[True, True, False]])
    per_token, metrics = pl.clipped_ratio(logp, old, torch.tensor([1.0]), mask, rl)
    assert per_token[mask].tolist() == pytest.approx([-1.2, -0.5])  # max(-1.5, -1.2), max(-0.5, -0.8)
    assert float(metrics["clip_fraction"]) == pytest.approx(1.0)
    high = SimpleNamespace(clip_eps=0.2, clip_eps_high=0.6)
    assert pl.clipped_ratio(logp, old, torch.tensor([1.0]), mask, high)[0][mask].tolist() == pytest.approx([-1.5, -0.5])
    # GSPO: the context's ratio exp(mean log-ratio) = exp((log 2 + 0) / 2) = sqrt(2) on both tokens
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]], requires_grad=True)
    per_token, _ = pl.sequence_ratio(logp, old, torch.tensor([1.0]), mask, rl)
    assert per_token[mask].tolist() == pytest.approx([-1.2, -1.2])  # clipped at 1.2
    wide = SimpleNamespace(clip_eps=0.9, clip_eps_high=0.9)
    per_token, _ = pl.sequence_ratio(logp, old, torch.tensor([1.0]), mask, wide)
    per_token[mask].sum().backward()  # each token's gradient is -A * s
    assert logp.grad[0, :2].tolist() == pytest.approx([-math.sqrt(2)] * 2, rel=1e-5) and logp.grad[0, 2] == 0
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    per_token, _ = pl.reinforce(logp, old, torch.tensor([2.0]), mask, rl)
    assert per_token.tolist() == [[2.0, 4.0, 0.0]]  # -A logp
    per_token.sum().backward()
    assert logp.grad.tolist() == [[-2.0, -2.0, 0.0]]


def test_the_aggregations_by_hand():
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    scale = pl.LossScale(tokens=3.0, rows=2.0, all_tokens=3.0)
    assert float(pl.token_mean(values, mask, scale)) == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert float(pl.seq_mean_token_mean(values, mask, scale)) == pytest.approx(2.25)  # (1.5 + 3) / 2
    assert float(pl.seq_mean_token_sum(values, mask, scale)) == pytest.approx(3.0)  # (3 + 3) / 2
    # the whole batch's divisors: a micro-batch of row 1 alone adds its share
    part = pl.seq_mean_token_mean(values[1:], mask[1:], scale) + pl.seq_mean_token_mean(values[:1], mask[:1], scale)
    assert float(part) == pytest.approx(2.25)


def test_an_estimator_registered_from_outside_is_used_by_name():
    def constant(step: StepInput) -> adv_fns.Advantages:
        return adv_fns.Advantages(torch.ones(len(step.episodes)), {"critic/advantages/abs_mean": 1.0})

    register_advantage(Estimator("ones_for_test", constant), replace=True)
    assert estimator("ones_for_test").function()(_step([0.0, 0.0], [0, 0])).values.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage(Estimator("group", constant))
