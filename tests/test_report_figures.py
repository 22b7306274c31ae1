"""`benchmarks.report`'s figure blocks: drawn from a small store into a page, and checked by the hash of the data
they were drawn from (never by pixels): a stale figure and a missing one are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import report, report_figures, results_store
from benchmarks.results_store import write_records

PAGE = """# Results

<!-- report:figure tiny-run curves.png -->
<!-- /report -->

Text between is kept.

<!-- report:figure tiny-comparison f1.png -->
<!-- /report -->
"""


def _metrics(steps: int, f1: float, **extra: str) -> list[dict]:
    return [
        {"record": "metrics", "step": s, "critic/rewards/mean": -3 + s * f1, "answer_f1/mean": f1 * s / steps,
         "env/answered": 1.0, "sft/weight": 5.0, **extra}
        for s in range(1, steps + 1)
    ]  # fmt: skip


def _store(root: Path, f1: float = 0.5) -> Path:
    store = root / "benchmarks" / "results" / "store"
    questions = [
        {"record": "question", "part": part, "id": f"q{i}", "f1": score * (part == "after"), "answered": 1.0}
        for part in ("before", "after")
        for i, score in enumerate([1.0, 0.0, 0.5, 1.0])
    ]
    header = {"record": "run", "kind": "training", "name": "tiny-run", "source": "runs/tiny", "summary": {}}
    write_records(store / "tiny-run.jsonl.gz", [{**header, "provenance": {"seed": 1}}, *questions, *_metrics(6, f1)])
    systems = [
        {"record": "row", "table": "systems", "algorithm": name}
        for name in ("red_grpo", "grpo_sft:sft_coef=0.4", "the start model, no RL")
    ]
    runs = [
        row
        for run in ("red_grpo-seed0", "red_grpo-seed1", "grpo_sft-sft_coef0.4-seed0", "grpo_sft-sft_coef0.4-seed1")
        for row in _metrics(5, f1, run=run)
    ]
    header = {"record": "run", "kind": "comparison", "name": "tiny-comparison", "source": "benchmarks/results/cmp"}
    write_records(store / "tiny-comparison.jsonl.gz", [header, *systems, *runs])
    return store


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "page.md").write_text(PAGE)
    monkeypatch.setattr(results_store, "STORE", _store(tmp_path))
    return tmp_path


def test_rebuilding_draws_each_figure_and_writes_its_block(root):
    drawn = report.build(check=False, root=root)
    assert (
        drawn[0]
        == "docs/results/page.md: figure tiny-run curves.png (drawn: benchmarks/results/tiny-run/curves.png is missing)"
    )
    curves, f1 = root / "benchmarks/results/tiny-run/curves.png", root / "benchmarks/results/cmp/f1.png"
    assert curves.read_bytes()[:8] == f1.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (root / "docs/results/page.md").read_text()
    assert "](../../benchmarks/results/tiny-run/curves.png)" in page
    assert "](../../benchmarks/results/cmp/f1.png)" in page
    assert "`tiny-run` in the results store, seed 1, 6 steps" in page
    assert "`tiny-comparison` in the results store, 5 steps, 2 seeds a system" in page
    assert "Text between is kept." in page
    for argument, path in (("tiny-run curves.png", curves), ("tiny-comparison f1.png", f1)):
        digest = report_figures.figure(argument, root).digest
        assert report_figures.recorded_hash(path) == digest
        assert f"Data sha256 `{digest}`" in page
    assert report.build(check=True, root=root) == []
    before = curves.read_bytes()
    assert report.build(check=False, root=root) == []  # nothing stale: nothing drawn again
    assert curves.read_bytes() == before


def test_check_names_a_block_whose_figure_was_drawn_from_other_data(root):
    report.build(check=False, root=root)
    page = (root / "docs/results/page.md").read_text()
    _store(root, f1=0.25)  # the store changes; the page and its figures do not
    differing = report.build(check=True, root=root)
    assert "docs/results/page.md: figure tiny-run curves.png" in differing  # its caption's hash
    stale = [d for d in differing if "tiny-run curves.png (" in d]
    assert len(stale) == 1 and "curves.png was drawn from data sha256 " in stale[0]
    assert (root / "docs/results/page.md").read_text() == page
    # the page's text brought up to date by hand, the PNG not: the hash still names it
    (root / "docs/results/page.md").write_text(report.rebuilt(page, "docs/results/page.md", root)[0])
    assert [d.split(" (")[0] for d in report.build(check=True, root=root)] == [
        "docs/results/page.md: figure tiny-run curves.png",
        "docs/results/page.md: figure tiny-comparison f1.png",
    ]
    report.build(check=False, root=root)
    assert report.build(check=True, root=root) == []


def test_check_names_a_missing_figure(root):
    report.build(check=False, root=root)
    (root / "benchmarks/results/cmp/f1.png").unlink()
    assert report.build(check=True, root=root) == [
        "docs/results/page.md: figure tiny-comparison f1.png (benchmarks/results/cmp/f1.png is missing)"
    ]


def test_a_figure_without_stored_metrics_or_of_the_wrong_kind_is_refused(root):
    write_records(results_store.STORE / "tables-only.jsonl.gz", [{"record": "run", "kind": "comparison"}])
    with pytest.raises(SystemExit, match="Not rebuildable from the repository"):
        report_figures.figure("tables-only f1.png", root)
    with pytest.raises(SystemExit, match="its figures: curves.png"):
        report_figures.figure("tiny-run f1.png", root)
    with pytest.raises(SystemExit, match="its figures: reward.png, f1.png"):
        report_figures.figure("tiny-comparison curves.png", root)
