"""Write questions in Search-R1's or FlashRAG's format, so their trainers and pipelines can use our data.

    python -m envs.export --split train --format search-r1 --out hotpotqa_train.parquet
    python -m envs.export --dataset bamboogle --split test --format flashrag --out bamboogle_test.jsonl

The output reads back with `gym.make("RedCoda-HotpotQA-v0", data_path=FILE)` (same questions and answers, in the
same order). Search-R1 rows are what its trainer expects: `data_source` in its reward dispatcher's spelling
(2wiki is 2wikimultihopqa) and each question ending with "?", as its nq_search.py writes them. A `.parquet` path
needs pyarrow; any other path is JSON lines (gzip for `.gz`). Row layouts: docs/data.md.

Bad input (an unknown split, a missing or malformed data file, an output path that cannot be written) ends the
command with one line, ``error: ...``, and exit status 2, before anything is written; a write that fails (a full
disk) ends it with one line and exit status 1, leaving no partial file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from envs.data import (
    BUNDLED_SPLITS,
    DATASETS,
    EXPORT_FORMATS,
    DataError,
    flashrag_rows,
    load_examples,
    search_r1_rows,
    write_rows,
)
from retrievers.files import OneLineParser, atomic_file, output_problem


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the command line unusable, checked before any question is read (None when nothing does)."""
    if args.data_path is None and args.split not in BUNDLED_SPLITS[args.dataset]:
        bundled = ", ".join(BUNDLED_SPLITS[args.dataset])
        return f"--split {args.split!r}: {args.dataset} has no bundled split of that name; bundled: {bundled}"
    if args.data_path is not None and not Path(args.data_path).is_file():
        return f"--data-path {args.data_path!r}: no such file"
    if args.out.endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
        return f"--out {args.out}: writing parquet needs pyarrow (pip install pyarrow), or write .jsonl"
    return output_problem("--out", args.out)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and write the file."""
    parser = OneLineParser(prog="python -m envs.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="hotpotqa", choices=DATASETS, help="which dataset (default hotpotqa)")
    parser.add_argument("--split", default="train", help="bundled split (hotpotqa: train, dev)")
    parser.add_argument("--data-path", default=None, help="read the questions from this file instead")
    parser.add_argument("--format", default="search-r1", choices=EXPORT_FORMATS, help="output row layout")
    parser.add_argument("--out", required=True, help="output file: .parquet, .jsonl or .jsonl.gz")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem is not None:
        parser.error(problem)
    try:
        examples = load_examples(args.dataset, args.split, args.data_path)
    except DataError as err:  # names the file and the line
        parser.error(str(err))
    rows = search_r1_rows(examples, args.split) if args.format == "search-r1" else flashrag_rows(examples)
    try:
        with atomic_file(args.out) as partial:
            write_rows(rows, partial)
    except OSError as err:  # the disk filled or went read-only while writing: no partial file is left
        print(f"error: writing {args.out} failed ({err})", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {len(rows)} {args.format} rows to {args.out}")


if __name__ == "__main__":
    main()
