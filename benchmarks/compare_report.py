"""The comparison's report: per-system rows, paired tests by question, tables and learning curves.

`benchmarks.compare` calls these once its runs are trained and scored; they read the runs' files
(metrics.jsonl, the evaluations' JSON) and write table.md, table.csv and the plots.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.compare_runs import run_metrics
from envs.stats import mean_ci, paired_difference, paired_permutation_p

TABLE_METRICS = ("em", "f1", "answered", "num_searches", "invalid_actions", "format")


CURVES = {
    "reward.png": ("critic/rewards/mean", "episode reward"),
    "f1.png": ("answer_f1/mean", "answer F1"),
    "answered.png": ("env/answered", "valid answers"),
    "sft_weight.png": ("sft/weight", "SFT weight"),
}
"""The learning curves drawn per algorithm with a band across seeds (file: metric logged per step, title)."""
SMOOTH_STEPS = 5
"""Training-rollout metrics average a handful of episodes per step: curves show a trailing mean over this many."""


def _seed_curves(run_dirs: Sequence[Path], key: str) -> np.ndarray:
    """One row per seed: the metric at every step, NaN where unlogged (cut to the shortest run)."""
    series = [[float(r.get(key, np.nan)) for r in run_metrics(d)] for d in run_dirs]
    n = min(len(s) for s in series)
    return np.array([s[:n] for s in series], dtype=np.float64)  # (seeds, steps)


def plot(run_dirs: dict[str, list[Path]], out: Path, files: Collection[str] | None = None) -> list[str]:
    """Learning curves with seed bands (`CURVES`) and RED's weight factors (red_weights.png); `files`: only these.

    Each curve is the mean over seeds of a trailing `SMOOTH_STEPS`-step mean of the training rollouts'
    metric; the band spans the seeds' lowest to highest value at each step.
    """
    import matplotlib

    from algos.run.evaluation import moving_average

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {name: [entry] for name, entry in CURVES.items()}
    panels["red_weights.png"] = [
        ("red/entropy_weight", "entropy weight"),
        ("red/accuracy_factor", "accuracy factor"),
        ("red/final_weight", "final weight"),
    ]
    written = []
    for filename, keys in panels.items():
        if files is not None and filename not in files:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
        for ax, (key, label) in zip(axes[0], keys, strict=True):
            for algo, dirs in run_dirs.items():
                values = np.array([moving_average(seed, SMOOTH_STEPS) for seed in _seed_curves(dirs, key)])
                seen = np.isfinite(values).all(axis=0)
                if not seen.any():
                    continue
                steps = np.arange(1, values.shape[1] + 1)[seen]
                seeds = f"{len(dirs)} seed{'s' if len(dirs) > 1 else ''}"
                line = ax.plot(steps, values[:, seen].mean(axis=0), label=f"{algo} ({seeds})")[0]
                if len(dirs) > 1:
                    low, high = values[:, seen].min(axis=0), values[:, seen].max(axis=0)
                    ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_xlabel("step")
            ax.set_title(f"{label} ({SMOOTH_STEPS}-step mean, band: seeds)", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # red_weights.png of a comparison without RED has no curve
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(filename)
    return written


def summary_row(name: str, evals: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row: each metric's mean over seeds with its 95% interval across seeds, and the episodes that
    met sampler or retriever errors.

    The interval is Student's t across the seeds' means, clipped to the metric's range ([0, 1]; a count at 0): with
    a handful of seeds a bootstrap has a handful of distinct resamples and never reaches past the seeds' own spread.
    One seed has no interval (NaN).
    """
    from agents.evaluation import COUNTS, error_counts

    row: dict[str, Any] = {"algorithm": name, "seeds": len(evals)}
    for metric in TABLE_METRICS:
        per_seed = [e["metrics"][metric]["mean"] for e in evals]
        bounds = (0.0, math.inf) if metric in COUNTS else (0.0, 1.0)
        interval = mean_ci(per_seed, method="t", bounds=bounds) if len(per_seed) > 1 else None
        row[metric] = float(np.mean(per_seed))
        row[f"{metric}_low"] = interval.low if interval else float("nan")
        row[f"{metric}_high"] = interval.high if interval else float("nan")
    row["tokens_trained"] = float(np.mean([s["tokens_trained"] for s in summaries])) if summaries else 0.0
    row["train_wall_s"] = float(np.mean([s["wall_time_s"] for s in summaries])) if summaries else 0.0
    row["eval_wall_s"] = float(np.mean([e["wall_s"] for e in evals]))
    errors = [e.get("errors") or error_counts(e["predictions"]) for e in evals]
    row["errored_episodes"] = sum(c["episodes"] for c in errors)
    row["episodes"] = sum(c["n"] for c in errors)
    return row


def per_question(evals: list[dict[str, Any]], metric: str) -> dict[str, float]:
    """A system's score on each question (by id): the mean over its seeds' evaluations."""
    scores: dict[str, list[float]] = {}
    for result in evals:
        for p in result["predictions"]:
            scores.setdefault(str(p["id"]), []).append(float(p[metric]))
    return {qid: float(np.mean(values)) for qid, values in scores.items()}


F1_WITHOUT_YES_NO = "f1 without yes/no"
"""F1 over the questions whose answer is not yes or no. A small model answers every yes/no question alike (all "yes"
or all "no", whichever its last steps leaned to), so on the 24 of the 200 dev questions (15 "no") two runs of equal
skill differ by up to 0.03 F1; this row shows the difference without that lean."""


def pairing_reference(systems: Sequence[str]) -> str:
    """The system every other one is paired against: RED when it ran, else the SFT-only arm, else the first.

    With RED absent and `sft` present the rows read `sft - <system>`: a negative difference is what RL adds over
    continuing SFT for the same budget.
    """
    for name in ("red_grpo", "sft"):
        if name in systems:
            return name
    return systems[0]


def paired_tests(
    evals: dict[str, list[dict[str, Any]]],
    reference: str,
    metrics: Sequence[str] = ("f1", F1_WITHOUT_YES_NO, "em", "answered"),
) -> list[dict[str, Any]]:
    """`reference` minus every other system, paired by question, per metric: mean difference, 95% CI, p-value.

    Each system's per-question score averages its seeds, so the test asks whether the algorithm (not one
    run) does better on these questions. Raises ValueError when the systems were scored on different questions.
    """
    from envs.rewards import is_yes_no

    yes_no = {str(p["id"]) for p in evals[reference][0]["predictions"] if is_yes_no(p["gold_answers"][0])}
    rows = []
    for other, other_evals in evals.items():
        if other == reference:
            continue
        for metric in metrics:
            scored = "f1" if metric == F1_WITHOUT_YES_NO else metric
            ours, theirs = per_question(evals[reference], scored), per_question(other_evals, scored)
            if set(ours) != set(theirs):
                raise ValueError(f"{reference} and {other} were scored on different questions")
            ids = sorted(i for i in ours if metric != F1_WITHOUT_YES_NO or i not in yes_no)
            if not ids:  # only yes/no questions: nothing left to compare without them
                continue
            a, b = [ours[i] for i in ids], [theirs[i] for i in ids]
            diff = paired_difference(a, b)
            rows.append(
                {
                    "reference": reference,
                    "other": other,
                    "metric": metric,
                    "difference": diff.mean,
                    "low": diff.low,
                    "high": diff.high,
                    "p": paired_permutation_p(a, b),
                    "questions": diff.n,
                }
            )
    return rows


def write_tables(
    rows: list[dict[str, Any]],
    out: Path,
    header: str,
    paired: Sequence[dict[str, Any]] = (),
    runs: Sequence[dict[str, Any]] = (),
) -> None:
    """table.csv (every number) and table.md: mean [95% CI across seeds], the paired tests, every run."""
    with open(out / "table.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def cell(row: dict[str, Any], metric: str) -> str:
        low, high = row[f"{metric}_low"], row[f"{metric}_high"]
        ci = f" [{low:.3f}, {high:.3f}]" if np.isfinite(low) else ""
        return f"{row[metric]:.3f}{ci}"

    lines = [
        header,
        "",
        "| algorithm | seeds | EM | F1 | valid answers | searches/q | invalid actions/q | format "
        "| tokens trained | train wall min | errored episodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        errored = f"{row['errored_episodes']} of {row['episodes']}" if "episodes" in row else "-"
        lines.append(
            f"| {row['algorithm']} | {row['seeds']} | "
            + " | ".join(cell(row, m) for m in TABLE_METRICS)
            + f" | {row['tokens_trained']:.0f} | {row['train_wall_s'] / 60:.1f} | {errored} |"
        )
    lines += ["", "Errored episodes: those whose sampler or retriever failed, over every seed's evaluation."]
    if paired:
        lines += [
            "",
            f"Paired by question ({paired[0]['questions']} questions; each system's score on a question is the "
            "mean over its seeds): difference, its 95% BCa bootstrap interval over questions (seeded, inside "
            "[-1, 1]), and the two-sided paired permutation p-value (scipy.stats.permutation_test, swaps within "
            "each question's pair).",
            "",
            "| comparison | metric | difference [95% CI] | p |",
            "|---|---|---|---|",
        ]
        for t in paired:
            metric = t["metric"] + (
                f" ({t['questions']} questions)" if t["questions"] != paired[0]["questions"] else ""
            )
            lines.append(
                f"| {t['reference']} - {t['other']} | {metric} | "
                f"{t['difference']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] | {t['p']:.3g} |"
            )
    if runs:
        lines += [
            "",
            "Every run:",
            "",
            "| run | steps | tokens trained | tokens sampled | train wall min | EM | F1 | valid answers |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in runs:
            lines.append(
                f"| {r.get('system', r['algo'])}-seed{r['seed']} | {r['steps']} | {r['tokens_trained']:.0f} | "
                f"{r.get('tokens_sampled', float('nan')):.0f} | {r['wall_time_s'] / 60:.1f} | "
                f"{r['eval']['em']['mean']:.3f} | {r['eval']['f1']['mean']:.3f} | {r['eval']['answered']['mean']:.3f} |"
            )
    (out / "table.md").write_text("\n".join(lines) + "\n")
