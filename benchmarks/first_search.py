"""Reading or searching? Split evaluations by whether the question-as-query search already shows the answer.

    python -m benchmarks.first_search runs/red/eval.json [runs/compare/evals/*.json ...]
    redcoda-first-search runs/red/eval.json                        # the same, as the installed console script

The command line of `envs.first_search`, which has what the split means and how it is computed. It needs only the
env's dependencies (no torch): the evaluation files are JSON, and the searches are replayed in the env.
"""

from __future__ import annotations

from envs.first_search import main


def cli() -> None:
    """The `redcoda-first-search` console script: `main` with the process's arguments, its split not returned (a
    console script exits with what its function returns)."""
    main()


if __name__ == "__main__":
    main()
