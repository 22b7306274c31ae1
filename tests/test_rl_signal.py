"""RL steps that carry a gradient: per-search credit, the signal normaliser, dynamic sampling, the question draw and
the per-term gradient norms, on hand-built episodes (the arithmetic) and through the real trainer at tiny size."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from agents.collate import collate_trajectories
from agents.records import Generation, SearchTurn, Trajectory
from algos.config import preset_config
from algos.dynamic_sampling import signal_groups, signal_rows
from algos.objectives.credit import search_advantages, search_rewards, token_advantages
from algos.objectives.losses import kl_per_token
from algos.run.training_run import TrainingRun


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


def _with_rewards(trajectories, rewards):
    return [dataclasses.replace(t, reward=r) for t, r in zip(trajectories, rewards, strict=True)]


def _grad_norm(run: TrainingRun) -> float:
    return float(torch.cat([p.grad.flatten() for p in run.trainable if p.grad is not None]).norm())


def test_each_terms_gradient_norm_is_that_terms_alone(tmp_path):
    """rl/grad_norm is the norm of the RL term's gradient alone and sft/grad_norm the SFT term's alone, each measured
    by a backward pass of that term only (not the total, not the other)."""
    run = _run(tmp_path, "norms", algo="red_grpo")
    try:
        batch = collate_trajectories(run.collector.collect(), pad_token_id=run.pad_id)
        batch["adv"] = torch.linspace(-1.0, 1.0, batch.batch_size[0])  # every context carries a signal
        sft_batch, learner = run.learner.sft_minibatch(0), run.learner
        run.optimizer.zero_grad(set_to_none=True)
        learner.accumulate_gradients(batch)
        rl_alone = _grad_norm(run)
        run.optimizer.zero_grad(set_to_none=True)
        learner._sft_backward(sft_batch, 0.5)
        sft_alone = _grad_norm(run)
        run.optimizer.zero_grad(set_to_none=True)
        learner.accumulate_gradients(batch, sft_batch, 0.5)
        both = learner.term_grad_norms()
        total = _grad_norm(run)
    finally:
        run.close()
    assert both["rl/grad_norm"] == pytest.approx(rl_alone, rel=1e-4)
    assert both["sft/grad_norm"] == pytest.approx(sft_alone, rel=1e-4)
    assert abs(total - sft_alone) > 1e-3 * total and abs(total - rl_alone) > 1e-3 * total  # neither is the total


def test_the_signal_rows_share_counts_the_contexts_whose_group_untied(tmp_path):
    run = _run(tmp_path, "share", algo="grpo")
    try:
        trajectories = _with_rewards(run.collector.collect(), [1.0, 0.0, 0.5, 0.5])  # group 0 untied, group 1 tied
        batch, metrics = run.learner.make_batch(trajectories)
    finally:
        run.close()
    untied = sum(int(e) in (0, 1) for e in batch["episode_id"])
    assert metrics["rl/signal_rows"] == pytest.approx(untied / batch.batch_size[0]) and 0 < untied < len(batch)


@pytest.mark.parametrize("agg", ["token-mean", "signal-token-mean"])
def test_the_kl_term_is_a_mean_over_every_sampled_token_whatever_the_aggregation(tmp_path, agg):
    """An all-tied step under the signal normaliser: no token carries a policy signal, and the KL term is still the
    token mean over every sampled token (not a sum, not inflated)."""
    run = _run(tmp_path, f"kl-{agg}", algo="grpo", kl_coef=0.5, loss_agg=agg)
    try:
        batch = collate_trajectories(run.collector.collect(), pad_token_id=run.pad_id)
        batch["adv"] = torch.zeros(batch.batch_size[0])
        with torch.no_grad():
            run.policy.lm_head.weight.add_(0.01)  # the policy moves off the reference
        metrics = run.learner._rl_backward(batch)
        part = run.learner._rows(batch, range(batch.batch_size[0]))
        with torch.no_grad():
            logp, _ = run.learner._logprobs(run.policy, part)
            ref, _ = run.learner._logprobs(run.ref_model, part)
    finally:
        run.close()
    mask = part["loss_mask"]
    expected = 0.5 * float(kl_per_token(logp, ref, mask)[mask].mean())
    assert expected > 0 and metrics["loss_kl"] == pytest.approx(expected, rel=1e-4) and metrics["loss_pg"] == 0


def test_the_signal_normaliser_divides_by_the_tokens_of_rows_with_an_advantage(tmp_path):
    """--loss-agg signal-token-mean: the same policy-gradient loss times (all sampled tokens / signal rows' tokens)."""
    losses = {}
    for agg in ("token-mean", "signal-token-mean"):
        run = _run(tmp_path, f"n-{agg}", algo="grpo", loss_agg=agg)
        try:
            batch = collate_trajectories(run.collector.collect(), pad_token_id=run.pad_id)
            batch["adv"] = torch.zeros(batch.batch_size[0])
            batch["adv"][0] = 1.0  # one context carries a signal
            metrics = run.learner._rl_backward(batch)
            losses[agg] = metrics["loss_pg"]
            ratio = float(batch["loss_mask"].sum()) / float(batch["loss_mask"][0].sum())
        finally:
            run.close()
    assert ratio > 1 and losses["token-mean"] != 0
    assert losses["signal-token-mean"] == pytest.approx(losses["token-mean"] * ratio, rel=1e-4)


@pytest.mark.parametrize(("advantage", "scale"), [("group", False), ("dr_grpo", True)])
def test_unscaled_advantages_keep_the_reward_gap(tmp_path, advantage, scale):
    """Dr. GRPO end to end (--no-advantage-std-scale, or --advantage dr_grpo): reward minus the group mean, where a
    std division would make every untied pair +-0.707."""
    run = _run(tmp_path, f"dr-{advantage}", algo="grpo", advantage=advantage, advantage_std_scale=scale)
    try:
        trajectories = _with_rewards(run.collector.collect(), [1.0, 0.0, 2.0, -1.0])
        batch, _ = run.learner.make_batch(trajectories)
    finally:
        run.close()
    expected = torch.tensor([0.5, -0.5, 1.5, -1.5])  # by hand: (1, 0) - 0.5, (2, -1) - 0.5
    assert torch.allclose(batch["adv"], expected[batch["episode_id"]], atol=1e-6)


def test_dynamic_sampling_replays_new_questions_for_tied_groups_and_counts_the_cost(tmp_path):
    """The real collector with its rewards set by hand: the first batch ties (2 questions), the next (the 2 missing)
    has one untied group, the last (the 1 still missing) an untied one: 2 more batches, 10 episodes, 2 groups kept."""
    run = _run(tmp_path, "ds", algo="grpo", steps=1, max_resample_batches=2)
    collect = run.collector.collect
    planned = iter([[0.5, 0.5, 1.0, 1.0], [1.0, 0.0, 0.5, 0.5], [0.0, 1.0]])

    def collect_with_rewards(n=None):
        return _with_rewards(collect(n), next(planned))

    run.collector.collect = collect_with_rewards
    try:
        metrics = run.learner.train_step()
        batches = run.collector.batches_done
    finally:
        run.close()
    assert (metrics["train/resample_batches"], batches, metrics["train/episodes"]) == (2, 3, 10)
    assert metrics["train/groups_kept"] == 2 and metrics["rl/signal_rows"] == 1.0


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
    assert difficulty.reachable(range(4), ["first", "unreachable", "bridge", "yes_no"]) == [0, 2, 3]
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


def test_the_step_signal_report_finds_the_longest_run_of_f1_zero_steps():
    from benchmarks.step_signal import longest_zero_run, summarize

    assert longest_zero_run([0.0, 0.5, 0.0, 0.0, 0.0, float("nan"), 0.0, 0.2]) == 3
    assert longest_zero_run([0.1, 0.2]) == 0 and longest_zero_run([]) == 0
    f1 = [0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.5]
    rows = [{"train/episodes": 4, "rl/signal_rows": 0.0, "answer_f1/mean": value} for value in f1]
    assert summarize(rows)["longest_f1_zero_run"] == 4
