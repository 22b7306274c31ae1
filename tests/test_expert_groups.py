"""Expert members in the GRPO groups (algos.learners.expert, algos.learners.off_policy): the shaped off-policy loss on
hand-built tensors, and the learner on a tiny real model, the real QA env, the real oracle and a real BM25 index."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from algos.config import preset_config
from algos.learners.expert import EXPERT_METRICS, ExpertConfig
from algos.learners.off_policy import shaped_expert_loss, shaped_ratio
from algos.objectives.losses import group_advantages, policy_loss
from algos.objectives.policy_losses import LossScale
from algos.run.training_run import TrainingRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(tmp_path, name: str, **overrides) -> TrainingRun:
    settings = {"algo": "grpo_expert", "run_dir": str(tmp_path / name), "eval_questions": 0, **overrides}
    return TrainingRun(preset_config("tiny", ExpertConfig, **settings))


def test_shaped_ratio_value_and_gradient():
    gamma = 0.1
    probs = torch.tensor([[0.001, 0.1, 0.5, 0.99]])
    logp = probs.log().requires_grad_(True)
    adv = torch.tensor([2.0])
    terms = shaped_expert_loss(logp, adv, torch.ones_like(probs, dtype=torch.bool), gamma=gamma, num_tokens=8)
    expected = probs / (probs + gamma)
    assert torch.allclose(shaped_ratio(probs.log(), gamma), expected)
    assert terms["loss_expert"].item() == pytest.approx(-(2.0 * expected).sum().item() / 8, rel=1e-6)
    assert terms["shaped_ratio"].item() == pytest.approx(expected.mean().item(), rel=1e-6)
    assert terms["prob"].item() == pytest.approx(probs.mean().item(), rel=1e-6)
    terms["loss_expert"].backward()
    # d f / d logp = gamma * pi / (pi + gamma)^2: ~pi / gamma for an unlikely token (10x the plain ratio's pi)
    slope = gamma * probs / (probs + gamma) ** 2
    assert torch.allclose(logp.grad, -2.0 * slope / 8, rtol=1e-5)
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 * 0.001 / gamma / 8, rel=0.03)
    assert abs(logp.grad[0, 0]) > 9 * abs(-2.0 * probs[0, 0] / 8)  # the plain ratio's gradient, pi
    assert abs(logp.grad[0, 3]) < abs(-2.0 * probs[0, 3] / 8)  # a learnt token weighs less than under pi


def test_expert_tokens_are_not_clipped_where_the_clipped_loss_would_be():
    # a negative advantage and a ratio far below 1 - clip_eps: PPO's clip stops the gradient, the expert's is kept
    probs = torch.tensor([[0.3, 0.05]])
    adv = torch.tensor([-1.0])
    mask = torch.ones_like(probs, dtype=torch.bool)
    logp = probs.log().requires_grad_(True)
    shaped_expert_loss(logp, adv, mask, gamma=0.1)["loss_expert"].backward()
    assert torch.allclose(logp.grad, 0.1 * probs / (probs + 0.1) ** 2 / 2, rtol=1e-5)
    clipped = probs.log().requires_grad_(True)
    policy_loss(clipped, torch.zeros_like(probs), adv, mask, clip_eps=0.2)["loss_pg"].backward()
    assert torch.count_nonzero(clipped.grad) == 0


def test_expert_loss_sees_only_its_mask():
    logp = torch.tensor([[-1.0, float("-inf"), -2.0], [float("nan"), -0.5, -0.1]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, True, False]])
    adv = torch.tensor([1.0, -1.0])
    terms = shaped_expert_loss(logp, adv, mask, gamma=0.1)
    kept = torch.tensor([-1.0, -2.0, -0.5]).exp()
    signs = torch.tensor([1.0, 1.0, -1.0])
    assert terms["loss_expert"].item() == pytest.approx(-(signs * kept / (kept + 0.1)).sum().item() / 3, rel=1e-6)
    terms["loss_expert"].backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[~mask].abs().sum() == 0 and (logp.grad[mask] != 0).all()
    empty = shaped_expert_loss(logp.detach(), adv, torch.zeros_like(mask))
    assert empty["loss_expert"].item() == 0.0 and empty["shaped_ratio"].item() == 0.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    built = _run(tmp_path_factory.mktemp("expert"), "groups", grounded_expansion=True)
    yield built
    built.close()


def test_expert_member_advantage_is_relative_to_its_group(run):
    sampled = run.collector.collect()
    batch, metrics = run.learner.make_batch(sampled)
    experts = batch["expert"]  # (N,)
    assert experts.any() and not experts.all()
    assert batch["loss_mask"][experts].any()
    rewards = {int(e): float(r) for e, r in zip(batch["episode_id"], batch["reward"], strict=True)}
    groups = {int(e): int(g) for e, g in zip(batch["episode_id"], batch["group_id"], strict=True)}
    episodes = sorted(rewards)
    adv = group_advantages(
        torch.tensor([rewards[e] for e in episodes]), torch.tensor([groups[e] for e in episodes])
    )  # (B,): every member of a group, the expert too
    assert torch.allclose(batch["adv"], adv[batch["episode_id"]])
    alone = group_advantages(
        torch.tensor([t.reward for t in sampled]), torch.tensor([t.group_id for t in sampled])
    )  # without the experts
    sampled_rows = ~experts
    assert not torch.allclose(batch["adv"][sampled_rows], alone[batch["episode_id"][sampled_rows]])
    assert (batch["adv"][experts] > 0).all()  # the oracle answers; the untrained model does not
    assert batch["old_logp"][experts].abs().sum() == 0  # the oracle's behaviour probability is 1

    # the micro-batch's terms: the clipped loss on the sampled tokens, the shaped one on the expert tokens
    num_tokens = float(batch["loss_mask"].sum())
    part = run.learner._rows(batch, range(batch.batch_size[0]))
    with torch.no_grad():
        terms = run.learner.rl_loss_terms(part, LossScale(num_tokens, batch.batch_size[0], num_tokens))
        logp, _ = run.learner._logprobs(run.policy, part)
    mask, rows = part["loss_mask"], part["expert"].unsqueeze(-1)
    want_pg = policy_loss(logp, part["old_logp"], part["adv"], mask & ~rows, num_tokens=num_tokens)["loss_pg"]
    want_expert = shaped_expert_loss(logp, part["adv"], mask & rows, 0.1, num_tokens=num_tokens)["loss_expert"]
    assert terms["loss_pg"].item() == pytest.approx(want_pg.item(), rel=1e-5)
    assert terms["loss_expert"].item() == pytest.approx(want_expert.item(), rel=1e-5)
    assert terms["loss_expert"].item() < 0  # positive advantages on the expert tokens


def test_grounded_expansion_resamples_from_full_evidence_and_replaces_the_worst(run):
    envs = run.collector.envs
    # the oracle's episodes of questions 2 and 3 stand in for a group's best: every gold title shown after the
    # second search (question 2) and after the first (question 3); question 6's show half of them
    oracle = {q: run.learner.oracle.rollout(envs[:1], [q], [q], seed=0)[0] for q in (2, 3, 6)}
    assert [run.learner.evidence_point(oracle[q], envs[0]) for q in (2, 3, 6)] == [2, 1, None]
    sampled = run.agent.rollout(envs[:2], [2, 3], [2, 3], seed=0)
    assert all(run.learner.evidence_point(t, envs[0]) is None for t in sampled)  # the untrained model never searches
    worse = dataclasses.replace(sampled[0], reward=-100.0)  # any continuation beats it
    better = dataclasses.replace(sampled[1], reward=100.0)  # none beats it
    episodes, counts = run.learner.expand([oracle[2], worse, oracle[3], better])
    assert counts["expansion_groups"] == 2 and counts["expansion_replaced"] == 1
    assert episodes[0] is oracle[2] and episodes[2:] == [oracle[3], better]
    continuation = episodes[1]
    assert continuation is not worse and continuation.group_id == 2 and continuation.example_index == 2
    assert continuation.turns[:2] == oracle[2].turns[:2]  # replayed up to the full evidence, sampled after
    assert continuation.actions[:2] == oracle[2].actions[:2] and len(continuation.actions) > 2
    assert counts["expansion_gain"] == pytest.approx(continuation.reward + 100.0)


def test_grounded_expansion_refuses_tree_rollouts():
    with pytest.raises(ValueError, match="--grounded-expansion"):
        preset_config("tiny", ExpertConfig, algo="grpo_expert", grounded_expansion=True, rollout="tree", group_size=4)


def test_runs_end_to_end_logs_expert_metrics_and_resumes(tmp_path):
    from algos import grpo_expert

    run_dir = tmp_path / "run"
    argv = ["--preset", "tiny", "--steps", "2", "--eval-questions", "0", "--torch-threads", "1", "--grounded-expansion"]
    summary = grpo_expert.main([*argv, "--run-dir", str(run_dir)])
    assert summary["steps"] == 2 and summary["algo"] == "grpo_expert"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in (*EXPERT_METRICS, "expansion/group_share", "loss_pg", "loss_expert", "train/grad_norm"):
            assert key in row, key
        assert row["sft/weight"] == 0.0  # no SFT term: the demonstrations are group members
    first = rows[0]
    assert first["expert/group_share"] > 0 and first["expert/members"] >= 1
    assert first["expert/advantage_mean"] > 0 and 0 < first["expert/token_share"] < 1
    assert 0 < first["expert/shaped_ratio_mean"] < 1 / 1.1 and first["loss_expert"] < 0
    assert first["train/grad_norm"] > 0
    assert math.isfinite(first["train/rl_entropy"]) and first["train/rl_entropy"] > 1  # the sampled tokens' only

    resumed = _run(tmp_path, "run", steps=3, resume=True, grounded_expansion=True)
    try:
        assert resumed.step == 2
        resumed.train()
    finally:
        resumed.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert "expert/group_share" in rows[-1]


def test_is_a_system_of_the_comparison_with_settings_of_its_own(tmp_path):
    from algos.registry import algorithm_names
    from benchmarks.compare_runs import BUDGETS, parse_system, train_command

    assert "grpo_expert" in algorithm_names()
    system = parse_system("grpo_expert:expert_shaping=0.2,expert_members=2,grounded_expansion=true")
    assert (
        system.algo == "grpo_expert"
        and system.slug == "grpo_expert-expert_shaping0.2-expert_members2-grounded_expansiontrue"
    )
    assert system.flags == ("--expert-shaping", "0.2", "--expert-members", "2", "--grounded-expansion")
    with pytest.raises(ValueError, match="expert_shaping"):
        parse_system("grpo_sft:expert_shaping=0.2")  # another algorithm's settings lack it
    command = train_command("grpo_expert", 0, BUDGETS["tiny"], "flat", tmp_path, flags=system.flags)
    assert command[1:3] == ["-m", "algos.grpo_expert"] and command[-1] == "--grounded-expansion"
