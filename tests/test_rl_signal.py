"""RL steps that carry a gradient: per-search credit, the signal normaliser, dynamic sampling, the question draw and
the per-term gradient norms, on hand-built episodes (the arithmetic) and through the real trainer at tiny size."""

from __future__ import annotations

import json

import pytest
import torch

from agents.collate import collate_trajectories
from agents.records import Generation, SearchTurn, Trajectory
from algos.config import preset_config
from algos.dynamic_sampling import signal_groups, signal_rows
from algos.run.training_run import TrainingRun
from algos.search_credit import search_advantages, search_rewards, token_advantages


def _generation(sampled: list[tuple[int, int]], length: int, role: str = "executor") -> Generation:
    """A context of `length` tokens whose sampled tokens are the spans ``[start, end)`` of `sampled`."""
    mask = [0] * length
    for start, end in sampled:
        mask[start:end] = [1] * (end - start)
    return Generation(tuple(range(100, 100 + length)), tuple(mask), tuple(-0.5 * m for m in mask), role)


def _search(generation: int, start: int, end: int, position: int, new: int, repeated: bool = False) -> SearchTurn:
    return SearchTurn(generation, start, end, position, new, 2, repeated)


def _episode(group: int, reward: float, generations, searches) -> Trajectory:
    return Trajectory(0, group, tuple(generations), reward, {"f1": 0.0}, searches=tuple(searches))


def test_search_rewards_are_the_new_gold_share_less_a_repeat_penalty():
    one = _episode(0, 0.0, [], [_search(0, 1, 2, 1, 1), _search(0, 3, 4, 2, 0, repeated=True)])
    two = _episode(0, 0.0, [], [_search(0, 1, 2, 1, 2)])
    assert search_rewards([one, two], repeat_penalty=0.5) == [[0.5, -0.5], [1.0]]


def test_search_advantages_are_centred_within_group_and_position_and_a_lone_search_keeps_its_reward():
    a = _episode(0, 0.0, [], [_search(0, 1, 2, 1, 0), _search(0, 3, 4, 2, 1)])  # the second search found the bridge
    b = _episode(0, 0.0, [], [_search(0, 1, 2, 1, 2)])
    c = _episode(1, 0.0, [], [_search(0, 1, 2, 1, 1)])  # another group: never compared with group 0's
    advs = search_advantages([a, b, c], repeat_penalty=0.5)
    assert advs[0] == pytest.approx([0.0 - 0.5, 0.5])  # first searches' mean (0 + 1) / 2; second alone: its 0.5
    assert advs[1] == pytest.approx([1.0 - 0.5])
    assert advs[2] == pytest.approx([0.5])  # alone in its group at position 1


def test_token_advantages_put_the_search_credit_on_that_turns_tokens_only():
    """A CoDA episode: the planner's context (row 1 here, closed last) keeps the episode advantage alone; the
    executor's search turn (tokens 4-6 of row 0) gets the episode's plus the credit; its answer turn (tokens 9-10)
    the episode's alone. Token j of a generation is column j - 1 of the shifted layout."""
    executor = _generation([(4, 7), (9, 11)], 12)
    planner = _generation([(3, 5), (8, 10)], 11, role="planner")
    found = _episode(0, 1.0, [executor, planner], [_search(0, 4, 7, 1, 2)])
    missed = _episode(0, 0.0, [_generation([(4, 7), (9, 11)], 12), planner], [_search(0, 4, 7, 1, 0)])
    batch = collate_trajectories([found, missed])
    episode_adv = torch.tensor([0.5, -0.5])
    adv = token_advantages([found, missed], episode_adv, batch, search_credit=2.0, repeat_penalty=0.5)
    assert adv.shape == batch["loss_mask"].shape
    # found's search: +0.5 episode, + 2.0 x (1.0 - mean(1.0, 0.0)) = +1.5 on its 3 tokens
    assert adv[0, 3:6].tolist() == pytest.approx([1.5, 1.5, 1.5])
    assert adv[0, 8:10].tolist() == pytest.approx([0.5, 0.5])  # its answer turn: the episode's alone
    assert adv[1][batch["loss_mask"][1]].tolist() == pytest.approx([0.5] * 4)  # the planner: the episode's alone
    assert adv[2, 3:6].tolist() == pytest.approx([-1.5] * 3)
    assert (adv[~batch["loss_mask"]] == 0).all()  # nothing off the mask


def test_signal_groups_and_rows():
    tied = [_episode(0, 1.0, [], []), _episode(0, 1.0, [], [])]
    mixed = [_episode(1, 1.0, [], []), _episode(1, 0.0, [], [])]
    searched = [_episode(2, 0.0, [], [_search(0, 1, 2, 1, 1)]), _episode(2, 0.0, [], [_search(0, 1, 2, 1, 0)])]
    assert signal_groups(tied + mixed + searched) == [1]
    assert signal_groups(tied + mixed + searched, search_credit=1.0, repeat_penalty=0.5) == [1, 2]
    batch = collate_trajectories([_episode(0, 0.0, [_generation([(2, 4)], 6)], [])] * 3)
    batch["adv"] = torch.tensor([0.0, 1.0, 0.0])
    assert signal_rows(batch).tolist() == [False, True, False]
    batch["adv"] = torch.zeros(3, 5)
    batch["adv"][2, 2] = 0.3  # on the mask (tokens 2-3 are columns 1-2)
    batch["adv"][0, 4] = 0.3  # off the mask: not a signal
    assert signal_rows(batch).tolist() == [False, False, True]


def _run(tmp_path, name: str, **overrides) -> TrainingRun:
    return TrainingRun(preset_config("tiny", run_dir=str(tmp_path / name), **overrides))


def test_an_episode_records_each_search_turn_where_its_tokens_are(tmp_path):
    """The real CoDA oracle through the real env: every search turn's span decodes to the search it made."""
    from algos.sft_data import oracle_agent

    run = _run(tmp_path, "oracle", algo="grpo", protocol="coda")
    try:
        agent = oracle_agent(run.config, run.tokenizer)
        envs = run.collector.envs[:2]
        (episode, _) = agent.rollout(envs, [0, 1], seed=0)
    finally:
        run.close()
    assert episode.searches and [s.position for s in episode.searches] == list(range(1, len(episode.searches) + 1))
    for search in episode.searches:
        generation = episode.generations[search.generation]
        assert generation.role == "executor" and all(generation.loss_mask[search.start : search.end])
        text = run.tokenizer.decode(generation.token_ids[search.start : search.end])
        assert "<search>" in text and text.rstrip().endswith("</search>")
    assert sum(s.new_gold_titles for s in episode.searches) == round(episode.info["recall"] * 2)


@pytest.mark.parametrize("norm", ["all", "signal"])
def test_the_trainer_logs_each_terms_gradient_norm_and_the_share_of_rows_with_a_signal(tmp_path, norm):
    run = _run(tmp_path, norm, algo="red_grpo", steps=1, pg_token_norm=norm, advantage_std_scale=False)
    try:
        metrics = run.learner.train_step()
    finally:
        run.close()
    assert metrics["rl/grad_norm"] >= 0 and metrics["sft/grad_norm"] > 0
    assert 0 <= metrics["rl/signal_rows"] <= 1
    assert metrics["train/grad_norm"] <= metrics["rl/grad_norm"] + metrics["sft/grad_norm"] + 1e-4  # triangle


def test_the_signal_normaliser_divides_by_the_tokens_of_rows_with_an_advantage(tmp_path):
    """pg_token_norm=signal: the same policy-gradient loss times (all sampled tokens / tokens of signal rows)."""
    losses = {}
    for norm in ("all", "signal"):
        run = _run(tmp_path, f"n-{norm}", algo="grpo", pg_token_norm=norm)
        try:
            batch = collate_trajectories(run.collector.collect(), pad_token_id=run.pad_id)
            batch["adv"] = torch.zeros(batch.batch_size[0])
            batch["adv"][0] = 1.0  # one context carries a signal
            metrics = run.learner._rl_backward(batch)
            losses[norm] = metrics["loss_pg"]
            ratio = float(batch["loss_mask"].sum()) / float(batch["loss_mask"][0].sum())
        finally:
            run.close()
    assert losses["all"] != 0 and losses["signal"] == pytest.approx(losses["all"] * ratio, rel=1e-4)


def test_unscaled_advantages_keep_the_reward_gap(tmp_path):
    """--no-advantage-std-scale (Dr. GRPO) end to end: the batch's advantages are reward minus the group mean."""
    run = _run(tmp_path, "drgrpo", algo="grpo", advantage_std_scale=False)
    try:
        trajectories = run.collector.collect()
        batch, _ = run.learner.make_batch(trajectories)
    finally:
        run.close()
    rewards = torch.tensor([t.reward for t in trajectories])
    means = {g: rewards[[i for i, t in enumerate(trajectories) if t.group_id == g]].mean() for g in {0, 1}}
    expected = torch.stack([rewards[i] - means[t.group_id] for i, t in enumerate(trajectories)])
    assert torch.allclose(batch["adv"], expected[batch["episode_id"]], atol=1e-6)


def test_dynamic_sampling_replays_new_questions_for_tied_groups_and_counts_the_cost(tmp_path):
    """A tiny random model ties nearly every group: with --max-resample-batches 2 the step plays up to 2 more batches
    (of only the missing questions), keeps groups with a signal when any, and logs every episode it played."""
    run = _run(tmp_path, "ds", algo="grpo", steps=1, max_resample_batches=2, search_credit=1.0)
    try:
        metrics = run.learner.train_step()
        batches = run.collector.batches_done
    finally:
        run.close()
    assert 0 <= metrics["train/resample_batches"] <= 2 and batches == 1 + metrics["train/resample_batches"]
    assert metrics["train/episodes"] >= 4 and metrics["train/groups_kept"] >= 1
    if metrics["train/resample_batches"] < 2:  # it stopped early: the kept groups all carry a signal
        assert metrics["rl/signal_rows"] > 0


def test_dynamic_sampling_is_refused_under_data_parallel():
    config = preset_config("tiny", max_resample_batches=1)
    with pytest.raises(ValueError, match="one process"):
        config._check_processes(2)


def test_the_reachable_draw_leaves_out_questions_bm25_cannot_answer(tmp_path, monkeypatch):
    from algos import difficulty
    from algos.run.setup import training_indices

    monkeypatch.setenv("REDCODA_CACHE", str(tmp_path / "cache"))
    config = preset_config("tiny", question_draw="reachable", retriever="bm25-python", num_questions=None)
    kinds = difficulty.build_table(config.env.env_id, config.env_kwargs, range(30))
    assert set(kinds) <= set(difficulty.KINDS) and "first" in kinds
    assert difficulty.reachable(range(30), kinds) == [i for i in range(30) if kinds[i] != "unreachable"]
    assert difficulty.reachable(range(2), ["unreachable", "unreachable"]) == [0, 1]  # never an empty draw
    full = ["unreachable" if i % 3 == 0 else "first" for i in range(1325)]
    path = difficulty.table_path(config.env.env_id, config.env_kwargs)
    path.parent.mkdir(parents=True)
    path.write_text('{"kinds": ' + str(full).replace("'", '"') + "}")
    assert list(training_indices(config, 1325))[:4] == [1, 2, 4, 5]


def test_the_step_signal_report_counts_signal_steps_and_reds_moves(tmp_path, capsys):
    from benchmarks.step_signal import main

    rows = [
        {"train/episodes": 4, "rl/signal_rows": 0.0, "time/step": 30.0, "red/entropy_weight": 1.0,
         "red/accuracy_factor": 5.0, "red/final_weight": 5.0, "rl/grad_norm": 0.0, "sft/grad_norm": 2.0},
        {"train/episodes": 8, "rl/signal_rows": 0.5, "time/step": 30.0, "red/entropy_weight": 2.0,
         "red/accuracy_factor": 1.0, "red/final_weight": 2.0, "rl/grad_norm": 1.0, "sft/grad_norm": 2.0},
        {"loss_sft": 1.0},  # an SFT-only row is not an RL step
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    (summary,) = main([str(path)])
    assert summary["steps"] == 2 and summary["steps_per_minute"] == pytest.approx(2.0)
    assert summary["signal_steps"] == 0.5 and summary["episodes_per_step"] == 6
    assert summary["red_entropy_inside"] == 0.5 and summary["red_accuracy_changed"] == 1.0
    assert "signal_steps 0.5" in capsys.readouterr().out
    empty = tmp_path / "sft.jsonl"
    empty.write_text(json.dumps({"loss_sft": 1.0}) + "\n")
    with pytest.raises(SystemExit) as stop:
        main([str(empty)])
    assert stop.value.code == 2
