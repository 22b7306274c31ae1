"""GRPO + fixed SFT: the GRPO loss plus a constant-weight SFT term on oracle demonstrations.

    loss = loss_pg [+ loss_kl] + sft_coef * loss_sft     (rule: FixedSFT, w = 1; sft_coef 0.1)

The demonstrations are `agents.oracle` episodes in the same env (built once and cached; see
`algos.sft_data`). Run (presets: gpu, the seed's defaults, picked when CUDA is available; cpu; tiny):

    python -m algos.grpo_sft
    python -m algos.grpo_sft --preset cpu --sft-coef 0.2
    python -m algos.grpo_sft --help
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with GRPO + fixed SFT; returns the run summary."""
    return train(argv, algo="grpo_sft", description=__doc__)


if __name__ == "__main__":
    main()
