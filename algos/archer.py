"""ArCHer-style hierarchical RL: an off-policy utterance-level critic guides a token-level policy update.

After ArCHer (Zhou, Zanette, Pan, Levine, Kumar 2024, "ArCHer: Training Language Model Agents via
Hierarchical Multi-Turn RL"). The high level is the turn: one turn (one utterance the model samples, up to
its tool call) is one action; the state is the context before it. The low level is the token.

`ArCHerTrainer` says one step on the shared loop of `algos.learners.trainer.Trainer` (this file changes only the
advantages) and how it differs from the paper.

Run (default env RedCoda-HotpotQA-v0, the flat protocol; ``--protocol coda`` for the hierarchical agent):

    python -m algos.archer --preset tiny --run-dir /tmp/archer-tiny
    python -m algos.archer --preset cpu --torch-threads 1
    python -m algos.archer --help
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with ArCHer; returns the run summary."""
    return train(argv, algo="archer", description=__doc__)


if __name__ == "__main__":
    main()
