"""Learning that can be seen: the tiny model learns demonstrations through the real trainer, and a run ends by
scoring the trained model and its starting model on held-out questions in the env it trained in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.records import SamplingParams
from agents.samplers import HFSampler
from agents.search_agents import SearchR1Agent
from algos.config import preset_config
from algos.run.evaluation import before_after, moving_average, plot_curves
from algos.run.threads import busy_cores, cpu_threads
from algos.run.training_run import TrainingRun
from algos.sft_data import demonstrations_cache_path, read_demonstrations

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _greedy_first_actions(run: TrainingRun, indices: list[int]) -> list[dict]:
    """The infos of each question's first step when the run's policy acts greedily in the training env."""
    cfg = run.config
    sampler = HFSampler(run.policy, run.tokenizer, max_context=cfg.model.max_context_tokens)
    agent = SearchR1Agent(sampler, SamplingParams(max_new_tokens=64, temperature=0.0))
    env_list = [gym.make(cfg.env.env_id, **cfg.env_kwargs) for _ in indices]
    trajectories = agent.rollout(env_list, indices, seed=0)
    infos = []
    for env, trajectory in zip(env_list, trajectories, strict=True):  # replay the first action in a fresh episode
        env.reset(options={"index": trajectory.example_index})
        infos.append(env.step(trajectory.actions[0])[4])
        env.close()
    return infos


def test_tiny_model_learns_its_demonstrations_and_acts_validly(tmp_path):
    """SFT through `Trainer` takes the demonstrations' NLL from ~ln(vocab) below 0.2, and greedy replies to the
    demonstrated questions turn from invalid text into valid actions in the real env."""
    config = preset_config(
        "tiny", algo="sft", run_dir=str(tmp_path / "run"), steps=40, lr=3e-3, sft_num_demos=16, sft_batch_size=4
    )
    run = TrainingRun(config)
    try:
        records = [json.loads(line) for line in demonstrations_cache_path(config, run.tokenizer).open()]
        kept = [r for r in records if r["grounded"] and r["f1"] > 0]
        yes_no = {a: [r["index"] for r in kept if r["answer"].strip().lower() == a] for a in ("yes", "no")}
        balanced = min(len(v) for v in yes_no.values())  # the loader drops the surplus of yes or no answers
        indices = sorted({r["index"] for r in kept} - {i for v in yes_no.values() for i in v[balanced:]})
        assert len(indices) == len(run.demos) >= 2
        before = _greedy_first_actions(run, indices)
        nll = [m["sft/nll"] for m in run.steps()]
        after = _greedy_first_actions(run, indices)
    finally:
        run.close()
    assert nll[0] > 5.0 and nll[-1] < 0.2, (nll[0], nll[-1])
    assert all(info["invalid_action"] for info in before)
    assert not any(info["invalid_action"] for info in after)
    assert all(info["doc_ids"] for info in after)  # the demonstrations' first action: a search that ran


def test_a_run_ends_with_the_before_after_table_in_its_training_env(tmp_path, monkeypatch):
    monkeypatch.setenv("REDCODA_CACHE", str(tmp_path / "cache"))
    config = preset_config("tiny", algo="red_grpo", run_dir=str(tmp_path / "run"), eval_questions=3)
    run = TrainingRun(config)
    try:
        summary = run.train()
    finally:
        run.close()
    evaluation = summary["evaluation"]
    assert evaluation["settings"]["env_kwargs"] == {**config.env_kwargs, "split": "dev"}
    assert evaluation["settings"]["max_new_tokens"] == config.rl.max_new_tokens
    for label in ("before", "after"):
        result = evaluation[label]
        assert result["n"] == 3 and [p["index"] for p in result["predictions"]] == [0, 1, 2]
        for name in ("em", "f1", "answered", "num_searches"):
            interval = result["metrics"][name]
            assert interval["low"] <= interval["mean"] <= interval["high"] and interval["n"] == 3
        for prediction in result["predictions"]:  # the training env's turn limit, not the evaluator's default
            assert prediction["num_actions"] <= config.env.max_turns
    run_dir = tmp_path / "run"
    assert "before (start)" in (run_dir / "eval.md").read_text() and "after (trained)" in evaluation["table"]
    assert json.loads((run_dir / "eval.json").read_text())["after"]["n"] == 3
    # the first-search split of the trained model's 3 questions, under the table (dev 0-2: none is yes/no)
    split = json.loads((run_dir / "eval.json").read_text())["first_search"]
    assert split["shown"]["n"] + split["not shown"]["n"] == 3 and split["yes/no"]["n"] == 0
    assert "Reading or searching" in (run_dir / "eval.md").read_text()
    assert (run_dir / "curves.png").stat().st_size > 1000
    cached = list((tmp_path / "cache" / "eval").glob("start-*.json"))
    assert len(cached) == 1  # the starting model's scores, reused by the next run with these settings
    assert json.loads(cached[0].read_text())["metrics"] == evaluation["before"]["metrics"]

    # a cache written by earlier code (other intervals) is read with today's: they come from its predictions
    stale = json.loads(cached[0].read_text())
    stale["metrics"] = {name: {"mean": 0.5, "low": 0.5, "high": 0.5, "n": 3} for name in stale["metrics"]}
    cached[0].write_text(json.dumps(stale))
    run = TrainingRun(config.with_values(run_dir=str(tmp_path / "next-run")))
    try:
        again = before_after(run)
    finally:
        run.close()
    assert again["before"]["metrics"] == evaluation["before"]["metrics"]


def test_the_starting_models_cached_scores_serve_every_seed_of_a_fixed_model(tmp_path, monkeypatch):
    """Greedy scores of fixed weights do not depend on the training seed; the tiny model's weights do."""
    from algos.run.evaluation import _starting_model_cache

    monkeypatch.setenv("REDCODA_CACHE", str(tmp_path / "cache"))
    path = lambda preset, **kw: _starting_model_cache(preset_config(preset, **kw))  # noqa: E731
    assert path("cpu", seed=0) == path("cpu", seed=1)
    assert path("cpu", seed=0) != path("cpu", seed=0, protocol="flat")  # the cpu preset's protocol is coda
    assert path("cpu", seed=0) != path("cpu", seed=0, top_k=5)
    assert path("tiny", seed=0) != path("tiny", seed=1)


def test_training_time_budget_stops_the_run_between_steps(tmp_path):
    config = preset_config("tiny", algo="grpo", run_dir=str(tmp_path / "run"), steps=5, max_train_minutes=1e-9)
    run = TrainingRun(config)
    try:
        done = list(run.steps())
    finally:
        run.close()
    assert len(done) == 1 and run.stopped_early  # a step always runs; the next would pass the budget


def test_tied_rollouts_shrink_the_next_batch_to_the_probe(tmp_path):
    """The untrained tiny model never answers: every group ties at the no-answer reward, so after the first full
    batch each step collects the probe's one question, and the step's metrics say so."""
    config = preset_config(
        "tiny", algo="red_grpo", run_dir=str(tmp_path / "run"), steps=3, questions_per_step=2, tie_probe_questions=1
    )
    run = TrainingRun(config)
    try:
        metrics = list(run.steps())
        assert run.learner.last_step_tied  # the last step's groups tied too
    finally:
        run.close()
    assert [m["train/questions"] for m in metrics] == [2, 1, 1]
    assert all(m["critic/rewards/min"] == m["critic/rewards/max"] for m in metrics)


def test_demonstrations_keep_grounded_correct_episodes_with_balanced_yes_no(tmp_path):
    from agents.models import smollm2_tokenizer

    rows = [
        {"index": 0, "f1": 1.0, "grounded": True, "answer": "Paris"},
        {"index": 1, "f1": 1.0, "grounded": False, "answer": "Rome"},  # a query the model could not have written
        {"index": 2, "f1": 0.0, "grounded": True, "answer": "Oslo"},  # wrong
        {"index": 3, "f1": 1.0, "grounded": True, "answer": "yes"},
        {"index": 4, "f1": 1.0, "grounded": True, "answer": "yes"},
        {"index": 5, "f1": 1.0, "grounded": True, "answer": "no"},
    ]
    path = tmp_path / "demos.jsonl"
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "token_ids": [1, 2, 3 + row["index"]], "loss_mask": [0, 1, 1]}) + "\n")
    kept = read_demonstrations(path, smollm2_tokenizer())
    assert sorted(d.token_ids[-1] - 3 for d in kept) == [0, 3, 5]  # one yes dropped to match the single no


def test_cpu_threads_follow_the_request_or_the_idle_cores():
    assert cpu_threads(3) == 3
    assert 1 <= cpu_threads(None) <= (os.cpu_count() or 1)
    assert busy_cores(0.01, stat="/no/such/file") is None  # then the load average decides


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the kernel's CPU counters are Linux's")
def test_busy_cores_counts_a_process_spinning_now():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores(0.5) >= 0.6  # one core's worth, whatever ran minutes ago
    finally:
        spinner.kill()
        spinner.wait()


def test_a_moving_average_trails_and_skips_missing_values():
    assert moving_average([1.0, float("nan"), 3.0, 5.0, 7.0], 2) == [1.0, 1.0, 3.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0, 6.0], 10) == [2.0, 3.0, 4.0]


def test_an_interval_whose_end_misses_its_mean_in_the_last_bit_still_plots(tmp_path):
    """Wilson's interval of a rate of 0 can start a bit above it (3e-17): the error bar is 0, not refused."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "answer_f1/mean": 0.2, "env/answered": 1.0}) + "\n")
    off = {"mean": 0.0, "low": 2.7755575615628914e-17, "high": 0.43, "n": 5}
    evaluation = {name: {"n": 5, "metrics": {"f1": off, "answered": off}} for name in ("before", "after")}
    assert plot_curves(metrics, tmp_path / "curves.png", evaluation=evaluation).stat().st_size > 1000


def test_the_curves_show_the_held_out_scores_beside_the_rollouts(tmp_path, monkeypatch):
    import matplotlib.figure

    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {
            "step": s,
            "critic/rewards/mean": -3.0 + s / 10,
            "answer_f1/mean": s / 40,
            "env/answered": 1.0,
            "sft/weight": 2.0,
        }
        for s in range(1, 13)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def scores(f1: float, answered: float) -> dict:
        interval = lambda mean: {"mean": mean, "low": mean - 0.05, "high": mean + 0.05, "n": 100}  # noqa: E731
        return {"n": 100, "metrics": {"f1": interval(f1), "answered": interval(answered)}}

    evaluation = {"before": scores(0.0, 0.1), "after": scores(0.21, 0.97)}
    validation = {
        "questions": 50,
        "selected_step": 10,
        "candidates": [{"step": s, "metrics": scores(f1, 1.0)["metrics"]} for s, f1 in ((12, 0.18), (10, 0.25))],
    }
    drawn = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kw: drawn.setdefault("fig", fig))
    assert plot_curves(metrics, tmp_path / "curves.png", evaluation=evaluation, validation=validation)

    f1_axis = next(ax for ax in drawn["fig"].axes if ax.get_title() == "answer F1")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in f1_axis.get_lines()}
    assert lines["rollouts, each step"] == ([r["step"] for r in rows], [r["answer_f1/mean"] for r in rows])
    assert lines["rollouts, 10-step mean"][1][-1] == pytest.approx(sum(r["answer_f1/mean"] for r in rows[2:]) / 10)
    assert lines["validation (50 q)"] == ([10, 12], [0.25, 0.18])  # in step order
    errorbars = {c.get_label(): c.lines[0] for c in f1_axis.containers}
    start, final = errorbars["start, held-out (100 q)"], errorbars["final, held-out (100 q)"]
    assert (list(start.get_xdata()), list(start.get_ydata())) == ([0], [0.0])
    assert (list(final.get_xdata()), list(final.get_ydata())) == ([10], [0.21])  # at the step the validation chose
    reward_axis = next(ax for ax in drawn["fig"].axes if ax.get_title() == "reward")
    assert {line.get_label() for line in reward_axis.get_lines()} == {"rollouts, each step", "rollouts, 10-step mean"}


def test_a_red_runs_curves_show_its_factors_and_its_averages_beside_each_steps_entropy(tmp_path, monkeypatch):
    import matplotlib.figure

    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {
            "step": s,
            "answer_f1/mean": 0.0,
            "sft/weight": 5.0,
            "red/final_weight": 5.0,
            "red/entropy_weight": 1.0 + s,
            "red/accuracy_factor": 5.0 / (1.0 + s),
            "train/rl_entropy": 3.0 / s,
            "red/h_rl": 3.0 - s / 10,
            "sft/entropy": 2.0 / s,
            "red/h_sft": 2.0 - s / 10,
        }
        for s in range(1, 5)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kw: drawn.setdefault("fig", fig))
    assert plot_curves(metrics, tmp_path / "curves.png")

    axes = {ax.get_title(): ax for ax in drawn["fig"].axes}
    assert {"SFT weight (RED w)", "RED's factors", "entropy (nats)"} <= set(axes)

    def lines(title: str) -> dict:
        return {line.get_label(): list(line.get_ydata()) for line in axes[title].get_lines()}

    factors = lines("RED's factors")
    assert factors["entropy weight"] == [r["red/entropy_weight"] for r in rows]
    assert factors["accuracy factor"] == [r["red/accuracy_factor"] for r in rows]
    entropy = lines("entropy (nats)")
    assert entropy["RL, each step"] == [r["train/rl_entropy"] for r in rows]
    assert entropy["RL, RED's average"] == [r["red/h_rl"] for r in rows]
    assert entropy["SFT, RED's average"] == [r["red/h_sft"] for r in rows]
