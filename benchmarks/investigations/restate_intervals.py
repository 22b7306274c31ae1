"""Restate a recorded comparison table's across-seed intervals by today's rules, from the table's own numbers.

    python -m benchmarks.investigations.restate_intervals benchmarks/results/compare-*/table.md

The tables under benchmarks/results/ were written when an interval across seeds was Student's t, unclipped, and a
metric equal in every seed was printed [x, x]. Today's rule (`benchmarks.compare_report.summary_row` through
`envs.stats.t_interval`) is the same t interval clipped to the metric's range ([0, 1] for rates and scores, a count
at 0), and for a constant metric the rule-of-three bound (`envs.stats.constant_interval`). Both follow from what a
table holds (each mean, its old interval, the number of seeds), so this rewrites every across-seed cell of table.md,
and the same columns of table.csv at full precision where it exists. The paired rows by question need the
per-question results, which are not kept in git: they stay as computed, and the table says by which method.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path

from envs.stats import Interval, _clipped, constant_interval

UNIT, COUNT = (0.0, 1.0), (0.0, math.inf)
BOUNDS = {
    "EM": UNIT,
    "F1": UNIT,
    "valid answers": UNIT,
    "format": UNIT,
    "searches/q": COUNT,
    "invalid actions/q": COUNT,
}
"""Each across-seed column of a table.md and the range of its metric."""
CSV_BOUNDS = {"em": UNIT, "f1": UNIT, "answered": UNIT, "format": UNIT, "num_searches": COUNT, "invalid_actions": COUNT}
"""The same, by table.csv's column names."""
ACROSS_SEEDS = (
    "Mean over seeds [95% interval across seeds: Student's t clipped to the metric's range, the rule-of-three bound "
    "for a metric equal in every seed; restated from this table's own numbers by "
    "`python -m benchmarks.investigations.restate_intervals`]."
)
PAIRED = (
    "difference, its 95% Student's t interval over questions and the two-sided sign-flip permutation p-value (the "
    "method of the time, kept as computed: today's seeded BCa bootstrap and scipy's permutation test need the "
    "per-question results, which are not kept in git)."
)
_CELL = re.compile(r"^(-?\d+\.\d+) \[(-?\d+\.\d+), (-?\d+\.\d+)\]$")


def restated(mean: float, low: float, high: float, seeds: int, bounds: tuple[float, float]) -> Interval:
    """Today's interval of a metric whose old (unclipped t) interval across `seeds` seeds was [low, high]."""
    if low == high == mean:  # every seed scored the same: the old t interval had no width
        return constant_interval([mean] * seeds, bounds=bounds)
    return _clipped(mean, low, high, seeds, 0.95, "t", bounds)


def restate_csv(path: Path) -> dict[str, dict[str, Interval]]:
    """Rewrite table.csv's low and high columns; return each algorithm's intervals by table.csv metric."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, dict[str, Interval]] = {}
    for row in rows:
        seeds = int(row["seeds"])
        for metric, bounds in CSV_BOUNDS.items():
            if metric not in row or seeds < 2:
                continue
            interval = restated(
                float(row[metric]), float(row[f"{metric}_low"]), float(row[f"{metric}_high"]), seeds, bounds
            )
            row[f"{metric}_low"], row[f"{metric}_high"] = repr(interval.low), repr(interval.high)
            out.setdefault(row["algorithm"], {})[metric] = interval
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out


def restate_table(path: Path) -> int:
    """Rewrite table.md (and table.csv beside it); returns the number of cells whose interval changed."""
    from_csv = restate_csv(path.with_suffix(".csv")) if path.with_suffix(".csv").exists() else {}
    by_name = dict(zip(BOUNDS, CSV_BOUNDS, strict=True))
    lines = path.read_text(encoding="utf-8").splitlines()
    header: list[str] | None = None
    changed = 0
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["algorithm", "seeds"]:
            header = cells
            continue
        if header is None or not line.startswith("| ") or line.startswith("|---"):
            if header is not None and not line.startswith("|"):
                header = None  # the summary table ended
            continue
        seeds = int(cells[1])
        for j, column in enumerate(header):
            found = _CELL.match(cells[j]) if column in BOUNDS else None
            if found is None or seeds < 2:
                continue
            mean, low, high = (float(v) for v in found.groups())
            interval = from_csv.get(cells[0], {}).get(by_name[column]) or restated(
                mean, low, high, seeds, BOUNDS[column]
            )
            text = f"{mean:.3f} [{interval.low:.3f}, {interval.high:.3f}]"
            changed += text != cells[j]
            cells[j] = text
        lines[i] = "| " + " | ".join(cells) + " |"
    text = "\n".join(lines) + "\n"
    text = text.replace("Mean over seeds [95% t-interval across seeds].", ACROSS_SEEDS)
    text = text.replace("difference, its 95% t-interval, and the two-sided sign-flip permutation p-value.", PAIRED)
    path.write_text(text, encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", type=Path, help="a comparison's table.md (its table.csv beside it)")
    args = parser.parse_args(argv)
    changed = {str(path): restate_table(path) for path in args.tables}
    for path, count in changed.items():
        print(f"{path}: {count} intervals restated")
    return changed


if __name__ == "__main__":
    main()
