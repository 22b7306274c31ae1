"""Every table and figure in README.md and docs/results/*.md that the results store can rebuild, rebuilt from it.

    python -m benchmarks.report                        # rewrite every block in the pages from the store
    python -m benchmarks.report --check                # exit 1 naming each block that differs (CI runs this)
    python -m benchmarks.report --redraw               # ... and draw every figure again, not only stale ones
    python -m benchmarks.report ingest RUN [--name N]  # a run directory, comparison or result file into the store
    python -m benchmarks.report ingest FOLDER --command CMD  # a run older than the store, with its command
    python -m benchmarks.report stats A B [--metric f1] [--without-yes-no]   # paired by question: A - B, and p

A page holds a block between ``<!-- report:NAME ARG -->`` and ``<!-- /report -->`` (`benchmarks.report_blocks`
names them; ``figure`` blocks, `benchmarks.report_figures`, also draw their PNG); what is between is the block's output,
and nothing else is touched. ``stats`` takes stored runs
(``NAME`` or ``NAME:PART``: a trainer run's parts are ``after``, the default, and ``before``, a comparison's
``<system>-seed<s>``), several joined by commas to mean each
question's score over them (seeds); the difference is `envs.stats.paired_difference` (seeded BCa bootstrap) and p
`envs.stats.paired_permutation_p`, over the questions both sides scored. A run whose per-question results were
never kept cannot be paired, and ``stats`` says so. The store itself: `benchmarks.results_store`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.report_blocks import BLOCKS
from benchmarks.report_figures import figure
from benchmarks.results_store import ROOT, STORE, paired_stats

PAGES = ("README.md", "docs/results/*.md")
"""The pages that hold blocks."""
_BLOCK = re.compile(r"(<!-- report:([\w-]+)(?: ([\w.:, -]+?))? -->\n)(.*?)(<!-- /report -->)", re.DOTALL)


def pages(root: Path = ROOT) -> list[Path]:
    """Every page that may hold blocks."""
    return sorted(p for pattern in PAGES for p in root.glob(pattern))


def rebuilt(
    text: str, where: str, root: Path = ROOT, draw: bool = False, redraw: bool = False
) -> tuple[str, list[str]]:
    """`text` with every block rebuilt from the store, and the blocks (``page: name arg``) whose text changed.

    A ``figure`` block's PNG that is missing or drawn from other data than the store's is drawn with `draw` (every
    one with `redraw`) and named either way, with why.
    """
    changed: list[str] = []
    page_dir = (root / where).parent

    def fill(found: re.Match[str]) -> str:
        name, argument = found[2], found[3] or ""
        block = f"{where}: {name} {argument}".rstrip()
        if name == "figure":
            drawn = figure(argument, root)
            body = drawn.block(page_dir) + "\n"
            problems = drawn.problems(root)
            if draw and (problems or redraw):
                drawn.draw()
                problems = [f"drawn: {problem}" for problem in problems] or ["drawn again"]
            changed.extend(f"{block} ({problem})" for problem in problems)
        elif name not in BLOCKS:
            raise SystemExit(f"{where}: unknown block {name!r}; blocks: figure, {', '.join(BLOCKS)}")
        else:
            body = BLOCKS[name](argument).rstrip("\n") + "\n"
        if body != found[4]:
            changed.append(block)
        return found[1] + body + found[5]

    return _BLOCK.sub(fill, text), changed


def build(check: bool, root: Path = ROOT, redraw: bool = False) -> list[str]:
    """Rebuild (or, with `check`, only compare) every page's blocks and figures; returns the blocks that differed."""
    differing = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new, changed = rebuilt(text, page.relative_to(root).as_posix(), root, draw=not check, redraw=redraw)
        differing += changed
        if new != text and not check:
            page.write_text(new, encoding="utf-8")
    return differing


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 naming each block that differs")
    parser.add_argument("--redraw", action="store_true", help="draw every figure again, not only missing or stale ones")
    commands = parser.add_subparsers(dest="command")
    ingest = commands.add_parser("ingest", help="a run directory, comparison --out or result file into the store")
    ingest.add_argument("source", type=Path)
    ingest.add_argument("--name", default=None, help="its name in the store (default: the folder's or file's)")
    ingest.add_argument("--no-first-search", action="store_true", help="skip replaying first searches")
    ingest.add_argument(
        "--command",
        dest="run_command",
        default=None,
        help="the command of a run that predates the store (compare-*, main-job-*), whose files do not name it",
    )
    stats = commands.add_parser("stats", help="paired by question between two stored runs or sets of seeds")
    stats.add_argument("a", help="NAME[:PART][,NAME[:PART]...]")
    stats.add_argument("b", help="NAME[:PART][,NAME[:PART]...]")
    stats.add_argument("--metric", default="f1", help="a per-question field: f1, em, answered, searches, ...")
    stats.add_argument("--without-yes-no", action="store_true", help="leave out questions answered yes or no")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ingest":
        from benchmarks.results_store import ingest

        name = args.name or args.source.resolve().name.removesuffix(".json")
        first_search = not args.no_first_search
        path = ingest(args.source.resolve(), name, first_search=first_search, store=STORE, command=args.run_command)
        print(f"stored {name}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return 0
    if args.command == "stats":
        got = paired_stats(args.a, args.b, args.metric, without_yes_no=args.without_yes_no)
        metric = args.metric + (" without yes/no" if args.without_yes_no else "")
        print(
            f"{args.a} - {args.b}: {metric} {got['difference']:+.3f} [{got['low']:+.3f}, {got['high']:+.3f}] "
            f"(95% BCa bootstrap), p {got['p']:.2g} (paired permutation), {got['n']} questions"
        )
        return 0
    differing = build(check=args.check, redraw=args.redraw)
    for block in differing:
        print(f"{'differs' if args.check else 'rebuilt'}: {block}")
    if args.check and differing:
        print("run `python -m benchmarks.report` and commit the pages with the store", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
