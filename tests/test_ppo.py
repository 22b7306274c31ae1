"""PPO (algos.ppo) on a tiny real model, the real query-rewrite and QA envs and a real BM25 index."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from algos.config import QUERY_REWRITE_ENV, preset_config
from algos.learners.ppo import PPO_DEFAULTS, PPO_PRESETS, PPOConfig
from algos.learners.value import value_loss
from algos.objectives.advantages import episode_gae, gae_steps, token_rewards
from algos.run.training_run import TrainingRun

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, name: str, **overrides) -> TrainingRun:
    settings = {**PPO_DEFAULTS, **PPO_PRESETS["tiny"], "algo": "ppo", "run_dir": str(tmp_path / name), **overrides}
    return TrainingRun(preset_config("tiny", PPOConfig, **settings))


def _params(run: TrainingRun) -> dict[str, torch.Tensor]:
    named = [*run.policy.named_parameters(), *(("v." + n, p) for n, p in run.learner.value_head.named_parameters())]
    return {name: p.detach().clone() for name, p in named}


def _hand_gae(rewards, values, gamma, lam):
    """GAE written out from its definition: A_t = sum_l (gamma * lam)^l * delta_{t+l}."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (j - t) * deltas[j] for j in range(t, n)) for t in range(n)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (1.0, 0.0), (0.0, 0.95), (0.7, 1.0)])
def test_gae_matches_a_hand_computation(gamma, lam):
    rewards, values = [0.0, -0.1, 0.0, 2.0], [0.5, 0.2, -0.3, 0.4]
    adv, returns = gae_steps(torch.tensor(rewards), torch.tensor(values), gamma, lam)
    expected = _hand_gae(rewards, values, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(expected))
    torch.testing.assert_close(returns, torch.tensor(expected) + torch.tensor(values))
    if lam == 0.0:  # one-step TD errors
        torch.testing.assert_close(adv, torch.tensor([-0.3, -0.6, 0.7, 1.6]))
    if gamma == 1.0 and lam == 1.0:  # Monte-Carlo return minus the value
        torch.testing.assert_close(adv, torch.tensor([1.9, 1.9, 2.0, 2.0]) - torch.tensor(values))
    if gamma == 0.0:  # no bootstrapping at all
        torch.testing.assert_close(adv, torch.tensor(rewards) - torch.tensor(values))


def test_episode_gae_chains_generations_and_skips_observations():
    # episode 0: two generations (rows 0, 1); episode 1: row 2. Mask 0 columns are prompt/observation tokens.
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 0.3], [9.0, 9.0, 0.4, 0.5, 9.0], [0.6, 0.7, 9.0, 9.0, 9.0]])
    episode_id = torch.tensor([0, 0, 1])
    rewards_t = token_rewards(torch.tensor([1.0, -1.0]), mask, episode_id)
    assert rewards_t[1, 3] == 1.0 and rewards_t[2, 1] == -1.0 and rewards_t.abs().sum() == 2.0
    adv, returns = episode_gae(rewards_t, values, mask, episode_id, gamma=0.9, lam=0.8)
    first = _hand_gae([0, 0, 0, 0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5], 0.9, 0.8)
    second = _hand_gae([0, -1.0], [0.6, 0.7], 0.9, 0.8)
    torch.testing.assert_close(adv[mask], torch.tensor(first[:3] + first[3:] + second))
    assert adv[~mask].abs().sum() == 0 and returns[~mask].abs().sum() == 0


def test_value_loss_clipping():
    returns, old = torch.tensor([[1.0, 1.0, 1.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    # far past the clip, away from the target: the unclipped branch is larger; inside: both agree
    values = torch.tensor([[2.0, 0.1, 123.0]], requires_grad=True)
    loss, fraction = value_loss(values, old, returns, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * ((2.0 - 1.0) ** 2 + (0.1 - 1.0) ** 2) / 2)
    assert float(fraction) == 0.0
    # moved toward the target beyond the clip: the clipped branch (0.2 - 1)^2 wins and stops the gradient
    values = torch.tensor([[0.5, 0.1, 0.0]], requires_grad=True)
    loss, fraction = value_loss(values, old, returns, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * ((0.2 - 1.0) ** 2 + (0.1 - 1.0) ** 2) / 2)
    assert float(fraction) == 0.5
    loss.backward()
    assert values.grad[0, 0] == 0.0 and values.grad[0, 1] != 0.0 and values.grad[0, 2] == 0.0
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    assert float(plain.detach()) == pytest.approx(0.5 * ((0.5 - 1.0) ** 2 + (0.1 - 1.0) ** 2) / 2)


def test_one_step_changes_the_policy_and_the_value_head(tmp_path):
    run = _run(tmp_path, "step", steps=1)
    try:
        assert run.config.env.env_id == QUERY_REWRITE_ENV
        trajectories = run.collector.collect()
        batch, _ = run.learner.make_batch(trajectories)
        mask = batch["loss_mask"]
        for row, traj in enumerate(trajectories):  # the loss sees exactly the sampled action
            sampled = batch["input_ids"][row, 1:][mask[row]].tolist()
            assert run.tokenizer.decode(sampled) == traj.actions[0]
        assert batch["adv"].shape == mask.shape and batch["adv"][~mask].abs().sum() == 0
        assert float(batch["adv"][mask].mean()) == pytest.approx(0.0, abs=1e-5)  # whitened
        before = _params(run)
        metrics = run.learner.train_step()
        after = _params(run)
    finally:
        run.close()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert {"v.proj.weight", "v.proj.bias"} <= changed
    assert len(changed) == len(before)
    for key in ("loss_pg", "loss_value", "rl/kl_to_ref", "critic/explained_variance", "env/recall_at_k"):
        assert key in metrics, key
    assert metrics["loss_value"] > 0
    assert set(run.learner.progress_fields(metrics)) == {"reward", "ev"}  # no answer F1, no SFT weight to show


def test_resume_reproduces_the_next_step(tmp_path):
    """2 straight steps == 1 step, save, scrambled process state, resume, 1 step (value head and its AdamW too)."""
    straight = _run(tmp_path, "straight", steps=2, save_every=0)
    try:
        straight_metrics = list(straight.steps())
        expected = _params(straight)
    finally:
        straight.close()
    first = _run(tmp_path, "resumed", steps=1, save_every=0)
    try:
        list(first.steps())
        first.save()
    finally:
        first.close()
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)
    resumed = _run(tmp_path, "resumed", steps=2, resume=True)
    try:
        assert resumed.step == 1
        resumed_metrics = list(resumed.steps())
        got = _params(resumed)
    finally:
        resumed.close()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    for key in ("loss_pg", "loss_value", "critic/values/mean", "critic/rewards/mean"):
        assert resumed_metrics[0][key] == pytest.approx(straight_metrics[1][key], rel=1e-6, abs=1e-9), key


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a whole run in its own process; the query-rewrite env's PPO runs in-process in test_distributed
def test_command_line_on_the_query_rewrite_env(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "algos.ppo", "--preset", "tiny", "--run-dir", str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert "env/recall_at_k" in rows[-1] and "loss_value" in rows[-1]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_entry_point_on_the_qa_env(tmp_path):
    from algos import ppo

    summary = ppo.main(["--preset", "tiny", "--env-id", "RedCoda-HotpotQA-v0", "--run-dir", str(tmp_path)])
    assert summary["steps"] == 2 and summary["algo"] == "ppo"
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert "answer_f1/mean" in rows[-1] and "loss_value" in rows[-1] and "env/recall_at_k" not in rows[-1]
