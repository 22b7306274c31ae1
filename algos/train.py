"""Train any registered algorithm by name: the entry point of an algorithm without a module of its own (one that
another package registers, `algos.registry`), and of the built-in ones too.

    python -m algos.train --algo red_grpo --preset tiny --run-dir /tmp/red-tiny   # = python -m algos.red_grpo ...
    python -m algos.train --algo rloo --preset tiny                             # a registered plug-in
    python -m algos.train --list                                                # the registered names and labels
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from algos.registry import algorithm, algorithm_names
from algos.run.launch import main as train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train the algorithm ``--algo`` names with the rest of the command line; returns the run summary."""
    args = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(prog="python -m algos.train", add_help=False, allow_abbrev=False)
    pre.add_argument("--algo", default=None)
    pre.add_argument("--list", action="store_true")
    known, rest = pre.parse_known_args(args)
    if known.list:
        for name in algorithm_names():
            print(f"{name}: {algorithm(name).title}")
        return None
    if known.algo is None:
        names = ", ".join(algorithm_names())
        if {"-h", "--help"} & set(rest):
            print(f"{__doc__}\nusage: python -m algos.train --algo NAME [settings ...]   (NAME: {names})")
            return None
        print(f"error: --algo is required: one of {names} (python -m algos.train --list)", file=sys.stderr)
        raise SystemExit(2)
    return train(rest, algo=known.algo, description=__doc__)


if __name__ == "__main__":
    main()
