"""GRPO: group-relative policy optimisation of the search agent, no SFT term.

    loss = loss_pg [+ kl_coef * loss_kl]         (rule: algos.objectives.weighting.NoSFT, w = 0)

Run (presets: gpu, the seed's defaults, picked when CUDA is available; cpu; tiny):

    python -m algos.grpo                       # gpu or cpu preset
    python -m algos.grpo --preset tiny --run-dir /tmp/grpo-tiny
    python -m algos.grpo --help                # every setting, with the preset's values
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with GRPO; returns the run summary."""
    return train(argv, algo="grpo", description=__doc__)


if __name__ == "__main__":
    main()
