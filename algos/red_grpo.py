"""GRPO + RED: the SFT term's weight follows the model's entropy dynamics and the batch accuracy.

    loss = loss_pg [+ loss_kl] + w * sft_coef * loss_sft      (rule: algos.objectives.weighting.RED)
    w = clip(entropy weight * accuracy factor, 1, G^2), G = 5, entropies tracked as EMAs (decay 0.99)

RED-inspired: Recall-Extend Dynamics (arXiv 2508.16677) was proposed for math reasoning; here it weighs
SFT on oracle search demonstrations (see `algos.objectives.weighting.RED` for the exact rule). Logged as
red/entropy_weight, red/accuracy_factor, red/final_weight, red/batch_accuracy. Run (presets: gpu, the
seed's defaults, picked when CUDA is available; cpu; tiny):

    python -m algos.red_grpo
    python -m algos.red_grpo --preset cpu --red-max-factor 3
    python -m algos.red_grpo --preset tiny --run-dir /tmp/red-tiny
    python -m algos.red_grpo --run-dir runs/red --resume     # continue an interrupted run
    python -m algos.red_grpo --help
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with GRPO + RED; returns the run summary."""
    return train(argv, algo="red_grpo", description=__doc__)


if __name__ == "__main__":
    main()
