"""A training run around the algorithm: setup, the steps, metrics and wandb, the end of the run.

`TrainingRun` is what a run needs around its algorithm, and holds the algorithm's learner (``run.learner``, an
`algos.run.learner.Learner` of the class ``config.run.algo`` names: `algos.learners.trainer.Trainer` for the GRPO
family), which it calls each step:

- setup from a `Config` (the parts come from `algos.run.setup`): seeds, the model (optionally LoRA) and tokenizer,
  the sampler, the agent, the rollout collector over ``gym.make(config.env.env_id, **config.env_kwargs)``, the oracle
  demonstrations when the weighting rule has an SFT term, the learner, the optimizer;
- ``--resume``, checkpoints and the weight average (`algos.run.checkpointing.RunCheckpoints`, a base class);
- `steps`: the learner's steps to ``config.optim.steps`` or the training-time budget (the lr following
  ``lr_schedule``), a checkpoint every ``save_every``, each step's metrics to metrics.jsonl and wandb (offline unless
  logged in; WANDB_MODE is respected);
- `train`: the last checkpoint, the final model and what is published with it (`algos.run.finish.RunFinish`, a
  base class), the trained and the starting model scored on held-out questions (`algos.run.evaluation.before_after`);
- data parallelism under ``torchrun`` (`algos.distributed`): this rank's device, its share of the collector's
  questions, the policy in DDP (`sync_gradients`) or sharded by FSDP2 (``--fsdp``: `full_weights` around sampling,
  `matched_passes` around the micro-batches, each rank writing its own checkpoint shards), rank 0 alone writing files
  (``self.world.is_main``).

The command line's shared body, which the entry points call, is `algos.run.launch.main`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from algos import distributed
from algos.batch import masked_head_matches
from algos.checkpoints.atomic import writing
from algos.checkpoints.store import damaged_checkpoints, find_latest, read_state
from algos.config import Config
from algos.objectives.weighting import RED, FixedSFT, NoSFT, SFTWeighting
from algos.registry import algorithm, entry_command
from algos.run import control as run_control
from algos.run import outputs
from algos.run import setup as run_setup
from algos.run.checkpointing import RunCheckpoints, changed_settings
from algos.run.finish import RunFinish, print_summary
from algos.run.learner import Learner, sync
from algos.run.timed_sampler import TimedSampler
from algos.sft_data import load_demonstrations
from envs.data import DataError

logger = logging.getLogger(__name__)

__all__ = ["TrainingRun", "TrainingStopped", "lr_factor", "make_weighting", "sync"]


class TrainingStopped(RuntimeError):
    """A fault that stops the run (a failing retriever, no checkpoint to resume); the message says what to do."""


def make_weighting(config: Config) -> SFTWeighting:
    """The SFT weighting rule of ``config.run.algo``'s registry entry (`algos.registry.Algorithm.sft_weighting`):
    NoSFT (grpo, grpo_expert, ppo, archer), FixedSFT (grpo_sft, sft), RED (red_grpo), or the entry's own function.
    grpo_expert has no SFT term: its demonstrations join the GRPO groups (`algos.learners.expert`)."""
    rule = algorithm(config.run.algo).sft_weighting
    if callable(rule):
        return rule(config)
    if rule == "none":
        return NoSFT()
    if rule == "fixed":
        return FixedSFT()
    sft = config.sft
    return RED(sft.red_max_factor, sft.red_decay, sft.red_use_accuracy, sft.red_window)


class TrainingRun(RunCheckpoints, RunFinish):
    """Everything of a run but the algorithm, which it holds as ``self.learner`` (`algos.run.learner.Learner`) and
    calls: `Learner.param_groups` for the optimizer, `Learner.train_step` or `Learner.sft_step` each step (as the
    algorithm's `algos.registry.Algorithm.step` says), `Learner.state_dict` in every checkpoint. The learner counts
    its update with `finish_update`.

        run = TrainingRun(preset_config("tiny", run_dir="runs/tiny"))
        metrics = run.learner.train_step()

    Args:
        config: The run's settings.
        weighting: The SFT weighting rule; None builds the one of ``config.run.algo``.
        learner: The learner's class; None takes the one ``config.run.algo``'s registry entry names.
    """

    def __init__(
        self, config: Config, weighting: SFTWeighting | None = None, learner: type[Learner] | None = None
    ) -> None:
        self.config = config
        self.started = time.perf_counter()  # the summary's process wall time counts from here
        learner_class = learner or algorithm(config.run.algo).learner_class()  # an unimportable one fails here
        self.threads = run_control.TorchThreads(config.run.torch_threads)  # logged; re-checked between steps
        random.seed(config.run.seed)
        np.random.seed(config.run.seed)
        torch.manual_seed(config.run.seed)
        # --- data parallel (algos.distributed): this rank's place and device -------------------------------
        self.world, self.device = distributed.init(config.model.torch_device, config.run.dist_timeout_seconds)
        # before anything in the run directory is read or written; rank 0 holds it for every rank
        self.run_lock = (
            run_control.lock_run_dir(config.run.output_dir, resume=config.run.resume) if self.world.is_main else None
        )
        self.run_dir = config.run.output_dir
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.weighting = weighting if weighting is not None else make_weighting(config)
        resume_from = self._checkpoint_to_resume()

        self._build_policy()
        max_context = run_setup.context_limit(config, self.policy)
        self.sampler_rows = self._choose_sampler_rows()
        if config.model.memory_check:
            self.check_memory()
        self.sampler = TimedSampler(
            run_setup.make_sampler(config, self.policy, self.tokenizer, max_context, rows=self.sampler_rows)
        )
        self.agent = run_setup.make_agent(config, self.sampler, max_context)
        self._build_collector()
        uses_sft = self.weighting.uses_sft and config.sft.sft_coef > 0
        with distributed.main_first():
            self.demos = (
                load_demonstrations(config, self.tokenizer, max_tokens=max_context, exclude=self.validation_indices)
                if uses_sft
                else []
            )
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.step = 0
        self.learner: Learner = learner_class(self)
        """The algorithm: it makes the batch and its loss terms, and updates the policy (`steps` calls it)."""
        self.masked_head = masked_head_matches(self.policy, len(self.tokenizer), self.device)
        """Whether log-probs are computed at loss-mask positions only (`algos.batch.masked_token_logprobs`)."""
        if not config.optim.context_grad and not self.masked_head:
            logger.warning("--no-context-grad needs a model whose logits are its LM head's projection; full gradient")
        self._build_optimizer()
        self.average = self._new_average()
        """The moving average of the policy's trainable weights (``weight_average``), parameter by parameter; None
        without one. Sampling and the update use the weights themselves; the final model is the average."""
        self.stopped_early = False
        self.elapsed = 0.0  # training seconds of this run's earlier processes (resumed runs)
        self._unsaved_metrics: list[dict[str, Any]] = []  # the next checkpoint carries them
        restored: list[dict[str, Any]] = []
        if resume_from is None:
            if self.world.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self.metrics_path.write_text("")
        else:
            restored = self.load(resume_from)
        self._wandb = outputs.start_wandb(config, self.run_dir) if config.run.wandb and self.world.is_main else None
        for row in restored:  # checkpointed rows a killed process never logged
            self._log_wandb(row)
        self.push_weights(force=True)  # a sampler with its own copy starts from these weights (resumed ones too)

    def _build_policy(self) -> None:
        """The model and tokenizer, the frozen reference model (``kl_coef`` > 0), and the policy: the model itself,
        or with ``--lora`` the same modules with LoRA layers injected (``peft_model`` wraps them; else None)."""
        with distributed.main_first():  # rank 0 converts and caches the model first; the others load it
            self.model, self.tokenizer = self.build_model()
        self.ref_model = None
        if self.config.rl.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.peft_model = run_setup.add_lora(self.model, self.config)
        self.policy = self.model if self.peft_model is None else self.peft_model.get_base_model()
        self.policy.eval()

    def _build_collector(self) -> None:
        """The rollout collector over this rank's share of the training questions, and the held-out validation
        questions of the training split."""
        config = self.config
        with distributed.main_first():  # rank 0 builds and caches a local index first; the others load it
            self.collector = run_setup.make_collector(config, self.agent, shard=(self.world.rank, self.world.size))
        env = self.collector.envs[0].unwrapped
        if config.env.num_questions is not None and config.env.num_questions > env.num_examples:
            raise DataError(
                f"--num-questions {config.env.num_questions} is more than the {env.num_examples} questions of "
                f"{getattr(env, 'data_file', None) or config.env.split}"
            )
        run_setup.check_question_lengths(config, env)
        self.validation_indices = run_setup.validation_indices(config, env.num_examples)
        """The training split's questions held out of training for the final model's selection (`select_checkpoint`)."""

    def _build_optimizer(self) -> None:
        """Shard the policy (``--fsdp``) before AdamW sees its parameters, then AdamW over the trainable ones and the
        learner's own groups, then DDP around the policy when several ranks replicate it."""
        # --fsdp: shard the policy in place before the optimizer sees its parameters (they become DTensor shards)
        self.fsdp = self.config.run.fsdp and distributed.wrap_fsdp(self.policy, self.device)
        """Whether the policy is sharded over the ranks (FSDP2); else replicated (DDP) or one process."""
        if self.config.run.fsdp and not self.fsdp:
            logger.info("--fsdp: one process has nothing to shard; the model trains whole")
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        learner_groups = self.learner.param_groups()
        self.optimizer = run_setup.make_optimizer(self.config, self.trainable, learner_groups)
        self.trainable = self.trainable + [p for group in learner_groups for p in group["params"]]
        self.ddp = None if self.fsdp else distributed.wrap_ddp(self.policy, self.device)  # None for one process
        """The policy in DistributedDataParallel; only `sync_gradients` runs through it."""

    def build_model(self) -> tuple[torch.nn.Module, Any]:
        """The run's starting model and tokenizer, on the training device (also the 'before' of the evaluation)."""
        return run_setup.build_model(self.config, self.device)

    def _choose_sampler_rows(self) -> int:
        """The transformers sampler's rows per batch (`memory.sampler_rows`: ``--sampler-batch-size``, or chosen from
        the device's free memory), logged once on a GPU."""
        from algos.run import memory

        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        shape = memory.Shape.of(self.policy.config, parameters=sum(p.numel() for p in self.model.parameters()))
        capacity = memory.usable_memory(str(self.device)) if self.device.type == "cuda" else None
        rows, why = memory.sampler_rows(self.config, shape, capacity, ranks=self.world.size, trainable=trainable)
        if self.world.is_main and self.config.model.sampler == "hf" and self.device.type == "cuda":
            logger.info("sampler rows per batch: %d (%s)", rows, why)
        return rows

    def check_memory(self) -> None:
        """Log the run's memory estimate and disk need, and refuse a run that cannot fit (`memory`, `disk`)."""
        from algos.run import memory

        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        shape = memory.Shape.of(self.policy.config, parameters=sum(p.numel() for p in self.model.parameters()))
        capacity = memory.usable_memory(str(self.device))
        config = memory.with_sampler_rows(self.config, self.sampler_rows)  # the rows the sampler is given
        found = memory.estimate(config, shape, ranks=self.world.size, trainable=trainable, capacity=capacity)
        if self.world.is_main:
            total = memory.device_memory(str(self.device))
            logger.info(
                "memory estimate: %s; the run can use %.1f of the device's %.1f GiB",
                found.describe(),
                capacity / memory.GIB,
                total / memory.GIB,
            )
        memory.check(found, capacity)
        from algos.run import disk

        disk.check_run(self.config, parameters=shape.parameters, trainable=trainable, is_main=self.world.is_main)

    def push_weights(self, *, force: bool = False) -> float | None:
        """Hand the policy's current weights to a sampler that keeps its own copy (vLLM), after every
        ``sync_weights_every`` updates or when `force`d; nothing for the transformers sampler, which samples from the
        policy itself.

        Under ``--fsdp`` every rank calls this at the same step: the whole weights are gathered once (a collective)
        and each rank's engine gets them. A LoRA policy's adapter is merged into the weights for the push and taken
        out again, so the engine sees plain Hugging Face weight names.

        Returns:
            The push's seconds; 0.0 when this call had none to make, None for a sampler without weights of its own.
        """
        if not hasattr(self.sampler, "load_weights"):
            return None
        if not force and self.step % self.config.model.sync_weights_every:
            return 0.0
        start = time.perf_counter()
        with self.full_weights(), _merged_lora(self.peft_model):
            self.collector.update_policy_weights_(list(_engine_weights(self.policy)))
        return time.perf_counter() - start

    def finish_update(self, *, push: bool = True) -> float | None:
        """Count the update the learner just made (``step`` + 1) and, with `push`, hand the new weights to a sampler
        that keeps its own copy (`push_weights`); the learner calls this after its optimizer step, before it builds
        the step's metrics row (which carries the new step).

        Returns:
            The push's seconds (`push_weights`); None without a push or for a sampler without weights of its own.
        """
        self.step += 1
        return self.push_weights() if push else None

    def sync_gradients(self) -> None:
        """Sum the accumulated gradients over the data-parallel ranks (no-op for one process; `algos.distributed`).

        DDP: one closing pass all-reduces the policy's gradients. FSDP2 reduce-scattered them in each backward
        pass already. Either way the trainable tensors outside the policy (a value head) are all-reduced here.
        """
        if not self.world.enabled:
            return
        in_policy = {id(p) for p in self.policy.parameters()}
        others = [p for p in self.trainable if id(p) not in in_policy]
        if self.ddp is not None:
            distributed.sync_gradients(self.ddp, others, pad_token_id=self.pad_id)
        else:
            distributed.sum_gradients(others)

    def matched_passes(self, passes: int) -> contextlib.AbstractContextManager:
        """Around this rank's `passes` micro-batches: under ``--fsdp`` every rank then runs as many forward and
        backward passes as the busiest one, so all join every all-gather and reduce-scatter
        (`algos.distributed.matched_passes`); else nothing."""
        if not self.fsdp:
            return contextlib.nullcontext()
        return distributed.matched_passes(self.policy, passes, pad_token_id=self.pad_id)

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Hold the policy's whole weights on every rank for the block (``--fsdp``; else nothing to do).

        Sampling and no-grad scoring run as many forward passes as each rank's own episodes need; with the weights
        gathered once on entry (`algos.distributed.gathered`) those passes communicate nothing. The sampler's kept
        keys and values are dropped on entry: gathering refills the same parameter tensors in place, which the
        sampler's own test for changed weights (tensor ids and versions) cannot see.
        """
        if not self.fsdp:
            yield
            return
        with distributed.gathered(self.policy):
            clear = getattr(self.sampler, "clear_cache", None)
            if clear is not None:
                clear()
            yield

    # --- resume and checkpoints ----------------------------------------------------------------------------
    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint ``--resume`` continues from (None for a new run); checked before anything is built.

        Raises:
            FileExistsError: a new run (no ``--resume``) in a directory that holds checkpoints.
            TrainingStopped: ``--resume`` with no usable checkpoint (none, or all damaged: each is named).
        """
        latest, damaged = None, {}
        if self.world.is_main:  # every file hashed once, not once per rank; the ranks then agree on the answer
            latest = find_latest(self.checkpoint_dir)
            damaged = damaged_checkpoints(self.checkpoint_dir) if latest is None else {}
        latest, damaged = distributed.broadcast_object((latest, damaged))
        if not self.config.run.resume:
            if latest is not None or damaged:
                raise FileExistsError(
                    f"{self.run_dir} already holds checkpoints: pass --resume to continue that run, "
                    "or choose another --run-dir (or delete it)"
                )
            return None
        if latest is None:  # like Hugging Face Trainer: resuming from nothing is an error, and nothing is touched
            if damaged:
                listing = "; ".join(f"{path.name}: {problem}" for path, problem in damaged.items())
                raise TrainingStopped(
                    f"--resume: no valid checkpoint in {self.checkpoint_dir} ({listing}); nothing was changed. "
                    "Restore a checkpoint, or start a new run in another --run-dir"
                )
            raise TrainingStopped(
                f"--resume: no checkpoint in {self.checkpoint_dir} to resume from; "
                "drop --resume to start a new run (or check --run-dir)"
            )
        saved = read_state(latest).get("config", {})
        if saved.get("algo", self.config.run.algo) != self.config.run.algo:  # its state is another learner's
            raise DataError(
                f"--resume: {latest} is a checkpoint of {saved['algo']}, this run is {self.config.run.algo}: resume it "
                f"with {entry_command(saved['algo'])}, or start from its weights in another --run-dir with "
                f"--model {self.run_dir / 'final'} (once it has finished)"
            )
        named = {name.replace("-", "_") for name in self.config.run.resume_changed}
        unnamed = {k: v for k, v in changed_settings(saved, self.config).items() if k not in named and k != "lora"}
        if unnamed:
            listing = ", ".join(f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in unnamed.items())
            flags = " ".join(k.replace("_", "-") for k in unnamed)
            raise DataError(
                f"--resume: {latest} was trained with other settings ({listing}); resume with the checkpoint's, "
                f"name them to go on with the new ones (--resume-changed {flags}), or start a new run in another "
                "--run-dir"
            )
        if "lora" in saved and bool(saved["lora"]) != self.config.model.lora:  # its weights would not fit the policy
            trained = {True: "a LoRA adapter (--lora)", False: "every weight (no --lora)"}
            raise DataError(
                f"--resume: {latest} trained {trained[bool(saved['lora'])]}, "
                f"this run {trained[self.config.model.lora]}: resume with the checkpoint's setting, or start a new run "
                "in another --run-dir"
            )
        return latest

    # --- metrics -------------------------------------------------------------------------------------------
    def check_run_dir(self) -> None:
        """Stop, before writing, if the run directory is no longer this run's (removed, or replaced by another run's,
        while this one ran: `run_control.RunDirLock.lost`). Every rank calls it; rank 0 holds the lock.

        Raises:
            TrainingStopped: on every rank, naming what happened.
        """
        lost = distributed.broadcast_object(self.run_lock.lost() if self.run_lock is not None else None)
        if lost:
            raise TrainingStopped(
                f"{lost}: stopped after step {self.step} without writing more (its checkpoints and metrics went "
                "with it); run it again in a directory of its own"
            )

    def log(self, metrics: dict[str, float]) -> None:
        """Append to metrics.jsonl and send to wandb."""
        with writing(self.metrics_path), open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(metrics) + "\n")
        self._log_wandb(metrics)

    def _log_wandb(self, metrics: dict[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    # --- the run -------------------------------------------------------------------------------------------
    def steps(self) -> Iterator[dict[str, float]]:
        """Run the remaining steps, checkpointing every ``save_every``; yield each step's metrics.

        SIGTERM or SIGINT (`run_control.StopSignals`) lets the step under way finish; then a checkpoint of the last
        finished step is written (unless one is on disk) and `run_control.Interrupted` is raised. Between steps the
        torch thread count follows the machine's load (`run_control.TorchThreads`).
        """
        cfg = self.config
        budget = math.inf if cfg.optim.max_train_minutes is None else 60.0 * cfg.optim.max_train_minutes
        last_step = 0.0
        saved_step = self.step if cfg.run.resume else None  # a resumed run's step has its checkpoint on disk
        sft = algorithm(cfg.run.algo).step == "sft"  # the learner's supervised step, else its RL step
        with run_control.StopSignals() as stop:
            while True:
                # data parallel: a signal to any rank stops every rank after the same step
                signum = distributed.all_max(stop.signum)
                if signum:
                    self.check_run_dir()  # a directory that is no longer this run's gets no checkpoint either
                    self.wait_for_checkpoint()  # one written in the background is on disk before the stop
                    checkpoint = find_latest(self.checkpoint_dir) if self.step == saved_step else self.save()
                    raise run_control.Interrupted(signum, self.step, checkpoint if self.world.is_main else None)
                if self.step >= cfg.optim.steps:
                    break
                if self.elapsed + last_step > budget:
                    logger.info(
                        "training-time budget of %.1f min reached at step %d", cfg.optim.max_train_minutes, self.step
                    )
                    self.stopped_early = True
                    break
                self.threads.recheck()
                self.checkpoint_writer.check()  # a checkpoint whose background write failed stops the run here
                start = time.perf_counter()
                self.set_lr()
                metrics = self.learner.sft_step() if sft else self.learner.train_step()
                self.update_average()
                # data parallel: rank 0's clock on every rank, so all stop at the same step of a time budget (and set
                # the same lr); a rank that stopped alone would leave the others waiting in a collective
                last_step = distributed.broadcast_object(time.perf_counter() - start)
                self.check_run_dir()
                self.elapsed += last_step
                metrics["time/elapsed"] = self.elapsed
                self._unsaved_metrics.append(metrics)
                if cfg.run.save_every and self.step % cfg.run.save_every == 0 and self.step < cfg.optim.steps:
                    ckpt_start = time.perf_counter()  # the loop's share: the copy (and a wait for the last write)
                    self.save(background=True)  # rank 0 writes beside the next steps (--fsdp: every rank)
                    saved_step = self.step
                    metrics["time/checkpoint"] = time.perf_counter() - ckpt_start
                if self.world.is_main:
                    self.log(metrics)
                yield metrics

    def set_lr(self) -> None:
        """Scale every parameter group's lr by `lr_factor` of the run's progress (steps or minutes, the further)."""
        cfg = self.config
        done = self.step / cfg.optim.steps
        if cfg.optim.max_train_minutes is not None:
            done = max(done, self.elapsed / (60.0 * cfg.optim.max_train_minutes))
        for group in self.optimizer.param_groups:
            group.setdefault("peak_lr", group["lr"])
            group["lr"] = group["peak_lr"] * lr_factor(cfg.optim.lr_schedule, done)

    def train(self) -> dict[str, Any]:
        """Run to ``config.optim.steps``, save the final checkpoint and model, evaluate, print and return a summary."""
        from tqdm.auto import tqdm

        budget = self.config.optim.max_train_minutes
        bar_kwargs: dict[str, Any] = {"total": self.config.optim.steps, "initial": self.step, "unit": "step"}
        if budget is not None:  # the budget ends the run, so the bar counts training minutes, not steps
            bar_kwargs = {
                "total": budget,
                "initial": self.elapsed / 60,
                "unit": "min",
                "bar_format": "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.0f} training min {postfix}",
            }
        show = self.config.run.progress and self.world.is_main
        with tqdm(desc=self.config.run.name, disable=not show, dynamic_ncols=True, **bar_kwargs) as bar:
            for metrics in self.steps():
                bar.set_postfix({"step": self.step, **self.learner.progress_fields(metrics)}, refresh=False)
                bar.update(1 if budget is None else min(self.elapsed / 60, budget) - bar.n)
        summary: dict[str, Any] = {"run": self.config.run.name, "steps": self.step, "rank": self.world.rank}
        with run_control.StopSignals() as stop:  # a signal now waits for the final model, then skips the scoring
            self.check_run_dir()
            checkpoint = self.save()  # rank 0 writes; the other ranks nothing (under --fsdp each its shards)
            distributed.barrier()  # every checkpoint is on disk before any rank lists them
            validation = None
            if self.config.run.validation_questions:  # the best kept checkpoint on held-out training questions
                from algos.run.evaluation import select_checkpoint

                validation = select_checkpoint(self)
            self.use_average()  # --weight-average: the final model and the evaluation are the average
            final = self.save_final_model()
        signum = distributed.all_max(stop.signum)  # data parallel: every rank skips the scoring, or none
        if signum:
            raise run_control.Interrupted(signum, self.step, checkpoint, final=final)
        try:  # a signal now stops the summary (it hashes the weights) and the scoring at once: final/ is on disk
            with run_control.StopSignals(at_once=True):
                if checkpoint is not None and final is not None:
                    summary = self.summary(checkpoint, final)
                    summary["torch_threads"] = self.threads.describe()
                    if validation is not None:
                        summary["validation"] = validation
                if self.config.run.eval_questions > 0 and not self.config.env.is_query_rewrite:
                    self._score(summary, validation)
        except run_control.Interrupted as err:
            raise run_control.Interrupted(err.signum, self.step, checkpoint, final=final) from None
        if final is not None:
            self.publish(final, summary.get("evaluation"), validation, summary.get("curves"), summary.get("provenance"))
        distributed.barrier()  # every file is written before any rank returns
        if self.world.is_main:
            print_summary(summary)
        return summary

    def _score(self, summary: dict[str, Any], validation: dict[str, Any] | None) -> None:
        """The held-out before/after scores and the learning curves, into `summary` (rank 0's)."""
        from algos.run.evaluation import before_after, plot_curves

        evaluation = before_after(self)  # every rank scores its share of the questions
        if self.world.is_main:
            summary["evaluation"] = evaluation
            curves = plot_curves(
                self.metrics_path, self.run_dir / "curves.png", evaluation=evaluation, validation=validation
            )
            summary["curves"] = str(curves)
            summary["process_wall_time_s"] = time.perf_counter() - self.started

    def close(self) -> None:
        """Close the envs and a sampler with an engine of its own, finish the wandb run, leave the process group and
        release the run directory's lock."""
        try:  # a run that stopped on an error still completes a checkpoint under way
            self.wait_for_checkpoint()
        except OSError as err:
            logger.error("%s", err)
        self.collector.shutdown()
        close_sampler = getattr(self.sampler, "close", None)
        if close_sampler is not None:  # vLLM: its teardown needs the process group still there
            close_sampler()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.ddp = None
        distributed.shutdown()
        if self.world.is_main:
            run_control.release_run_dir(self.run_dir)


@contextlib.contextmanager
def _merged_lora(peft_model: Any) -> Iterator[None]:
    """A LoRA policy's adapter merged into its base weights for the block, unmerged after (no-op without LoRA)."""
    if peft_model is None:
        yield
        return
    with torch.no_grad():
        peft_model.merge_adapter()
    try:
        yield
    finally:
        with torch.no_grad():
            peft_model.unmerge_adapter()


def _engine_weights(policy: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's parameters under their Hugging Face names, as an engine's weight loader expects them: tied
    tensors once, a merged LoRA layer's base weight under the plain name, the adapter's own tensors left out."""
    for name, param in policy.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), param.detach()


COOLDOWN = 0.2
"""The last share of the run over which the cooldown schedule brings the lr down."""


def lr_factor(schedule: str, done: float) -> float:
    """The lr multiplier at `done` (0..1) of the run: 1 throughout (constant), 1 -> 0.1 in a straight line
    (linear), or 1 until the last `COOLDOWN` of the run, then 1 -> 0.1 in a straight line (cooldown).

    These are transformers' "constant" and "warmup_stable_decay" (linear decay, min_lr_ratio 0.1) shapes, but
    `get_scheduler` counts whole steps of a fixed run, while `done` also follows --max-train-minutes' clock.
    """
    done = min(max(done, 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "cooldown":
        done = max(0.0, done - (1.0 - COOLDOWN)) / COOLDOWN
    return 1.0 - 0.9 * done
