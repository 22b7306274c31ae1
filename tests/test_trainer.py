"""The training loop on a tiny real model, the real env and a real BM25 index: updates, masking, exact resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from agents.collate import collate_trajectories
from algos import episode_checks
from algos.batch import micro_batches
from algos.config import preset_config
from algos.run.training_run import TrainingRun, TrainingStopped, lr_factor


def _run(tmp_path, name: str, **overrides) -> TrainingRun:
    return TrainingRun(preset_config("tiny", run_dir=str(tmp_path / name), **overrides))


def _params(run: TrainingRun) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in run.policy.named_parameters()}


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 100, 40, 60, 7, 300]
    groups = micro_batches(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 128
    assert groups[0] == [5]  # longer than the budget: alone


def test_parameters_change_after_one_step(tmp_path):
    run = _run(tmp_path, "sft", algo="grpo_sft", steps=1)
    try:
        before = _params(run)
        metrics = run.learner.train_step()
        after = _params(run)
    finally:
        run.close()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before)  # weight decay is 0 in the tiny preset: every change is a gradient step
    assert metrics["loss_sft"] > 0 and metrics["sft/weight"] == 1.0
    assert run.learner.progress_fields(metrics) == {
        "reward": f"{metrics['critic/rewards/mean']:.2f}",
        "f1": f"{metrics['answer_f1/mean']:.3f}",
        "w": "1.00",
    }
    for key in ("critic/rewards/mean", "answer_f1/mean", "format_scores/mean", "time/generation", "tokens/s"):
        assert np.isfinite(metrics[key]), key


def test_no_context_grad_keeps_the_losses_and_changes_the_update(tmp_path):
    """--no-context-grad through the trainer: the same step-1 losses (same log-probs, same data), other weights."""
    runs = {}
    for context_grad in (True, False):
        run = _run(tmp_path, f"cg-{context_grad}", algo="grpo_sft", steps=1, context_grad=context_grad)
        try:
            metrics = run.learner.train_step()
            runs[context_grad] = (metrics, _params(run))
        finally:
            run.close()
    (full, full_weights), (narrow, narrow_weights) = runs[True], runs[False]
    for key in ("loss_sft", "sft/entropy", "loss_pg", "critic/rewards/mean"):
        assert narrow[key] == pytest.approx(full[key], abs=1e-5), key
    assert any(not torch.allclose(full_weights[k], narrow_weights[k], atol=1e-7) for k in full_weights)


def test_policy_gradient_sees_only_sampled_tokens(tmp_path):
    """Garbage off the loss mask changes nothing; skipping zero-advantage contexts changes nothing either."""
    run = _run(tmp_path, "pg", algo="grpo")
    try:
        trajectories = run.collector.collect()
        adv = torch.tensor([1.0, -1.0, 0.0, 0.0][: len(trajectories)])  # (B,): two contexts with no signal
        batch = collate_trajectories(trajectories, pad_token_id=run.pad_id)
        batch["adv"] = adv[batch["episode_id"]]
        mask = batch["loss_mask"]
        tokenizer = run.tokenizer
        for traj, row in zip(trajectories, range(len(trajectories)), strict=True):
            sampled = batch["input_ids"][row, 1:][mask[row]].tolist()
            assert tokenizer.decode(sampled, skip_special_tokens=True).startswith(traj.actions[0][:10])

        def grads(b) -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=False)
            run.learner._rl_backward(b)
            return torch.cat([p.grad.flatten() for p in run.trainable])

        reference = grads(batch)
        assert reference.abs().sum() > 0
        garbage = batch.clone()
        garbage["old_logp"] = torch.where(mask, batch["old_logp"], torch.randn_like(batch["old_logp"]) * 100)
        torch.testing.assert_close(grads(garbage), reference, rtol=0, atol=0)

        run.learner.config = run.config.with_values(skip_zero_advantage=False)
        torch.testing.assert_close(grads(batch), reference, rtol=1e-5, atol=1e-7)

        shifted = batch.clone()
        shifted["old_logp"] = torch.where(mask, batch["old_logp"] - 0.1, batch["old_logp"])
        assert not torch.allclose(grads(shifted), reference)
    finally:
        run.close()


@pytest.mark.parametrize("lr_schedule", ["constant", "linear"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, lr_schedule):
    """2 straight steps == 1 step, save, scrambled process state, resume, 1 step (RED: SFT, EMAs, data order, lr)."""
    straight = _run(tmp_path, "straight", algo="red_grpo", steps=2, save_every=0, lr_schedule=lr_schedule)
    try:
        straight_metrics = list(straight.steps())
        expected = _params(straight)
    finally:
        straight.close()

    first = _run(tmp_path, "resumed", algo="red_grpo", steps=1, save_every=0, lr_schedule=lr_schedule)
    try:
        list(first.steps())
        first.save()
    finally:
        first.close()
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)

    resumed = _run(tmp_path, "resumed", algo="red_grpo", steps=2, resume=True, seed=0, lr_schedule=lr_schedule)
    try:
        assert resumed.step == 1
        resumed_metrics = list(resumed.steps())
        got = _params(resumed)
    finally:
        resumed.close()
    assert len(resumed_metrics) == 1
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    for key in ("loss_sft", "loss_pg", "critic/rewards/mean", "red/final_weight", "red/h_rl", "red/h_sft", "train/lr"):
        assert resumed_metrics[0][key] == pytest.approx(straight_metrics[1][key], rel=1e-6, abs=1e-9), key
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


def test_linear_lr_schedule_decays_over_steps_or_minutes_whichever_ends_first(tmp_path):
    assert [lr_factor("constant", d) for d in (0.0, 0.5, 1.0)] == [1.0, 1.0, 1.0]
    assert [lr_factor("linear", d) for d in (-1.0, 0.0, 0.5, 1.0, 2.0)] == pytest.approx([1.0, 1.0, 0.55, 0.1, 0.1])
    assert [lr_factor("cooldown", d) for d in (0.0, 0.8, 0.9, 1.0, 2.0)] == pytest.approx([1.0, 1.0, 0.55, 0.1, 0.1])
    run = _run(tmp_path, "lr", steps=4, lr=1e-3, lr_schedule="linear", max_train_minutes=10.0)
    try:
        lrs = []
        for _ in run.steps():
            lrs.append(run.optimizer.param_groups[0]["lr"])
        assert lrs == pytest.approx([1e-3 * (1 - 0.9 * k / 4) for k in range(4)])  # by steps: 0, 1/4, 2/4, 3/4 done
        run.elapsed = 9 * 60.0  # 90% of the minutes: further along than 4 of 4 steps would say
        run.step = 0
        run.set_lr()
        assert run.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 0.9 * 0.9))
    finally:
        run.close()


@pytest.mark.parametrize(("schedule", "stable"), [("linear", 0), ("cooldown", 80)])
def test_lr_schedules_are_transformers_warmup_stable_decay_at_whole_steps(schedule, stable):
    """At whole steps of a fixed run our factors are transformers' WSD (linear decay to 0.1); `lr_factor` stays ours
    because `done` also follows the minutes budget."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    decay = {"num_stable_steps": stable, "num_decay_steps": 100 - stable, "min_lr_ratio": 0.1, "decay_type": "linear"}
    wsd = get_scheduler("warmup_stable_decay", optimizer, num_warmup_steps=0, scheduler_specific_kwargs=decay)
    expected = [wsd.lr_lambdas[0](i) for i in range(101)]
    assert [lr_factor(schedule, i / 100) for i in range(101)] == pytest.approx(expected)


def test_refuses_to_overwrite_a_run(tmp_path):
    run = _run(tmp_path, "run", algo="grpo", steps=1)
    try:
        run.save()
    finally:
        run.close()
    with pytest.raises(FileExistsError, match="--resume"):
        _run(tmp_path, "run", algo="grpo", steps=1)


def test_lora_trains_only_the_adapter_and_saves_a_merged_model(tmp_path):
    from agents.models import load_model

    run = _run(tmp_path, "lora", algo="grpo_sft", steps=1, lora=True, lora_rank=4)
    try:
        before = _params(run)
        list(run.steps())
        after = _params(run)
        checkpoint = run.save()
        final = run.save_final_model()
    finally:
        run.close()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all("lora_" in name for name in changed)
    from safetensors.torch import load_file

    assert set(load_file(str(checkpoint / "weights.safetensors"))) == {n for n in before if "lora_" in n}
    merged, _ = load_model(final, device="cpu")
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_a_dead_retrieval_server_stops_the_run_before_the_update(tmp_path, bm25, serve_app):
    """Searches that fail are counted and logged; past max_retrieval_error_rate the step stops the run."""
    from agents.oracle import OracleAgent
    from retrievers.server import create_app

    url, stop = serve_app(create_app(bm25))
    run = _run(tmp_path, "dead", algo="grpo", retriever=url, retriever_timeout=5, retriever_retries=0)
    try:
        assert run.collector.envs[0].unwrapped.retriever.inner.retries == 0  # the client behind the query cache
        run.collector.agent = OracleAgent(run.tokenizer)  # a policy that always searches
        infos = [t.info for t in run.collector.collect()]
        assert sum(i["num_searches"] for i in infos) > 0
        assert episode_checks.check_retrieval(infos, 1, run.config) == (0, 0.0)
        before = _params(run)
        stop()  # the server dies mid-run
        with pytest.raises(TrainingStopped, match=r"step 1: (\d+) of \1 searches failed \(100%.*ConnectError"):
            run.learner.train_step()
        assert all(torch.equal(before[name], value) for name, value in _params(run).items())  # no update
        infos = [t.info for t in run.collector.collect()]  # the next batch meets the dead server too
        assert all(i["num_searches"] == 0 and i["retrieval_errors"] > 0 for i in infos)
        never_stop = run.config.with_values(max_retrieval_error_rate=1.0)
        errors, rate = episode_checks.check_retrieval(infos, 1, never_stop)
        assert errors == sum(i["retrieval_errors"] for i in infos) and rate == 1.0
    finally:
        run.close()
    assert (tmp_path / "dead" / "metrics.jsonl").read_text() == ""


def _snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_tie_probes_flag_is_the_learners_checkpoint_state_and_an_older_checkpoints_joins_it():
    """The GRPO learner keeps whether the last step tied in its own checkpoint state; a checkpoint written when the run
    kept it at the top level hands it to the learner the same way."""
    from algos.run.checkpointing import _learner_state

    assert _learner_state({"last_step_tied": True, "learner": {}}) == {"last_step_tied": True}  # an older checkpoint
    assert _learner_state({"learner": {"last_step_tied": False}}) == {"last_step_tied": False}
    assert _learner_state({}) == {}


def test_resume_without_a_usable_checkpoint_is_an_error_that_changes_nothing(tmp_path):

    with pytest.raises(TrainingStopped, match="no checkpoint in .* drop --resume"):
        _run(tmp_path, "empty", algo="grpo", resume=True)
    assert not (tmp_path / "empty").exists()

    run = _run(tmp_path, "run", algo="grpo", steps=2)
    try:
        list(run.steps())  # a checkpoint at step 1 (save_every 1), two metrics rows
    finally:
        run.close()
    weights = tmp_path / "run" / "checkpoints" / "step_000001" / "weights.safetensors"
    weights.write_bytes(np.random.default_rng(0).bytes(weights.stat().st_size))  # same size: only a checksum sees it
    before = _snapshot(tmp_path / "run")
    with pytest.raises(TrainingStopped, match=r"no valid checkpoint .*step_000001: weights.safetensors: SHA-256"):
        _run(tmp_path, "run", algo="grpo", steps=2, resume=True)
    assert _snapshot(tmp_path / "run") == before  # metrics.jsonl and the damaged checkpoint are as they were
    with pytest.raises(FileExistsError, match="--resume"):  # and a new run does not overwrite it either
        _run(tmp_path, "run", algo="grpo", steps=2)


def test_a_metrics_row_lost_after_its_checkpoint_comes_back_on_resume(tmp_path):
    """Killed between the checkpoint commit and the metrics write: the checkpoint carries the row."""
    import json

    run = _run(tmp_path, "run", algo="grpo", steps=2)
    try:
        first = next(run.steps())  # step 1: checkpoint, then its row
    finally:
        run.close()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss_p')  # the row never made it whole
    resumed = _run(tmp_path, "run", algo="grpo", steps=2, resume=True)
    try:
        assert resumed.step == 1
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert rows == [{k: v for k, v in first.items() if k != "time/checkpoint"}]
        list(resumed.steps())
    finally:
        resumed.close()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_the_weight_average_is_the_final_model_and_resumes_exactly(tmp_path):
    """--weight-average: the final weights are the moving average of every step's weights (its decay warming up as
    documented), the steps themselves train the un-averaged weights, and a resumed run ends with the same average."""
    decay = 0.5
    straight = _run(tmp_path, "straight", algo="red_grpo", steps=3, save_every=0, weight_average=decay)
    try:
        expected = _params(straight)
        for metrics in straight.steps():
            step, now = metrics["step"], _params(straight)
            d = min(decay, (1 + step) / (10 + step))
            expected = {name: d * expected[name] + (1 - d) * now[name] for name in expected}
        last = _params(straight)
        straight.use_average()
        averaged = _params(straight)
    finally:
        straight.close()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(last[name], averaged[name]) for name in last)  # the average is not the last step

    first = _run(tmp_path, "resumed", algo="red_grpo", steps=2, save_every=0, weight_average=decay)
    try:
        list(first.steps())
        first.save()
        with first.averaged_weights():  # swapped in and back: the training weights are untouched
            pass
        kept = _params(first)
    finally:
        first.close()
    resumed = _run(tmp_path, "resumed", algo="red_grpo", steps=3, resume=True, weight_average=decay)
    try:
        assert all(torch.equal(p, kept[name]) for name, p in _params(resumed).items())
        list(resumed.steps())
        resumed.use_average()
        got = _params(resumed)
    finally:
        resumed.close()
    for name, value in averaged.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_run_with_a_weight_average_saves_and_scores_the_average(tmp_path):
    """The whole run (train): final/ holds the averaged weights, not the last step's."""
    from agents.models import load_model

    run = _run(tmp_path, "run", algo="grpo_sft", steps=2, weight_average=0.9, eval_questions=0)
    try:
        summary = run.train()
        names = [name for name, p in run.policy.named_parameters() if p.requires_grad]
        averaged = {name: t.detach().clone() for name, t in zip(names, run.average, strict=True)}
    finally:
        run.close()
    model, _ = load_model(summary["final_model"])
    state = model.state_dict()
    for name, value in averaged.items():
        torch.testing.assert_close(state[name], value, msg=name)


def test_validation_questions_are_the_splits_last_and_never_trained_on():
    from algos.run.setup import training_indices, validation_indices

    config = preset_config("tiny", num_questions=None, validation_questions=10)
    assert training_indices(config, 100) == range(90) and validation_indices(config, 100) == range(90, 100)
    assert training_indices(config.with_values(num_questions=95), 100) == range(90)  # never overlapping
    assert training_indices(config.with_values(num_questions=16), 100) == range(16)
    assert validation_indices(config.with_values(validation_questions=0), 100) == range(0)
    with pytest.raises(Exception, match="--validation-questions 10 leaves none of the 10 training questions"):
        training_indices(config, 10)


def _selected_run(tmp_path, monkeypatch, f1_by_checkpoint=None):
    """A 3-step run keeping every step's checkpoint, its final model chosen on 4 validation questions; with
    `f1_by_checkpoint`, the validation scores are those (the rule alone), else the real scores of the real run."""
    import algos.run.evaluation as evaluation
    from agents.models import load_model
    from algos.checkpoints.store import load_checkpoint

    if f1_by_checkpoint is not None:
        real = evaluation.score_held_out

        def scored(model, config, *, label=None, validation=None):
            result = real(model, config, label=label, validation=validation[:1])
            result["metrics"]["f1"]["mean"] = f1_by_checkpoint[label]
            return result

        monkeypatch.setattr(evaluation, "score_held_out", scored)
    run = _run(
        tmp_path,
        "run",
        algo="red_grpo",
        steps=3,
        save_every=1,
        keep_checkpoints=3,
        validation_questions=4,
        eval_questions=0,
    )
    try:
        split_size = run.collector.envs[0].unwrapped.num_examples
        assert list(run.validation_indices) == list(range(split_size - 4, split_size))
        assert not set(run.collector.indices.tolist()) & set(run.validation_indices)
        summary = run.train()
    finally:
        run.close()
    validation = summary["validation"]
    model, _ = load_model(summary["final_model"])
    chosen = load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{validation['selected_step']:06d}").weights
    state = model.state_dict()
    for name, value in chosen.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    return validation


def test_the_final_model_is_the_kept_checkpoint_best_on_validation_questions(tmp_path, monkeypatch):
    validation = _selected_run(tmp_path, monkeypatch, {"step_000001": 0.2, "step_000002": 0.5, "step_000003": 0.1})
    assert validation["selected_step"] == 2 and validation["last_step"] == 3
    assert [c["step"] for c in validation["candidates"]] == [3, 2, 1]
    assert (tmp_path / "run" / "validation.json").is_file()


def test_on_a_tie_the_later_checkpoint_stays_the_final_model(tmp_path, monkeypatch):
    validation = _selected_run(tmp_path, monkeypatch, {"step_000001": 0.5, "step_000002": 0.5, "step_000003": 0.1})
    assert validation["selected_step"] == 2


def test_validation_scores_the_real_checkpoints_on_the_held_out_training_questions(tmp_path, monkeypatch):
    validation = _selected_run(tmp_path, monkeypatch)
    assert validation["questions"] == 4 and len(validation["candidates"]) == 3
    f1 = {c["step"]: c["metrics"]["f1"]["mean"] for c in validation["candidates"]}
    assert validation["selected_step"] == max(f1, key=lambda step: (f1[step], step))
    results = __import__("json").loads((tmp_path / "run" / "validation.json").read_text())["results"]
    assert all(r["split"] == "train" and r["n"] == 4 for r in results)


def test_validation_refuses_a_weight_average():
    with pytest.raises(ValueError, match="--validation-questions with --weight-average"):
        preset_config("tiny", validation_questions=4, weight_average=0.9)
