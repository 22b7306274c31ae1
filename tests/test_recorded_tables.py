"""The recorded comparison tables (benchmarks/results/*/table.md) state their across-seed intervals by today's
rules: restating them again changes nothing, every interval lies in its metric's range, and each table says which
method made its paired rows."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.investigations.restate_intervals import BOUNDS, PAIRED, restate_table, restated

ROOT = Path(__file__).resolve().parents[1]
TABLES = sorted((ROOT / "benchmarks" / "results").glob("compare-*/table.md"))


def test_a_constant_metric_gets_its_rule_of_three_bound_and_a_t_interval_is_clipped():
    assert restated(0.0, 0.0, 0.0, 3, (0.0, 1.0)).high == pytest.approx(0.708, abs=5e-4)
    clipped = restated(0.993, 0.974, 1.012, 3, (0.0, 1.0))
    assert (clipped.low, clipped.high) == (0.974, 1.0)
    assert restated(0.565, -1.823, 2.953, 3, (0.0, math.inf)).low == 0.0


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.parent.name)
def test_a_recorded_table_is_already_restated(table, tmp_path):
    copy = tmp_path / "table.md"
    shutil.copy(table, copy)
    if table.with_suffix(".csv").exists():
        shutil.copy(table.with_suffix(".csv"), tmp_path / "table.csv")
    assert restate_table(copy) == 0
    assert copy.read_text() == table.read_text()


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.parent.name)
def test_every_across_seed_interval_lies_in_its_metric_s_range(table):
    text = table.read_text()
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["algorithm", "seeds"]:
            header = cells
        elif header and line.startswith("| ") and not line.startswith("|---"):
            for column, cell in zip(header, cells, strict=True):
                found = re.match(r"^(\S+) \[(\S+), (\S+)\]$", cell)
                if column in BOUNDS and found:
                    low, high = float(found[2]), float(found[3])
                    assert BOUNDS[column][0] <= low <= high <= BOUNDS[column][1], (column, cell)
        elif not line.startswith("|"):
            header = None
    if "Paired by question" in text:
        assert PAIRED in text
