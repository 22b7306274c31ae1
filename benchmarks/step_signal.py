"""How much of a run's RL steps carried a gradient, what it cost, and how often RED's two factors moved.

    python -m benchmarks.step_signal runs/red_grpo-cpu-seed0/metrics.jsonl [runs/other/metrics.jsonl ...]

Reads the per-step metrics a trainer writes (one JSON object a line) and prints, per run: its RL steps and their rate
(steps a minute of step time), the share of steps on which some context carried a non-zero advantage (``rl/signal_rows``
> 0; older runs without it: some group's rewards differed), the mean share of such contexts, the episodes played a step
(dynamic sampling plays more), the mean F1 of what it sampled and the longest run of consecutive steps whose rollouts
all scored F1 0 (a trough the held-out score may not show), the mean gradient norms of the RL and SFT terms, and for
GRPO + RED how often its entropy weight and its accuracy factor left their bounds and changed from one step to the next.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["longest_zero_run", "main", "summarize"]


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from err
    return rows


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _moves(values: Sequence[float], low: float, high: float) -> tuple[float, float]:
    """The share of `values` strictly inside ``(low, high)``, and of steps whose value differs from the step before."""
    inside = sum(low + 1e-9 < v < high - 1e-9 for v in values) / len(values)
    changed = sum(abs(b - a) > 1e-9 for a, b in zip(values, values[1:], strict=False)) / max(1, len(values) - 1)
    return inside, changed


def longest_zero_run(values: Sequence[float]) -> int:
    """The most consecutive values equal to 0 (a missing value ends a run)."""
    longest = current = 0
    for value in values:
        current = current + 1 if value == 0 else 0
        longest = max(longest, current)
    return longest


def summarize(rows: Sequence[dict[str, Any]], red_max_factor: float = 5.0) -> dict[str, float]:
    """The figures of one run's metrics rows (RL steps only: rows with sampled episodes)."""
    steps = [r for r in rows if "train/episodes" in r]
    if not steps:
        raise ValueError("no RL steps in these metrics (an SFT-only run, or an empty file)")
    signal = [
        r["rl/signal_rows"] > 0 if "rl/signal_rows" in r else r.get("critic/advantages/abs_mean", 0) > 0 for r in steps
    ]
    minutes = sum(r.get("time/step", float("nan")) for r in steps) / 60
    out = {
        "steps": len(steps),
        "steps_per_minute": len(steps) / minutes if minutes > 0 else float("nan"),
        "signal_steps": sum(signal) / len(steps),
        "signal_rows": _mean([r.get("rl/signal_rows", float("nan")) for r in steps]),
        "episodes_per_step": _mean([r["train/episodes"] for r in steps]),
        "sampled_f1": _mean([r.get("answer_f1/mean", float("nan")) for r in steps]),
        "longest_f1_zero_run": longest_zero_run([r.get("answer_f1/mean", float("nan")) for r in steps]),
        "rl_grad_norm": _mean([r.get("rl/grad_norm", float("nan")) for r in steps]),
        "sft_grad_norm": _mean([r.get("sft/grad_norm", float("nan")) for r in steps]),
    }
    if all("red/entropy_weight" in r for r in steps):
        g = red_max_factor
        out["red_entropy_inside"], out["red_entropy_changed"] = _moves([r["red/entropy_weight"] for r in steps], 1, g)
        accuracy = [r["red/accuracy_factor"] for r in steps]
        out["red_accuracy_inside"], out["red_accuracy_changed"] = _moves(accuracy, 1 / g, g)
        out["red_weight_mean"] = _mean([r["red/final_weight"] for r in steps])
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files of runs")
    parser.add_argument("--red-max-factor", type=float, default=5.0, help="RED's G, the runs' --red-max-factor")
    args = parser.parse_args(argv)
    if args.red_max_factor < 1:
        parser.error("--red-max-factor must be >= 1")
    missing = [str(p) for p in args.metrics if not p.is_file()]
    if missing:
        parser.error(f"no such file: {missing[0]}")
    results = []
    for path in args.metrics:
        try:
            summary = summarize(_rows(path), args.red_max_factor)
        except ValueError as err:
            parser.error(f"{path}: {err}")
        results.append(summary)
        print(f"{path}: " + ", ".join(f"{key} {value:.3g}" for key, value in summary.items()))
    return results


if __name__ == "__main__":
    main()
