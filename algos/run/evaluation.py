"""What a training run ends with: the trained model and the model it started from, scored on held-out questions.

Both models play ``config.run.eval_questions`` questions of ``config.run.eval_split`` greedily (``--eval-batch-size``
episodes at a time, on a CPU no more than fit in memory: `algos.run.memory.held_out_batch`), in exactly the env the
run trained in (`Config.env_kwargs` with only the split changed, the same turn limits, passage length,
tokens per turn and context length), through `agents.evaluation.evaluate`. The starting model's scores
depend only on those settings, so they are cached (``cache_root()/eval/``) and computed once per settings.

    result = before_after(run)              # {"before": ..., "after": ..., "table": "| model | ..."}
    python -m algos.red_grpo                # prints the table; writes eval.json, eval.md and curves.png

The table: EM, F1, the valid-answer rate (episodes ended by a valid <answer>), searches per question, and for
CoDA the planner's tasks per episode, each with its 95% interval over questions; under it, which interval each
column has (`agents.evaluation.interval_caption`) and how many episodes met sampler or retriever errors (more than
5% of them fail the evaluation instead: `agents.evaluation.EvaluationFailed`). ``curves.png`` plots reward, F1,
valid-answer rate and the SFT weight per training step from metrics.jsonl (each step and a 10-step mean), with the
held-out scores beside the rollouts':
the starting and the final model's, and each kept checkpoint's on the validation questions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class _Run(Protocol):
    """What the scoring reads of a run (`training_run.TrainingRun` is one): stated here rather than imported, so that
    the run, which calls this module, and this module do not depend on each other."""

    config: Any
    policy: Any
    tokenizer: Any
    world: Any
    run_dir: Path
    checkpoint_dir: Path
    validation_indices: Sequence[int]

    def build_model(self) -> tuple[Any, Any]: ...

    def full_weights(self) -> Any: ...

    def load_weights(self, path: Any) -> None: ...


__all__ = [
    "before_after",
    "format_before_after",
    "held_out_settings",
    "plot_curves",
    "score_held_out",
    "select_checkpoint",
    "validation_settings",
]

TABLE_METRICS = ("em", "f1", "answered", "num_searches", "num_tasks", "invalid_actions")
"""Columns of the before/after table (num_tasks only for CoDA)."""
_LABELS = {
    "em": "EM",
    "f1": "F1",
    "answered": "valid answers",
    "num_searches": "searches / question",
    "num_tasks": "planner tasks / question",
    "invalid_actions": "invalid actions",
}


def held_out_settings(config: Any) -> dict[str, Any]:
    """Everything that decides a held-out score besides the weights: one dict, also the starting model's cache key.

    The env is the run's own (`EnvSettings.env_id`, `Config.env_kwargs`) with the held-out questions in place of the
    training ones: ``eval_data_path``, else the bundled ``eval_split``.
    """
    env_kwargs = {**config.env_kwargs, "split": config.run.eval_split}
    env_kwargs.pop("data_path", None)
    if config.run.eval_data_path is not None:
        env_kwargs["data_path"] = config.run.eval_data_path
    return {
        "agent": "coda" if config.env.protocol == "coda" else "search_r1",
        **({"env_id": config.env.env_id} if config.env.env else {}),  # the default ids follow from the agent's protocol
        "env_kwargs": env_kwargs,
        "questions": int(config.run.eval_questions),
        "max_new_tokens": config.rl.max_new_tokens,
        "max_context_tokens": config.model.max_context_tokens,
        "seed": 0,
    }


def validation_settings(config: Any, questions: Sequence[int]) -> dict[str, Any]:
    """`held_out_settings` for the validation questions: `questions` of the training split itself (the ones
    `RunSettings.validation_questions` holds out of training), in the training env unchanged."""
    return {
        **held_out_settings(config),
        "env_kwargs": dict(config.env_kwargs),
        "questions": [int(i) for i in questions],
    }


def score_held_out(
    model: Any,
    config: Any,
    *,
    label: str | None = None,
    validation: Sequence[int] | None = None,
    max_error_rate: float | None = None,
) -> dict[str, Any]:
    """Score one model on the held-out questions of `config`, greedily, in its training env.

    Args:
        model: a loaded ``(model, tokenizer)`` pair, a local directory or a hub id (as `agents.evaluation.evaluate`).
        config: the run's `Config`: `held_out_settings` decides everything but the weights.
        label: the result's ``model`` field (default: the evaluator's name for `model`).
        validation: score these questions of the training split instead (`validation_settings`).
        max_error_rate: the share of episodes that may meet sampler or retriever errors (None: the run's
            ``max_eval_error_rate``), checked over every rank's episodes together.

    Returns:
        An `agents.evaluation.evaluate` result (``metrics[name]`` is ``{"mean", "low", "high", "n", "method"}``;
        CoDA also gets ``num_tasks``), with ``settings`` added.

    Raises:
        agents.evaluation.EvaluationFailed: more than `max_error_rate` of the episodes errored (on every rank).
    """
    from agents.evaluation import check_errors, error_counts, evaluate
    from algos import distributed
    from algos.run import memory

    if validation is None:  # the held-out split's first N questions (as many as it has)
        settings = held_out_settings(config)
        split, questions, limit = config.run.eval_split, range(settings["questions"]), settings["questions"]
    else:
        settings = validation_settings(config, validation)
        split, questions, limit = config.env.split, settings["questions"], None
    world = distributed.World(*_rank_and_size())
    batch = memory.held_out_batch(config, model)
    if batch < min(config.run.eval_batch_size, len(questions)):
        logger.warning(
            "held-out evaluation: %d episodes at a time instead of --eval-batch-size %d, so that their contexts fit "
            "in this machine's available memory",
            batch,
            config.run.eval_batch_size,
        )
    result = evaluate(
        settings["agent"],
        model,
        split=split,
        indices=distributed.shard(questions, world) if world.enabled else None if limit is not None else questions,
        limit=limit,
        batch=batch,
        seed=settings["seed"],
        temperature=0.0,
        max_new_tokens=settings["max_new_tokens"],
        env_id=config.env.env_id,
        env_kwargs=settings["env_kwargs"],
        max_context_tokens=settings["max_context_tokens"],
        progress=config.run.progress and world.is_main,
        max_error_rate=None,  # checked below over every rank's episodes, so that all ranks raise or none
    )
    if world.enabled:  # data-parallel ranks each scored their share: pool the predictions, score them all
        result["predictions"] = [p for part in distributed.gather_objects(result["predictions"]) for p in part]
        result["n"] = len(result["predictions"])
    result["errors"] = error_counts(result["predictions"])
    if max_error_rate is None:
        max_error_rate = config.run.max_eval_error_rate
    check_errors(result["errors"], max_error_rate)
    if label is not None:
        result["model"] = label
    result["metrics"] = _metrics(result["predictions"], settings["agent"])
    result["settings"] = settings
    return result


def _metrics(predictions: list[dict[str, Any]], agent: str) -> dict[str, dict[str, float | int]]:
    """Each metric's mean and 95% interval over the per-question `predictions` (CoDA also: planner tasks)."""
    from agents.evaluation import METRICS, metric_intervals

    names = [*METRICS, "num_tasks"] if agent == "coda" else list(METRICS)
    return {name: interval.as_dict() for name, interval in metric_intervals(predictions, names).items()}


def run_provenance(config: Any, model: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The run's provenance (`envs.provenance`): its command, code, packages, machine, seed, the hashes of its
    training and held-out questions, corpus and index settings, and of `model` (final/ once written)."""
    from envs.provenance import provenance

    held_out = held_out_settings(config)["env_kwargs"]
    return provenance(seed=config.run.seed, env_kwargs=config.env_kwargs, model=model, held_out_kwargs=held_out)


def _starting_model_cache(config: Any) -> Path:
    from retrievers.corpus import cache_root

    # greedy scores of fixed weights: the training seed matters only where it makes the weights (the tiny model)
    key = {"model": config.model.model or "smollm2-135m", **held_out_settings(config)}
    if config.model.model == "tiny":
        key.update(
            seed=config.run.seed, max_context=config.model.max_context_tokens
        )  # the tiny model's weights depend on both
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "eval" / f"start-{digest}.json"


def _write_json(path: Path, value: Any) -> None:
    from algos.checkpoints.atomic import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(value, ensure_ascii=False))


def before_after(run: _Run) -> dict[str, Any]:
    """Score the run's current model and the model it started from on the held-out questions.

    Writes ``eval.json`` (both results with per-question predictions) and ``eval.md`` (the before/after table,
    then the trained model's first-search split, `envs.first_search`) into the run directory. Under data
    parallelism every rank scores its share of the questions and rank 0 alone writes (the other ranks return an
    empty dict).

    Returns:
        ``{"before", "after", "table", "settings", "first_search"}``; before and after are
        `agents.evaluation.evaluate` results (``metrics[name]`` is ``{"mean", "low", "high", "n"}``).
    """
    from algos import distributed

    config = run.config
    main = run.world.is_main
    cache = _starting_model_cache(config)
    if distributed.broadcast_object(cache.is_file()):  # rank 0 decides: every rank takes the same branch
        before = json.loads(cache.read_text()) if main else {}
        if main:  # intervals from the cached predictions by today's rules (a cache may predate them)
            before["metrics"] = _metrics(before["predictions"], held_out_settings(config)["agent"])
        logger.info("starting model's held-out scores from %s", cache)
    else:
        start_model, tokenizer = run.build_model()
        before = score_held_out((start_model, tokenizer), config, label="start")
        del start_model
        if main:
            _write_json(cache, before)
    with run.full_weights():  # --fsdp: every rank samples its share with the whole weights
        after = score_held_out((run.policy, run.tokenizer), config, label="trained")
    if not main:  # data-parallel ranks besides 0 scored their share and write nothing
        return {}
    from envs.first_search import split_tables

    reading, numbers = split_tables({"after (trained)": after})  # retrieval only: the first queries replayed
    table = (
        f"{format_before_after(before, after, config)}\n\nReading or searching (`envs.first_search`): does the "
        f"question itself, as the first query, show a gold answer?\n\n{reading}"
    )
    result = {"settings": held_out_settings(config), "before": before, "after": after, "table": table}
    result["first_search"] = numbers["after (trained)"]
    result["provenance"] = run_provenance(config, run.run_dir / "final")  # the weights scored, once written
    _write_json(run.run_dir / "eval.json", result)
    (run.run_dir / "eval.md").write_text(table + "\n", encoding="utf-8")
    return result


def format_before_after(before: dict[str, Any], after: dict[str, Any], config: Any) -> str:
    """The before/after table in Markdown: one row per model, mean [95% CI] per metric; under it, which interval
    each column has and how many episodes met sampler or retriever errors."""
    from agents.evaluation import errors_line, interval_caption
    from envs.stats import Interval

    names = [m for m in TABLE_METRICS if m in after["metrics"] and m in before["metrics"]]
    lines = [
        f"Held-out: {after['n']} {config.run.eval_split} questions, greedy, "
        f"{held_out_settings(config)['agent']} agent, training env settings.",
        "",
        "| model | " + " | ".join(_LABELS[m] for m in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, result in (("before (start)", before), ("after (trained)", after)):
        cells = [Interval(**result["metrics"][m]).format(2 if m.startswith("num_") else 3) for m in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", interval_caption(), errors_line([before, after], ["before", "after"])])


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of each value and the ``window - 1`` before it (fewer at the start); values that are not
    finite (a step that logged none) are skipped, and a window with none left is NaN."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(seen) / len(seen) if seen else math.nan)
    return out


def plot_curves(
    metrics_path: Path,
    out: Path,
    *,
    evaluation: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
) -> Path | None:
    """curves.png: reward, answer F1, valid-answer rate and SFT weight per step (None when nothing to plot).
    A RED run adds its factors and entropies (`_red_panels`).

    Each step's value is a dot and a line of their trailing 10-step mean (a step's rollouts are a handful of
    episodes, so one step says little). The F1 and valid-answer panels also show what was measured on questions
    the run never trained on: the held-out evaluation's starting model at step 0 and trained model at its step
    (the validation's choice, else the last step; with their 95% intervals), and each kept checkpoint's score on
    the validation questions.

    Args:
        metrics_path: The run's ``metrics.jsonl``.
        out: Where to write the PNG.
        evaluation: `before_after`'s result, or None.
        validation: `select_checkpoint`'s result, or None.
    """
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("critic/rewards/mean", "reward", None),
        ("answer_f1/mean", "answer F1", "f1"),
        ("env/answered", "valid answers", "answered"),
        ("sft/weight", "SFT weight (RED w)", None),
    ]
    steps = [r["step"] for r in rows]
    final_step = validation["selected_step"] if validation else steps[-1]
    red = any("red/entropy_weight" in r for r in rows)
    rows_of_panels, columns = (2, 3) if red else (1, len(panels))  # a RED run's six panels in two rows
    fig, grid = plt.subplots(rows_of_panels, columns, figsize=(4 * columns, 3.4 * rows_of_panels))
    axes = list(grid.flat)
    if red:
        _red_panels(axes[len(panels) :], rows, steps)
    for ax, (key, title, held_out) in zip(axes, panels, strict=False):
        values = [float(r.get(key, math.nan)) for r in rows]
        ax.plot(steps, values, ".", color="0.65", markersize=4, label="rollouts, each step")
        ax.plot(steps, moving_average(values, 10), color="C0", linewidth=2, label="rollouts, 10-step mean")
        if held_out and validation:
            points = sorted((c["step"], c["metrics"][held_out]["mean"]) for c in validation["candidates"])
            ax.plot(*zip(*points, strict=True), "s", color="C2", label=f"validation ({validation['questions']} q)")
        if held_out and evaluation:
            n = evaluation["after"]["n"]
            for model, label, step, color in (("before", "start", 0, "C3"), ("after", "final", final_step, "C1")):
                interval = evaluation[model]["metrics"][held_out]
                # clamped at 0: a mean on an interval's end can differ from it in the last bit, and matplotlib
                # refuses an error bar of -3e-17
                error = [
                    [max(0.0, interval["mean"] - interval["low"])],
                    [max(0.0, interval["high"] - interval["mean"])],
                ]
                ax.errorbar(
                    [step],
                    [interval["mean"]],
                    yerr=error,
                    fmt="*",
                    markersize=11,
                    color=color,
                    capsize=3,
                    label=f"{label}, held-out ({n} q)",
                )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if held_out:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _red_panels(axes: Sequence[Any], rows: Sequence[dict[str, Any]], steps: Sequence[int]) -> None:
    """RED's two factors (entropy weight, accuracy factor) beside its final weight; the entropies it tracks, each
    step's value (dots) beside RED's average of it (line: ``red/h_rl`` against ``train/rl_entropy``, ``red/h_sft``
    against ``sft/entropy``), so a reader sees whether the averages follow the run."""

    def series(key: str) -> list[float]:
        return [float(r.get(key, math.nan)) for r in rows]

    factors, entropies = axes
    factors.plot(steps, series("red/final_weight"), color="0.3", linewidth=2, label="final weight w")
    factors.plot(steps, series("red/entropy_weight"), ".-", color="C0", markersize=4, label="entropy weight")
    factors.plot(steps, series("red/accuracy_factor"), ".-", color="C1", markersize=4, label="accuracy factor")
    factors.set_yscale("log")
    factors.set_title("RED's factors")
    for key, average, color, label in (
        ("train/rl_entropy", "red/h_rl", "C0", "RL"),
        ("sft/entropy", "red/h_sft", "C2", "SFT"),
    ):
        entropies.plot(steps, series(key), ".", color=color, markersize=4, alpha=0.6, label=f"{label}, each step")
        entropies.plot(steps, series(average), color=color, linewidth=2, label=f"{label}, RED's average")
    entropies.set_title("entropy (nats)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def select_checkpoint(run: _Run) -> dict[str, Any]:
    """Score every kept checkpoint on the validation questions; leave the best one's weights in the policy.

    The questions are the training split's last ``config.run.validation_questions`` (`TrainingRun.validation_indices`),
    which no rollout or demonstration of the run used. The policy holds the last step's weights on entry (the newest
    checkpoint's), so that one is scored first and reloaded only if another wins; the best by answer F1 wins, the
    later on a tie. Writes ``validation.json`` (each candidate's metrics and predictions) into the run directory.

    Returns:
        ``{"questions", "selected_step", "last_step", "candidates": [{"step", "path", "metrics"}], "wall_s"}``,
        the candidates newest first (the same on every data-parallel rank; rank 0 alone writes the file).
    """
    import time

    from algos import distributed
    from algos.checkpoints.store import complete_checkpoints

    start = time.perf_counter()
    config = run.config
    questions = list(run.validation_indices)
    # newest first: the policy's weights now; verified by rank 0 alone (every file hashed once), the same list on all
    paths = distributed.broadcast_object(complete_checkpoints(run.checkpoint_dir)[::-1] if run.world.is_main else None)
    candidates = []
    for i, (step, path) in enumerate(paths):
        if i > 0:
            run.load_weights(path)
        with run.full_weights():
            result = score_held_out((run.policy, run.tokenizer), config, label=path.name, validation=questions)
        candidates.append({"step": step, "path": str(path), "metrics": result["metrics"], "result": result})
        logger.info(
            "validation: %s F1 %.3f, valid answers %.2f (%d questions)",
            path.name,
            result["metrics"]["f1"]["mean"],
            result["metrics"]["answered"]["mean"],
            len(questions),
        )
    best = max(range(len(candidates)), key=lambda i: (candidates[i]["metrics"]["f1"]["mean"], -i))
    if best != len(candidates) - 1:  # the last candidate scored is what the policy holds now
        run.load_weights(Path(candidates[best]["path"]))
    summary = {
        "questions": len(questions),
        "selected_step": candidates[best]["step"],
        "last_step": candidates[0]["step"],
        "candidates": [{k: v for k, v in c.items() if k != "result"} for c in candidates],
        "wall_s": time.perf_counter() - start,
    }
    if run.world.is_main:
        full = {
            **summary,
            "settings": validation_settings(config, questions),
            "results": [c["result"] for c in candidates],
        }
        _write_json(run.run_dir / "validation.json", full)
    return summary
