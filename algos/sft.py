"""SFT warm start: supervised steps on oracle demonstrations only, no rollouts.

Untrained, SmolLM2-135M-Instruct rarely writes the protocol's tags, so every GRPO group scores -3 and
its advantages are all 0: policy gradient alone cannot start. A short warm start on the oracle's
demonstrations (the same data the SFT term of GRPO+SFT and RED uses, in the same token layout) teaches
the protocol; the three algorithms then start from the same warm model (`--model RUN_DIR/final`), which
is what `benchmarks.compare --warm-start-steps N` does.

    python -m algos.sft --preset cpu --steps 40              # writes runs/sft-cpu-seed0/final
    python -m algos.red_grpo --preset cpu --model runs/sft-cpu-seed0/final
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.presets import PRESETS
from algos.run.launch import main as train

__all__ = ["SFT_DEFAULTS", "SFT_PRESETS", "main"]

SFT_DEFAULTS: dict[str, object] = {"lr": 5e-5, "sft_batch_size": 4, "sft_coef": 1.0}
"""A warm start's step size and batch, larger than the seed's RL fine-tuning (lr 1e-6); a preset that sets its own
(cpu: lr 1e-4 and 8 demonstrations, what its SFT term trains with) keeps them."""

SFT_PRESETS: dict[str, dict[str, object]] = {
    preset: {key: value for key, value in SFT_DEFAULTS.items() if key not in settings}
    for preset, settings in PRESETS.items()
}
"""The SFT algorithm's defaults for each preset (`algos.registry`): `SFT_DEFAULTS` less what the preset sets itself."""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the SFT warm start; returns the run summary."""
    return train(argv, algo="sft", description=__doc__)


if __name__ == "__main__":
    main()
