"""The SFT term of a learner: its minibatch of oracle demonstrations each step, the backward of its weighted
cross-entropy, and the SFT-only step of ``python -m algos.sft`` (the warm start).

The minibatch is a function of the seed and the step only (`sft_indices`), so a resumed run and every data-parallel
rank draw the same one; each rank backs its share. `_sft_backward` also measures the demonstrations' predictive
entropy, which RED's rule reads (`algos.objectives.weighting`). `algos.learners.trainer.Trainer` holds it; the names
it uses of its learner are the `algos.run.learner.Learner` seam's (``run``, ``config``) and the learner's forward
passes (``autocast``, ``_rows``, ``_logprobs``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from agents.collate import collate_sft
from algos import distributed
from algos.batch import micro_batches
from algos.objectives.losses import sft_loss
from algos.run.learner import sync
from algos.sft_data import sample_indices
from algos.step_metrics import sft_step_metrics

__all__ = ["SFTTerm"]


class SFTTerm:
    """The SFT term's minibatch, backward and step (a learner's base; see the module docstring)."""

    run: Any
    config: Any

    def sft_indices(self, step: int) -> Sequence[int]:
        """Indices into ``demos`` of the global SFT minibatch of `step` (a function of the seed and the step only)."""
        sft, seed = self.config.sft, self.config.run.seed
        roles = [d.role for d in self.run.demos] if sft.sft_planner_share is not None else None
        return sample_indices(
            len(self.run.demos), sft.sft_batch_size, seed, step, roles=roles, planner_share=sft.sft_planner_share
        )

    def sft_minibatch(self, step: int) -> TensorDict:
        """The SFT minibatch of `step` (a function of the seed and the step only)."""
        picks = distributed.shard(self.sft_indices(step), self.run.world)  # data parallel: this rank's share
        return collate_sft([self.run.demos[i] for i in picks], pad_token_id=self.run.pad_id)

    def _sft_backward(self, sft_batch: TensorDict, coef: float) -> dict[str, float]:
        """Backward of ``coef * loss_sft`` micro-batch by micro-batch; also measures the demos' predictive entropy."""
        (num_tokens,) = distributed.all_sum(float(sft_batch["loss_mask"].sum()))  # data parallel: as in _rl_backward
        lengths = sft_batch["attention_mask"].sum(-1).tolist()
        nll, entropy_sum, trained_tokens = 0.0, 0.0, 0
        parts = micro_batches(lengths, self.config.optim.micro_batch_tokens)
        with self.run.matched_passes(len(parts)):  # --fsdp: as many forward/backward passes as the busiest rank
            for rows in parts:
                part = self._rows(sft_batch, rows)
                with self.autocast():
                    logp, entropy = self._logprobs(self.run.policy, part, with_entropy=True)  # (n, L-1) each
                    part_nll = sft_loss(logp, part["loss_mask"], num_tokens=num_tokens)
                (coef * part_nll).backward()
                nll += float(part_nll.detach())
                entropy_sum += float(entropy[part["loss_mask"]].sum())
                trained_tokens += int(part["attention_mask"].sum())
        nll, entropy_sum, trained_tokens = distributed.all_sum(nll, entropy_sum, trained_tokens)  # data parallel
        return {
            "loss_sft": coef * nll,
            "sft/nll": nll,
            "sft/entropy": entropy_sum / max(num_tokens, 1.0),
            "tokens/trained_sft": int(trained_tokens),
        }

    def sft_step(self) -> dict[str, float]:
        """One supervised step on oracle demonstrations alone: the warm start of ``python -m algos.sft``.

        No rollouts: the model learns the protocol from the demonstrations (loss = loss_sft, weight 1), so
        GRPO's groups later hold valid episodes with different rewards. Reward and F1 are logged as NaN.
        """
        start = time.perf_counter()
        self.run.policy.train()
        self.run.optimizer.zero_grad(set_to_none=True)
        metrics = self._sft_backward(self.sft_minibatch(self.run.step), 1.0)
        self.run.sync_gradients()  # data parallel: sum the ranks' gradients
        sync()
        t_fwd_bwd = time.perf_counter() - start
        grad_norm = distributed.clip_grad_norm_(self.run.trainable, self.config.optim.grad_clip or math.inf)
        self.run.optimizer.step()
        self.run.optimizer.zero_grad(set_to_none=True)
        self.run.policy.eval()
        self.run.finish_update(push=False)  # step + 1; no rollouts here, so no sampler waits for the weights
        return sft_step_metrics(self.run, metrics, float(grad_norm), start, t_fwd_bwd)
