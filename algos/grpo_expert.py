"""GRPO with expert trajectories inside the groups: oracle episodes join their questions' groups off-policy.

    adv = group_advantages(rewards of the G sampled episodes and the oracle's, group_id)
    loss = loss_pg (sampled tokens, clipped) + loss_expert (oracle tokens: -adv * pi / (pi + gamma), unclipped)
           [+ loss_kl]                                          (rule: algos.objectives.weighting.NoSFT, no SFT term)

After LUFFY (arXiv 2504.14945) and David-GRPO (arXiv 2601.21699); `algos.learners.expert.ExpertTrainer` states the
step and its decisions, `algos.learners.off_policy` the expert tokens' importance weight. Run (presets: gpu, the seed's
defaults, picked when CUDA is available; cpu; tiny):

    python -m algos.grpo_expert
    python -m algos.grpo_expert --preset tiny --run-dir /tmp/expert-tiny
    python -m algos.grpo_expert --expert-members 1 --expert-shaping 0.1
    python -m algos.grpo_expert --help
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train GRPO with expert members in its groups; returns the run summary."""
    return train(argv, algo="grpo_expert", description=__doc__)


if __name__ == "__main__":
    main()
