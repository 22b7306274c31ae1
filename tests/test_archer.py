"""The ArCHer-style learner (algos.archer) on a tiny real model, the real QA env and a real BM25 index."""

from __future__ import annotations

import json

import torch

from algos.config import preset_config
from algos.learners.archer import ARCHER_DEFAULTS, ARCHER_PRESETS, ArCHerConfig
from algos.learners.value import TurnCritic, turn_spans
from algos.presets import PRESETS
from algos.run.training_run import TrainingRun


def _run(tmp_path, name: str, **overrides) -> TrainingRun:
    settings = {**ARCHER_DEFAULTS, **ARCHER_PRESETS["tiny"], "algo": "archer", "run_dir": str(tmp_path / name)}
    return TrainingRun(preset_config("tiny", ArCHerConfig, **{**settings, **overrides}))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_turn_spans_are_the_runs_of_sampled_tokens():
    assert turn_spans([0, 0, 1, 1, 0, 0, 1, 0, 1, 1]) == [(2, 4), (6, 7), (8, 10)]
    assert turn_spans([0, 0]) == []


def test_runs_end_to_end_and_resumes(tmp_path):
    from algos import archer

    run_dir = tmp_path / "run"
    summary = archer.main(["--preset", "tiny", "--steps", "3", "--run-dir", str(run_dir)])
    assert summary["steps"] == 3 and summary["algo"] == "archer"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    last = rows[-1]
    for key in ("loss_pg", "critic/loss_q", "critic/loss_v", "critic/turns", "answer_f1/mean", "rl/clip_fraction"):
        assert key in last, key
    assert last["critic/updates"] == 3 * ARCHER_PRESETS["tiny"]["critic_updates"]
    assert last["critic/replay_size"] == min(sum(row["critic/turns"] for row in rows), 64)
    # it ends as every learner does: the trained and the starting model scored on held-out questions
    assert summary["evaluation"]["after"]["n"] == PRESETS["tiny"]["eval_questions"]
    assert (run_dir / "eval.md").exists()

    resumed = _run(tmp_path, "run", steps=3, resume=True)  # critic, target, optimizer and replay come back
    try:
        assert resumed.step == 3 and resumed.learner.critic_steps == last["critic/updates"]
        assert len(resumed.learner.replay) == last["critic/replay_size"]
        assert not _same(resumed.learner.critic, TurnCritic(resumed.learner.critic.v[1].in_features, 32))
        assert len(resumed.learner.critic_optimizer.state_dict()["state"]) == len(
            list(resumed.learner.critic.parameters())
        )
    finally:
        resumed.close()


def test_critic_learns_a_fixed_batch_and_its_target_refreshes_every_n_updates(tmp_path):
    run = _run(tmp_path, "critic", target_update_every=5, critic_lr=1e-2)
    try:
        episodes = run.collector.collect()
        turns, places = run.learner.encode_turns(episodes)
        assert len(places) == len(turns) and float(turns["done"].sum()) == len(episodes)
        assert turns["reward"][turns["done"] == 0].abs().sum() == 0
        run.learner.replay.push(turns)
        sample = run.learner.replay.sample(16)
        losses = []
        for update in range(1, 21):
            metrics = run.learner.critic_update(sample)
            losses.append(metrics["critic/loss_q"] + metrics["critic/loss_v"])
            assert _same(run.learner.critic, run.learner.target_critic) == (update % 5 == 0), update
        assert run.learner.target_updates == 4
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        run.close()


def test_recomputed_old_logp_logs_the_sampler_mismatch_as_the_grpo_trainer_does(tmp_path):
    run = _run(tmp_path, "mismatch", old_logp="recompute", tis_cap=2.0)
    try:
        trajectories = run.collector.collect()
        batch, metrics = run.learner.make_batch(trajectories)
        keys = {"mismatch/logp_abs_diff", "mismatch/kl", "mismatch/missing"}
        keys |= {"mismatch/tis_weight_mean", "mismatch/tis_capped_fraction"}
        assert keys <= set(metrics), sorted(metrics)
        assert metrics["mismatch/missing"] == 0.0 and metrics["mismatch/logp_abs_diff"] < 1e-3  # one model samples
        assert "is_weight" in batch.keys()
    finally:
        run.close()
