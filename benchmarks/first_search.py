"""Reading or searching? Split evaluations by whether the question-as-query search already shows the answer.

    python -m benchmarks.first_search runs/red/eval.json [runs/compare/evals/*.json ...]

The command line of `algos.first_search`, which has what the split means and how it is computed.
"""

from __future__ import annotations

from algos.first_search import main

if __name__ == "__main__":
    main()
