"""Write questions in Search-R1's or FlashRAG's format, so their trainers and pipelines can use our data.

    python -m envs.export --split train --format search-r1 --out hotpotqa_train.parquet
    python -m envs.export --dataset bamboogle --split test --format flashrag --out bamboogle_test.jsonl

The output reads back with `gym.make("RedCoda-HotpotQA-v0", data_path=FILE)` (same questions and answers, in the
same order). Search-R1 rows are what its trainer expects: `data_source` in its reward dispatcher's spelling
(2wiki is 2wikimultihopqa) and each question ending with "?", as its nq_search.py writes them. A `.parquet` path
needs pyarrow; any other path is JSON lines (gzip for `.gz`). Row layouts: docs/data.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from envs.data import DATASETS, EXPORT_FORMATS, flashrag_rows, load_examples, search_r1_rows, write_rows


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and write the file."""
    parser = argparse.ArgumentParser(prog="python -m envs.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="hotpotqa", choices=DATASETS, help="which dataset (default hotpotqa)")
    parser.add_argument("--split", default="train", help="bundled split (hotpotqa: train, dev)")
    parser.add_argument("--data-path", default=None, help="read the questions from this file instead")
    parser.add_argument("--format", default="search-r1", choices=EXPORT_FORMATS, help="output row layout")
    parser.add_argument("--out", required=True, help="output file: .parquet, .jsonl or .jsonl.gz")
    args = parser.parse_args(argv)
    examples = load_examples(args.dataset, args.split, args.data_path)
    rows = search_r1_rows(examples, args.split) if args.format == "search-r1" else flashrag_rows(examples)
    path = write_rows(rows, args.out)
    print(f"wrote {len(rows)} {args.format} rows to {path}")


if __name__ == "__main__":
    main()
