"""The training step shared by GRPO, GRPO + fixed SFT and GRPO + RED.

The three differ only in the SFT weighting rule (`algos.objectives.weighting`: NoSFT, FixedSFT, RED); one step:

    trajectories = collector.collect()                          # records: G episodes for each of B questions
    batch = collate_trajectories(trajectories)                  # (N, T) contexts, (N, T-1) token tensors, once
    batch["adv"] = group_advantages(rewards, group_id)[episode] # (N,): the episode's, for each of its contexts
    w = rule.weight(rl_entropy=entropy_estimate(old_logp, mask), batch_accuracy=answer_accuracy(trajectories))
    loss = loss_pg + loss_kl + w * sft_coef * loss_sft          # token means over the RL batch and the demos
    loss.backward(); clip_grad_norm_; AdamW.step()              # backward runs micro-batch by micro-batch
    rule.observe_sft_entropy(h_sft)                             # measured in the SFT forward pass
    run.finish_update()                                         # step + 1; a sampler with its own weights gets them

`Trainer` says the details a reader may need and how other learners (PPO, ArCHer) reuse this step; the metrics row
is `algos.step_metrics`, the forward passes `algos.scoring`. Everything around the step (setup, resume, checkpoints,
metrics.jsonl, wandb, the final model, the evaluation, the command line) is `algos.run`: the run
(`algos.run.training_run.TrainingRun`) holds this learner and calls it, and the learner uses the run's parts as
``self.run.policy``, ``self.run.optimizer``, ... Under ``torchrun`` each rank runs this step on its share of the batch
(`algos.distributed`): the lines that make it one process's step say "data parallel", those for a sharded policy
"--fsdp". What of TorchRL the step uses: docs/method.md, "TorchRL".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from agents.collate import collate_trajectories
from agents.records import Trajectory
from algos import distributed, episode_checks, scoring
from algos.batch import answer_accuracy, micro_batches, trim_rows
from algos.dynamic_sampling import play, signal_rows
from algos.learners.sft_term import SFTTerm
from algos.objectives.advantages import Advantages, StepInput
from algos.objectives.credit import token_advantages
from algos.objectives.losses import entropy_estimate, kl_penalty, total_loss
from algos.objectives.policy_losses import LossScale, pg_terms
from algos.objectives.registry import aggregation, estimator, policy_loss_spec
from algos.run.learner import Learner, RunParts, sync
from algos.step_metrics import Rollouts, rewards_tied, step_metrics
from algos.term_norms import term_norms

__all__ = ["Trainer"]


class Trainer(SFTTerm, Learner):
    """The GRPO family's learner: the step below, on its run's model, sampler, collector and optimizer.

    Details a reader may need:

    - Advantages come from the registered estimator (``--advantage``, `algos.objectives`; GRPO's group-normalised
      episode rewards by default), an episode's broadcast to every generation of it (a CoDA episode's planner and
      executor contexts alike, as CoDA's PECO); ``search_credit`` adds each search turn's own credit on that turn's
      tokens (`algos.objectives.credit`), ``max_resample_batches`` replaces tied groups before the update
      (`algos.dynamic_sampling.play`); the policy loss and its aggregation are registered too (``--policy-loss``,
      ``--loss-agg``, docs/method.md).
    - loss_pg is the clipped token-level objective over every sampled token of the batch, normalized by the
      batch's total count of sampled tokens, and loss_sft likewise over the demonstrations' assistant tokens: so
      micro-batches (rows of similar length, ``micro_batch_tokens`` padded tokens at most,
      `algos.batch.micro_batches`) add up to the gradient of the one big batch. Contexts whose advantage is exactly
      0 contribute exactly 0; with ``skip_zero_advantage`` (and no KL term) they are left out of the forward pass,
      and clip_fraction and approx_kl are measured over the contexts that ran.
    - Old log-probs are the sampler's (the sampler shares the training model, so they are the current policy's up
      to numerics); ``old_logp=recompute`` (default under bf16 and with vLLM) scores them with the training model
      instead, logs how far the sampler's were (``mismatch/*``) and, with ``tis_cap``, weighs each token's
      policy-gradient term by its truncated importance weight (`algos.objectives.losses.tis_weights`).
    - The SFT minibatch (``sft_batch_size`` demonstrations, drawn by (seed, step): `sft_minibatch`) runs through
      one forward pass that gives its loss and the predictive entropy RED needs, measured on the weights before the
      update and handed to the rule after it.
    - On GPU the forward passes run under bfloat16 autocast; weights and AdamW state stay float32. The model is in
      eval mode while sampling and in train mode for the update.
    - A step in which more than ``max_retrieval_error_rate`` of the searches failed (a dead or hung retrieval
      server) raises `TrainingStopped` before the update.

    Other learners reuse this step by subclassing `Trainer` (`algos.learners.ppo.PPOTrainer`,
    `algos.learners.archer.ArCHerTrainer`,
    `algos.learners.expert.ExpertTrainer`): they extend the steps of `make_batch` (their episodes, scores and their
    estimator's inputs), ``rl_loss_terms`` returns a micro-batch's ``loss_*`` terms, ``__init__`` / ``param_groups``
    add modules (a value head, a critic) and ``state_dict`` / ``load_state_dict`` put their state into the
    checkpoints. ``update_epochs`` > 1 takes several optimizer steps on one batch (PPO epochs); the GRPO family uses 1.

    Args:
        run: The run that holds this learner (built up to its demonstrations; the optimizer comes after).
    """

    run: RunParts

    def __init__(self, run: RunParts) -> None:
        super().__init__(run)
        self.last_step_tied = False
        """Whether every group of the last step had equal rewards (the next step then collects a probe batch)."""

    def train_step(self) -> dict[str, float]:
        """Collect one batch, update the model once (``update_epochs`` times for PPO); return the step's metrics."""
        return self.update(self.collect_rollouts())

    def collect_rollouts(self) -> Rollouts:
        """The first half of `train_step`: play the step's episodes and build their RL batch, before the update."""
        cfg = self.config
        step_start = time.perf_counter()

        # rollouts: generation (sampler) vs everything else (env, retrieval, agent bookkeeping)
        self.run.policy.eval()
        self.run.sampler.reset()
        probe = cfg.rl.tie_probe_questions if self.last_step_tied else None
        if probe is not None:  # data parallel: at least one question per rank
            probe = min(max(probe, self.run.world.size), cfg.rl.questions_per_step)
        # --fsdp: the whole weights on every rank from sampling through the no-grad passes of make_batch
        with self.run.full_weights():
            trajectories, gathered, played, resampled = play(self.run.collector, cfg.rl, probe, self.autocast)
            t_rollout = time.perf_counter() - step_start
            infos = [t.info for t in played]
            # a step whose searches or generations failed past their allowed share stops the run before the update
            _, retrieval_error_rate = episode_checks.check_retrieval(infos, self.run.step + 1, cfg)
            sampler_error_rate = episode_checks.check_sampler(infos, self.run.step + 1, cfg)

            # advantages and old log-probs, before the update
            start = time.perf_counter()
            rewards = torch.tensor([t.reward for t in played], dtype=torch.float32)  # (B,): every episode played
            batch, batch_metrics = self.make_batch(trajectories)
            if cfg.rl.max_resample_batches:  # what dynamic sampling cost and kept
                kept = len({t.group_id for t in gathered})
                batch_metrics |= {"train/resample_batches": resampled, "train/groups_kept": kept}
        self.last_step_tied = rewards_tied(gathered)
        sync()
        t_old_logp = time.perf_counter() - start
        rl_entropy = float(entropy_estimate(batch["old_logp"], batch["loss_mask"]))
        # data parallel: the global batch's means, so RED's weight is the same on every rank
        rl_entropy = distributed.token_mean(rl_entropy, float(batch["loss_mask"].sum()))
        batch_metrics = distributed.mean_over_ranks(batch_metrics)
        return Rollouts(
            batch=batch,
            episodes=played,
            rewards=rewards,
            batch_metrics=batch_metrics,
            rl_entropy=rl_entropy,
            accuracy=answer_accuracy(played),
            retrieval_error_rate=retrieval_error_rate,
            sampler_error_rate=sampler_error_rate,
            started=step_start,
            t_rollout=t_rollout,
            t_old_logp=t_old_logp,
        )

    def update(self, rollouts: Rollouts) -> dict[str, float]:
        """The second half of `train_step`: weigh the SFT term, update the model on `rollouts`; return the metrics."""
        cfg = self.config
        w = self.run.weighting.weight(rl_entropy=rollouts.rl_entropy, batch_accuracy=rollouts.accuracy)
        sft_weight = w * cfg.sft.sft_coef if self.run.demos else 0.0  # the SFT term's weight this step
        sft_batch = self.sft_minibatch(self.run.step) if sft_weight > 0 else None

        # the update: loss = loss_pg + loss_kl + w * sft_coef * loss_sft; each term is a token mean over its whole
        # batch, so its gradient accumulates micro-batch by micro-batch (`_rl_backward`, `_sft_backward`)
        t_fwd_bwd, t_optimizer = 0.0, 0.0
        self.run.policy.train()
        for _ in range(cfg.optim.update_epochs):
            start = time.perf_counter()
            self.run.optimizer.zero_grad(set_to_none=True)
            metrics = self.accumulate_gradients(rollouts.batch, sft_batch, sft_weight)
            self.run.sync_gradients()  # data parallel: sum the ranks' gradients
            metrics |= self.term_grad_norms()
            sync()
            t_fwd_bwd += time.perf_counter() - start
            start = time.perf_counter()
            grad_norm = distributed.clip_grad_norm_(
                self.run.trainable, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
            )
            self.run.optimizer.step()
            self.run.optimizer.zero_grad(set_to_none=True)
            sync()
            t_optimizer += time.perf_counter() - start
        self.run.policy.eval()
        if "sft/entropy" in metrics:
            self.run.weighting.observe_sft_entropy(metrics["sft/entropy"])
        pushed = self.run.finish_update()  # step + 1; a sampler with its own copy of the weights (vLLM) gets them
        timings = {"time/forward_backward": t_fwd_bwd, "time/optimizer": t_optimizer}
        if pushed is not None:
            timings["time/weight_push"] = pushed
        return step_metrics(self.run, rollouts, metrics, float(grad_norm), timings)

    def accumulate_gradients(
        self, batch: TensorDict, sft_batch: TensorDict | None = None, sft_weight: float = 0.0
    ) -> dict[str, float]:
        """Add one update's gradients: of the RL terms on `batch`, then of ``sft_weight * loss_sft`` on `sft_batch`.

        Runs forward and backward micro-batch by micro-batch, without touching the optimizer.

        Args:
            batch: An RL batch (`make_batch`).
            sft_batch: A demonstrations minibatch (`sft_minibatch`); None: no SFT term.
            sft_weight: The SFT term's weight this step (the rule's ``w`` times the ``sft_coef`` setting).

        Returns:
            The terms' metrics: ``loss_*``, ``rl/*``, ``sft/*`` and the ``tokens/trained_*`` counts.
        """
        metrics = self._rl_backward(batch)  # loss_pg + loss_kl (+ a learner's own loss_* terms)
        self._rl_grads = None  # --term-grad-norms: the RL term's gradient, kept while the SFT term's accumulates
        if sft_batch is not None:
            if self.config.optim.term_grad_norms:
                self._rl_grads = [None if p.grad is None else p.grad.detach().clone() for p in self.run.trainable]
            metrics.update(self._sft_backward(sft_batch, sft_weight))  # + w * sft_coef * loss_sft
        return metrics

    def term_grad_norms(self) -> dict[str, float]:
        """Each term's gradient norm, every rank's, before clipping (`algos.term_norms`)."""
        if not self.config.optim.term_grad_norms:
            return {}
        kept, self._rl_grads = self._rl_grads, None
        ddp = self.run.world.enabled and not self.run.fsdp  # DDP summed the whole gradient: the kept part too
        return term_norms([p.grad for p in self.run.trainable], kept, sum_kept=ddp)

    def make_batch(self, trajectories: Sequence[Trajectory]) -> tuple[TensorDict, dict[str, float]]:
        """The RL batch of one step and metrics about it, in fixed steps every learner shares, before the update:

            episodes = self.batch_episodes(trajectories)     # those trained on (the expert learner adds its members)
            batch = self.collate(episodes)                   # once
            self.score_old(batch)                            # one no-grad pass: old log-probs, a learner's scores
            adv = estimator(StepInput(episodes, batch, inputs=self.advantage_inputs(...)))   # --advantage
            batch["adv"] = adv per token, or per episode + per-search credit on its search turns, or broadcast

        Metrics: the estimator's (of its own advantages), ``rl/signal_rows`` of the advantages set.
        """
        cfg, metrics = self.config, {}
        episodes = self.batch_episodes(trajectories, metrics)
        batch = self.collate(episodes)
        metrics |= self.score_old(batch)
        inputs = self.advantage_inputs(episodes, batch, metrics)
        all_sum = distributed.all_sum if self.run.world.enabled else None
        step = StepInput.of(episodes, batch, cfg, inputs=inputs, all_sum=all_sum)
        adv = estimator(cfg.advantage).function()(step)
        if adv.per_token:  # (N, T-1)
            batch["adv"] = adv.values
        elif cfg.rl.search_credit > 0:  # (N, T-1): each search turn's own credit on its tokens (`objectives.credit`)
            batch["adv"] = token_advantages(episodes, adv.values, batch, cfg.rl.search_credit, cfg.rl.repeat_penalty)
        else:
            batch["adv"] = adv.values[batch["episode_id"]]  # (N,): every context of an episode gets the episode's
        for key, value in adv.tensors.items():
            batch[key] = value
        self.observe_advantages(episodes, batch, adv)
        flags = signal_rows(batch)  # data parallel: the share of every rank's rows
        signal, rows = distributed.all_sum(float(flags.sum()), float(flags.numel()))
        share = float(torch.tensor(signal, dtype=torch.float32) / rows) if rows else 0.0
        return batch, metrics | adv.metrics | {"rl/signal_rows": share}

    # --- the steps of make_batch a learner extends ----------------------------------------------------------
    def batch_episodes(self, trajectories: Sequence[Trajectory], metrics: dict[str, float]) -> list[Trajectory]:
        """The episodes the batch holds (the played ones; a learner may add its own, its metrics into `metrics`)."""
        return list(trajectories)

    def collate(self, episodes: Sequence[Trajectory]) -> TensorDict:
        """The padded batch of `episodes` (`agents.collate.collate_trajectories`): the step's one collation."""
        return collate_trajectories(episodes, pad_token_id=self.run.pad_id)

    def scored_keys(self) -> tuple[str, ...]:
        """What the scoring pass computes: old log-probs under ``old_logp=recompute`` (a learner adds its own)."""
        return ("old_logp",) if self.config.recompute_old_logp else ()

    def old_scores(self, part: TensorDict) -> dict[str, torch.Tensor]:
        """The scores of one micro-batch (`scored_keys`), no grad, under autocast: ``(n, L-1)`` each."""
        logp, _ = self._logprobs(self.run.policy, part, temperature=self.config.rl.temperature)
        return {"old_logp": logp}

    def score_rows(self, batch: TensorDict) -> torch.Tensor | None:
        """The rows the scoring pass scores (an expert's rows have no sampler to compare with); None: every row."""
        return None

    def score_old(self, batch: TensorDict) -> dict[str, float]:
        """The step's one scoring pass (`scoring.score_pass`): sets `scored_keys` on `batch`, old log-probs in place of
        the sampler's (with ``mismatch/*`` and ``--tis-cap``'s weights); returns its metrics."""
        cfg = self.config
        return scoring.score_pass(
            batch, self.scored_keys(), self.old_scores, self._rows, self.score_rows(batch),
            micro_batch_tokens=cfg.optim.micro_batch_tokens, autocast=self.autocast, tis_cap=cfg.rl.tis_cap,
        )  # fmt: skip

    def advantage_inputs(
        self, episodes: Sequence[Trajectory], batch: TensorDict, metrics: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """What the learner's own modules give its estimator (`algos.objectives.advantages.StepInput.inputs`)."""
        return {}

    def observe_advantages(self, episodes: Sequence[Trajectory], batch: TensorDict, adv: Advantages) -> None:
        """Called with the advantages the batch trains on (a learner that counts something of them)."""

    def rl_loss_terms(self, part: TensorDict, scale: LossScale) -> TensorDict:
        """Loss terms (``loss_*``) and per-token metrics of one RL micro-batch, under autocast (GRPO: pg + KL)."""
        mask = part["loss_mask"]  # (n, L-1)
        logp, _ = self._logprobs(self.run.policy, part, temperature=self.config.rl.temperature)  # (n, L-1)
        terms = self.pg_terms(part, logp, mask, scale)
        loss_kl = self.kl_loss(part, logp, mask, scale.all_tokens)
        if loss_kl is not None:
            terms["loss_kl"] = loss_kl
        return terms

    def pg_terms(self, part: TensorDict, logp: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> TensorDict:
        """``loss_pg`` over `mask`'s tokens: the run's policy loss (``--policy-loss``) and aggregation
        (``--loss-agg``), with ``--tis-cap``'s weights (`algos.objectives.policy_losses.pg_terms`)."""
        rl = self.config.rl
        pieces = policy_loss_spec(rl.policy_loss), aggregation(rl.loss_agg)
        is_weight = part.get("is_weight", None)  # --tis-cap: truncated importance weights (`score_old`)
        return pg_terms(*pieces, logp, part["old_logp"], part["adv"], mask, scale, rl, is_weight=is_weight)

    def kl_loss(
        self, part: TensorDict, logp: torch.Tensor, mask: torch.Tensor, num_tokens: float
    ) -> torch.Tensor | None:
        """``kl_coef * kl_penalty`` of a micro-batch to the frozen reference model over `mask`'s tokens (the
        ``loss_kl`` term), under the run's ``kl_estimator``; None when the run has no reference (``kl_coef`` 0).

        Args:
            part: The micro-batch, on the model's device; the reference scores its tokens (no grad).
            logp: The policy's log-probs of its tokens ``(n, L-1)``, differentiable.
            mask: ``(n, L-1)``, the tokens the term sees (sampled from the policy: the estimators assume it).
            num_tokens: The token-mean divisor (`algos.objectives.losses.masked_mean`).
        """
        if self.run.ref_model is None:
            return None
        rl = self.config.rl
        with torch.no_grad():
            ref_logp, _ = self._logprobs(self.run.ref_model, part, temperature=rl.temperature)
        return rl.kl_coef * kl_penalty(logp, ref_logp, mask, rl.kl_estimator, num_tokens=num_tokens)

    def rl_micro_batches(self, batch: TensorDict) -> list[list[int]]:
        """Row indices of each micro-batch the RL backward of `batch` runs, in order (`algos.batch.micro_batches`).

        With ``skip_zero_advantage`` (and no KL term) rows whose advantage is exactly 0 are left out.
        """
        cfg = self.config
        rows = list(range(batch.batch_size[0]))
        if cfg.rl.skip_zero_advantage and cfg.rl.kl_coef == 0 and "adv" in batch.keys():
            signal = signal_rows(batch).tolist()
            rows = [i for i in rows if signal[i]]
        lengths = batch["attention_mask"].sum(-1).tolist()
        return [[rows[j] for j in mb] for mb in micro_batches([lengths[i] for i in rows], cfg.optim.micro_batch_tokens)]

    def _rl_backward(self, batch: TensorDict) -> dict[str, float]:
        """Backward of the RL terms (loss_pg, loss_kl, ...) micro-batch by micro-batch; returns their metrics."""
        # the aggregation's divisors (--loss-agg: every sampled token, or those of the contexts whose advantage is
        # not 0, or the contexts) and every sampled token (the KL term's and a learner's own token means); data
        # parallel: of every rank's batch, so the ranks' gradients sum to the one-process gradient
        mask = batch["loss_mask"]
        counted = mask.any(-1)  # (N,)
        if aggregation(self.config.rl.loss_agg).counted == "signal":
            counted = counted & signal_rows(batch)
        tokens = float(mask[counted].sum())
        tokens, rows, all_tokens = distributed.all_sum(tokens, float(counted.sum()), float(mask.sum()))
        scale = LossScale(tokens=tokens, rows=rows, all_tokens=all_tokens)
        parts = self.rl_micro_batches(batch)
        contexts = sum(len(part_rows) for part_rows in parts)  # every row that runs is in exactly one micro-batch
        losses: dict[str, float] = {"loss_pg": 0.0}  # and every other loss_* term the micro-batches return
        token_sums: dict[str, float] = {}  # per-token metrics (clip_fraction, approx_kl, ...) times tokens
        run_tokens, trained_tokens = 0.0, 0
        with self.run.matched_passes(len(parts)):  # --fsdp: as many forward/backward passes as the busiest rank
            for part_rows in parts:
                part = self._rows(batch, part_rows)
                with self.autocast():
                    terms = self.rl_loss_terms(part, scale)
                total_loss(terms).backward()
                n_mask = float(part["loss_mask"].sum())
                run_tokens += n_mask
                trained_tokens += int(part["attention_mask"].sum())
                for key in terms.keys():
                    if key.startswith("loss_"):
                        losses[key] = losses.get(key, 0.0) + float(terms[key].detach())
                    else:
                        token_sums[key] = token_sums.get(key, 0.0) + float(terms[key]) * n_mask
        losses, token_sums = distributed.sum_over_ranks(losses), distributed.sum_over_ranks(token_sums)  # data parallel
        run_tokens, trained_tokens, contexts = distributed.all_sum(run_tokens, trained_tokens, contexts)
        out = {**losses, "tokens/trained_rl": int(trained_tokens), "rl/contexts_run": int(contexts)}
        if run_tokens:
            out.update({f"rl/{key}": value / run_tokens for key, value in token_sums.items()})
        return out

    # --- forward passes ------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 autocast on the run's device under ``use_bf16``; else a no-op."""
        return torch.autocast(self.run.device.type, dtype=torch.bfloat16, enabled=self.config.model.use_bf16)

    def _rows(self, batch: TensorDict, rows: Sequence[int]) -> TensorDict:
        return trim_rows(batch, rows, self.run.device)

    def _logprobs(
        self, model: torch.nn.Module, part: TensorDict, *, with_entropy: bool = False, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and optionally entropies) of a micro-batch at its loss-mask positions (`scoring.logprobs`)."""
        flags = {"masked_head": self.run.masked_head, "context_grad": self.config.optim.context_grad}
        return scoring.logprobs(model, part, with_entropy=with_entropy, temperature=temperature, **flags)

    # --- checkpoint state: the tie probe's flag (learners with modules of their own add theirs) ---------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"last_step_tied": self.last_step_tied}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        self.last_step_tied = bool(state.get("last_step_tied", False))
        super().load_state_dict(tensors, {k: v for k, v in state.items() if k != "last_step_tied"})
