"""PPO: a token-level value head, GAE advantages and the clipped objective, on the shared training loop.

One step (the loop is the `algos.learners.trainer.Trainer` learner's; this file adds a value head to it):

    trajectories = next(iter(collector)) records                   # B episodes (questions x group_size)
    batch = collate_trajectories(trajectories)                     # (N, T) contexts, (N, T-1) token tensors
    old_values = V(states)  [ref_logp = ref(tokens)]               # (N, T-1), the step's one scoring pass
    r_t = -kl_coef * kl(old_logp, ref_logp)_t  (+ episode reward on the episode's last sampled token)
    adv, returns = GAE(r, old_values; gamma, lambda)               # --advantage gae (`algos.objectives.advantages`)
    adv = whiten(adv)                                              # over the (global) batch's sampled tokens
    for epoch in range(update_epochs):                             # the same batch, one AdamW step each
        loss = loss_pg(logp, old_logp, adv; clip 0.2) + vf_coef * loss_value(V, old_values, returns; clip)

`PPOTrainer` says the choices a reader may need (critic, values, rewards, KL, data parallel).

Run (default env RedCoda-QueryRewrite-v0; the flat QA env with ``--env-id RedCoda-HotpotQA-v0``):

    python -m algos.ppo --preset tiny --run-dir /tmp/ppo-tiny
    python -m algos.ppo --preset cpu --torch-threads 1             # SmolLM2-135M on the query-rewrite task
    python -m algos.ppo --preset tiny --env-id RedCoda-HotpotQA-v0 --run-dir /tmp/ppo-qa
    python -m algos.ppo --help
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.launch import main as train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train with PPO; returns the run summary."""
    return train(argv, algo="ppo", description=__doc__)


if __name__ == "__main__":
    main()
