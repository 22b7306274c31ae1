"""A training run around the algorithm: setup, resume, checkpoints, metrics, wandb, the summary.

`algos.trainer.Trainer` is the algorithm (its `train_step`); `TrainingRun`, its base class, is what a run
needs around it:

- setup from a `Config`: seeds, the model (optionally LoRA) and tokenizer, the sampler, the agent, the rollout
  collector over ``gym.make(config.env_id, **config.env_kwargs)``, the oracle demonstrations when the weighting
  rule has an SFT term, the optimizer;
- ``--resume``: the newest good checkpoint's weights, optimizer, rule, learner state and data position, with a
  warning naming settings that differ from the checkpoint's; metrics.jsonl gets back the rows a killed process
  never wrote (a checkpoint carries the rows of its steps);
- `steps`: train steps to ``config.steps`` or the training-time budget (the lr following ``lr_schedule``), a
  checkpoint every ``save_every``, each step's metrics to metrics.jsonl and wandb (offline unless logged in;
  WANDB_MODE is respected);
- `train`: the last checkpoint, the final model (``final/``, a Hugging Face directory), the trained and the
  starting model scored on held-out questions (`algos.evaluation.before_after`), the summary table;
- data parallelism under ``torchrun`` (`algos.distributed`): this rank's device, its share of the collector's
  questions, the policy in DDP (`sync_gradients`) or sharded by FSDP2 (``--fsdp``: `full_weights` around sampling,
  `matched_passes` around the micro-batches, each rank writing its own checkpoint shards), rank 0 alone writing files
  (``self.world.is_main``).

`main` is the entry points' shared body: parse the command line, train the trainer class the entry point names,
and print a fault as one line (exit status 1; 2 for settings, data files, a run directory in use and a model that
does not fit; 143 or 130 after SIGTERM or SIGINT, once the step under way is checkpointed, with the command that
resumes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from agents.records import Completion, SamplingParams
from agents.samplers import SamplerWrapper
from algos import distributed, outputs, run_control
from algos.batch import masked_head_matches
from algos.checkpoint import (
    CheckpointWriteError,
    checkpoint_problem,
    damaged_checkpoints,
    find_latest,
    is_sharded,
    load_checkpoint,
    load_sharded_tensors,
    read_state,
    restore_rng,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
    sharded_keys,
    write_text_atomic,
    writing,
)
from algos.config import AlgoName, Config, parse_config
from algos.logs import quiet_http_logs
from algos.memory import DoesNotFit
from algos.sft_data import load_demonstrations
from algos.weighting import RED, FixedSFT, NoSFT, SFTWeighting
from envs.data import DataError
from retrievers.corpus import CorpusError

logger = logging.getLogger(__name__)

__all__ = ["TrainingRun", "TrainingStopped", "cpu_threads", "lr_factor", "main", "make_weighting", "print_summary"]

_LEARNER_PREFIX = "learner/"  # checkpoint names of a learner's own tensors (value head, critic)
_AVERAGE_PREFIX = "average/"  # checkpoint names of the weight average's tensors (--weight-average)
_RESUME_MAY_CHANGE = {
    "resume",
    "steps",
    "save_every",
    "keep_checkpoints",
    "wandb",
    "progress",
    "torch_threads",
    "max_train_minutes",
    "eval_questions",
    "eval_batch_size",
    "fsdp",
}
"""Settings a resumed run may change without a warning (they do not change what the steps compute)."""


class TrainingStopped(RuntimeError):
    """A fault that stops the run (a failing retriever, no checkpoint to resume); the message says what to do."""


def make_weighting(config: Config) -> SFTWeighting:
    """The SFT weighting rule of ``config.algo``: NoSFT (grpo, ppo, archer), FixedSFT (grpo_sft, sft) or RED."""
    if config.algo in ("grpo", "ppo", "archer"):
        return NoSFT()
    if config.algo in ("grpo_sft", "sft"):
        return FixedSFT()
    return RED(max_factor=config.red_max_factor, decay=config.red_decay, use_accuracy=config.red_use_accuracy)


def sync() -> None:
    """Wait for the GPU, so a timer around GPU work measures it (nothing to do on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class TimedSampler(SamplerWrapper):
    """Wraps a sampler to time its `generate` calls, so a rollout's time splits into generation and the rest."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(sampler)
        self.seconds = 0.0
        self.tokens = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        sync()
        start = time.perf_counter()
        completions = self.inner.generate(prompts, params)
        sync()
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(c.token_ids) for c in completions)
        return completions


class TrainingRun:
    """Everything of a run but the algorithm. A subclass (`algos.trainer.Trainer`) provides `train_step`,
    `sft_step` and the learner seams the setup and checkpoints call (`init_learner`, `learner_param_groups`,
    `learner_state_dict`, `load_learner_state_dict`).

    Args:
        config: The run's settings.
        weighting: The SFT weighting rule; None builds the one of ``config.algo``.
    """

    def __init__(self, config: Config, weighting: SFTWeighting | None = None) -> None:
        import gymnasium as gym

        import envs  # noqa: F401  (registers the env ids)
        from agents.collector import RolloutCollector
        from agents.samplers.factory import make_sampler
        from agents.search_agents import CodaAgent, ContextAgent, SearchR1Agent

        self.config = config
        self.started = time.perf_counter()  # the summary's process wall time counts from here
        self.threads = run_control.TorchThreads(config.torch_threads)  # logged; re-checked between steps
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        # --- data parallel (algos.distributed): this rank's place and device -------------------------------
        self.world, self.device = distributed.init(config.torch_device, config.dist_timeout_seconds)
        # before anything in the run directory is read or written; rank 0 holds it for every rank
        self.run_lock = (
            run_control.lock_run_dir(config.output_dir, resume=config.resume) if self.world.is_main else None
        )
        self.run_dir = config.output_dir
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.weighting = weighting if weighting is not None else make_weighting(config)
        resume_from = self._checkpoint_to_resume()

        with distributed.main_first():  # rank 0 converts and caches the model first; the others load it
            self.model, self.tokenizer = self.build_model()
        self.ref_model = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.peft_model = None
        self.policy = self.model
        if config.lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                lora_dropout=config.lora_dropout,
                target_modules=list(config.lora_target_modules),
                task_type="CAUSAL_LM",
            )
            self.peft_model = get_peft_model(self.model, lora)
            self.policy = self.peft_model.get_base_model()  # the same modules, LoRA layers injected
        self.policy.eval()

        max_context = min(
            config.max_context_tokens, int(getattr(self.policy.config, "max_position_embeddings", 1 << 30))
        )
        if config.memory_check:
            self.check_memory()
        self.sampler = TimedSampler(
            make_sampler(
                config.sampler,
                model=self.policy,
                tokenizer=self.tokenizer,
                source=config.model,  # vLLM builds from it (None: the bundled model, which VLLMSampler resolves)
                max_context=max_context,
                max_batch_size=config.sampler_batch_size,
                seed=config.seed,
                decode=config.sampler_decode,
                dtype="bfloat16" if config.use_bf16 or config.param_dtype == "bfloat16" else "float32",
                gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            )
        )
        params = SamplingParams(
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p
        )
        agent_cls = CodaAgent if config.protocol == "coda" else SearchR1Agent
        if config.is_query_rewrite:  # one <query> turn: a plain context agent that stops after </query>
            agent_cls, params = ContextAgent, dataclasses.replace(params, stop=("</query>",))
        self.agent = agent_cls(self.sampler, params, max_context_tokens=max_context)
        with distributed.main_first():  # rank 0 builds and caches a local index first; the others load it
            self.collector = RolloutCollector(
                lambda: gym.make(config.env_id, disable_env_checker=True, **config.env_kwargs),
                self.agent,
                questions_per_batch=config.questions_per_step,
                group_size=config.group_size,
                indices=lambda size: training_indices(config, size),
                seed=config.seed,
                shard=(self.world.rank, self.world.size),
            )
        env = self.collector.envs[0].unwrapped
        if config.num_questions is not None and config.num_questions > env.num_examples:
            raise DataError(
                f"--num-questions {config.num_questions} is more than the {env.num_examples} questions of "
                f"{getattr(env, 'data_file', None) or config.split}"
            )
        self.validation_indices = validation_indices(config, env.num_examples)
        """The training split's questions held out of training for the final model's selection (`select_checkpoint`)."""
        uses_sft = self.weighting.uses_sft and config.sft_coef > 0
        with distributed.main_first():
            self.demos = (
                load_demonstrations(config, self.tokenizer, max_tokens=max_context, exclude=self.validation_indices)
                if uses_sft
                else []
            )
        self.init_learner()
        self.masked_head = masked_head_matches(self.policy, len(self.tokenizer), self.device)
        """Whether log-probs are computed at loss-mask positions only (`algos.batch.masked_token_logprobs`)."""
        if not config.context_grad and not self.masked_head:
            logger.warning("--no-context-grad needs a model whose logits are its LM head's projection; full gradient")
        # --fsdp: shard the policy in place before the optimizer sees its parameters (they become DTensor shards)
        self.fsdp = config.fsdp and distributed.wrap_fsdp(self.policy, self.device)
        """Whether the policy is sharded over the ranks (FSDP2); else replicated (DDP) or one process."""
        if config.fsdp and not self.fsdp:
            logger.info("--fsdp: one process has nothing to shard; the model trains whole")
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        learner_groups = self.learner_param_groups()
        self.optimizer = torch.optim.AdamW(
            [{"params": self.trainable}, *learner_groups],
            lr=config.lr,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        self.trainable = self.trainable + [p for group in learner_groups for p in group["params"]]
        self.ddp = None if self.fsdp else distributed.wrap_ddp(self.policy, self.device)  # None for one process
        """The policy in DistributedDataParallel; only `sync_gradients` runs through it."""
        self.average = self._new_average()
        """The moving average of the policy's trainable weights (``weight_average``), parameter by parameter; None
        without one. Sampling and the update use the weights themselves; the final model is the average."""
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.step = 0
        self.last_step_tied = False
        """Whether every group of the last step had equal rewards (the next step then collects a probe batch)."""
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
        self._wandb = self._init_wandb() if config.wandb and self.world.is_main else None
        for row in restored:  # checkpointed rows a killed process never logged
            self._log_wandb(row)
        self.push_weights(force=True)  # a sampler with its own copy starts from these weights (resumed ones too)

    def build_model(self) -> tuple[torch.nn.Module, Any]:
        """The run's starting model and tokenizer, on the training device (also the 'before' of the evaluation)."""
        from agents.models import load_model, tiny_model

        dtype = getattr(torch, self.config.param_dtype)  # float32 master weights unless --param-dtype bfloat16
        if self.config.model == "tiny":
            model, tokenizer = tiny_model(seed=self.config.seed, max_context=self.config.max_context_tokens)
            model = model.to(self.device, dtype)
        else:  # bf16 compute over float32 weights (--bf16) comes from autocast around each forward pass
            model, tokenizer = load_model(self.config.model, dtype=dtype, device=self.device)
        if self.config.gradient_checkpointing:
            # non-reentrant: works under autocast, FSDP2 and with inputs that need no gradient (frozen embeddings)
            if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, tokenizer

    def check_memory(self) -> None:
        """Log the run's memory estimate per device and refuse a run that cannot fit (`algos.memory`)."""
        from algos import memory

        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        shape = memory.Shape.of(self.policy.config, parameters=sum(p.numel() for p in self.model.parameters()))
        found = memory.estimate(self.config, shape, ranks=self.world.size, trainable=trainable)
        capacity = memory.device_memory(str(self.device))
        if self.world.is_main:
            logger.info("memory estimate: %s; the device has %.1f GiB", found.describe(), capacity / memory.GIB)
        memory.check(found, capacity)

    def push_weights(self, *, force: bool = False) -> None:
        """Hand the policy's current weights to a sampler that keeps its own copy (vLLM), after every
        ``sync_weights_every`` updates or when `force`d; nothing for the transformers sampler, which samples from the
        policy itself.

        Under ``--fsdp`` every rank calls this at the same step: the whole weights are gathered once (a collective)
        and each rank's engine gets them. A LoRA policy's adapter is merged into the weights for the push and taken
        out again, so the engine sees plain Hugging Face weight names.
        """
        if not hasattr(self.sampler, "load_weights"):
            return
        if not force and self.step % self.config.sync_weights_every:
            return
        with self.full_weights(), _merged_lora(self.peft_model):
            self.collector.update_policy_weights_(list(_engine_weights(self.policy)))

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
        if not self.config.resume:
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
        if "lora" in saved and bool(saved["lora"]) != self.config.lora:  # its weights would not fit the policy
            trained = {True: "a LoRA adapter (--lora)", False: "every weight (no --lora)"}
            raise DataError(
                f"--resume: {latest} trained {trained[bool(saved['lora'])]}, this run {trained[self.config.lora]}: "
                "resume with the checkpoint's setting, or start a new run in another --run-dir"
            )
        return latest

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (atomically; keeps the newest ``keep_checkpoints``).

        Every rank must call this. One process and DDP: rank 0 writes the whole tensors, with every rank's RNG states
        (gathered). ``--fsdp``: every rank writes its own shards (`_save_sharded`). Returns the checkpoint's directory
        (None on the other ranks).
        """
        names = [name for name, p in self.policy.named_parameters() if p.requires_grad]
        rng = None if self.fsdp else distributed.gather_objects(rng_state())  # under --fsdp each rank writes its own
        if not self.world.is_main and not self.fsdp:
            return None
        state = {
            "config": dataclasses.asdict(self.config),
            "weighting": self.weighting.state_dict(),
            "collector": self.collector.state_dict(),
            "last_step_tied": self.last_step_tied,
            "elapsed": self.elapsed,
            "ranks": self.world.size,
        }
        learner_tensors, learner_state = self.learner_state_dict()
        if learner_state:
            state["learner"] = learner_state
        state["metrics"] = self._unsaved_metrics  # durable with the checkpoint, whatever happens to metrics.jsonl
        if self.fsdp:
            path = self._save_sharded(names, state, learner_tensors)
        else:
            weights = distributed.full_state_dict(self.policy, names)
            if self.average is not None:
                weights = {name: t.detach().clone() for name, t in weights.items()}  # the live tensors
                with self.averaged_weights():
                    average = distributed.full_state_dict(self.policy, names)
                    weights.update({_AVERAGE_PREFIX + name: t.detach().clone() for name, t in average.items()})
            weights.update({_LEARNER_PREFIX + name: t for name, t in learner_tensors.items()})
            path = save_checkpoint(
                self.checkpoint_dir,
                self.step,
                weights=weights,
                optimizer=self.optimizer.state_dict(),
                state=state,
                keep=self.config.keep_checkpoints,
                rng=rng,
            )
        self._unsaved_metrics = []
        return path if self.world.is_main else None

    def _save_sharded(self, names: list[str], state: dict[str, Any], learner_tensors: dict[str, torch.Tensor]) -> Path:
        """``--fsdp``: every rank writes its own shards of the weights, the AdamW state and the weight average with
        torch.distributed.checkpoint, and its RNG states; rank 0 the JSON `state`, with the optimizer's parameter
        groups (`algos.checkpoint.save_sharded_checkpoint`). Nothing is gathered."""
        optimizer = distributed.sharded_optimizer_state(self.policy, self.optimizer)
        tensors: dict[str, Any] = {
            "model": distributed.sharded_model_state(self.policy, names),
            "optimizer": optimizer["state"],
        }
        if self.average is not None:
            tensors["average"] = dict(zip(names, self.average, strict=True))
        if learner_tensors:  # replicated on every rank: written once
            tensors["learner"] = dict(learner_tensors)
        return save_sharded_checkpoint(
            self.checkpoint_dir,
            self.step,
            tensors=tensors,
            state={**state, "optimizer_groups": optimizer["param_groups"]},
            keep=self.config.keep_checkpoints,
        )

    def load(self, path: str | os.PathLike) -> list[dict[str, Any]]:
        """Restore the run from a checkpoint directory (weights, optimizer, rule, learner, data position).

        Returns:
            The metrics rows the checkpoint carried that metrics.jsonl lacked (now written back to it; by rank 0
            alone under data parallelism, the other ranks get none).
        """
        state = self._load_sharded(Path(path)) if is_sharded(path) else self._load_whole(Path(path))
        self.weighting.load_state_dict(state["weighting"])
        self.collector.load_state_dict(state["collector"])
        self.step = int(state["step"])
        self.last_step_tied = bool(state.get("last_step_tied", False))
        self.elapsed = float(state.get("elapsed", 0.0))
        saved = state.get("config", {})
        current = dataclasses.asdict(self.config)
        changed = {
            k: (saved[k], v)
            for k, v in current.items()
            if k not in _RESUME_MAY_CHANGE and k in saved and _jsonable(saved[k]) != _jsonable(v)
        }
        if changed:
            logger.warning("resuming with settings that differ from the checkpoint's: %s", changed)
        ranks = int(state.get("ranks", 1))
        if ranks != self.world.size:  # the state is the global batch's (data order, seeds, whole weights)
            logger.info("resuming a checkpoint of %d rank(s) with %d", ranks, self.world.size)
        restored = self._restore_metrics(state.get("metrics", [])) if self.world.is_main else []
        logger.info("resumed from %s at step %d", path, self.step)
        return restored

    def _load_whole(self, path: Path) -> dict[str, Any]:
        """Restore weights, optimizer, weight average, learner tensors and this rank's RNG states from a whole-tensor
        checkpoint (under ``--fsdp`` each rank keeps its shard); returns its JSON state."""
        checkpoint = load_checkpoint(path, rank=self.world.rank)
        weights = {k: v for k, v in checkpoint.weights.items() if not k.startswith((_LEARNER_PREFIX, _AVERAGE_PREFIX))}
        average = {
            k.removeprefix(_AVERAGE_PREFIX): v for k, v in checkpoint.weights.items() if k.startswith(_AVERAGE_PREFIX)
        }
        learner_tensors = {
            k.removeprefix(_LEARNER_PREFIX): v for k, v in checkpoint.weights.items() if k.startswith(_LEARNER_PREFIX)
        }
        names = {name for name, p in self.policy.named_parameters() if p.requires_grad}
        missing = names - set(weights)
        if missing:
            raise ValueError(f"{path} lacks trainable parameters {sorted(missing)[:5]} (saved with other settings?)")
        if self.average is not None:  # the average first, through the parameters (under --fsdp their shards)
            if average:
                distributed.load_full_state_dict(self.policy, average)
            else:
                logger.warning("%s holds no weight average: the average starts from its weights", path)
                distributed.load_full_state_dict(self.policy, weights)
            _copy_each(self.average, self._averaged_parameters())
        self._put_weights(weights, path)
        optimizer = checkpoint.optimizer
        if self.fsdp:
            optimizer = distributed.shard_optimizer_state(self.optimizer, optimizer)
        self.optimizer.load_state_dict(optimizer)
        self.load_learner_state_dict(learner_tensors, checkpoint.state.get("learner", {}))
        return checkpoint.state

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        """Restore weights, optimizer, weight average, learner tensors and this rank's RNG states from a sharded
        checkpoint, whatever number of ranks wrote it: each rank reads its own shards under ``--fsdp``, the whole
        tensors in one process or under DDP; returns its JSON state."""
        problem = distributed.broadcast_object(checkpoint_problem(path) if self.world.is_main else None)
        if problem is not None:
            raise ValueError(f"{path} is not a complete checkpoint: {problem}")
        state = read_state(path)
        stored = sharded_keys(path)
        names = [name for name, p in self.policy.named_parameters() if p.requires_grad]
        missing = [name for name in names if f"model.{name}" not in stored]
        if missing:
            raise ValueError(f"{path} lacks trainable parameters {missing[:5]} (saved with other settings?)")
        optimizer = distributed.sharded_optimizer_state(self.policy, self.optimizer)  # its tensors to load into
        tensors: dict[str, Any] = {
            "model": distributed.sharded_model_state(self.policy, names),
            "optimizer": optimizer["state"],
        }
        has_average = any(key.startswith("average.") for key in stored)
        if self.average is not None and has_average:
            tensors["average"] = dict(zip(names, self.average, strict=True))  # loaded in place
        learner = {name: t.detach().clone() for name, t in self.learner_state_dict()[0].items()}
        if learner and any(key.startswith("learner.") for key in stored):
            tensors["learner"] = learner
        load_sharded_tensors(path, tensors)
        distributed.load_sharded_model_state(self.policy, tensors["model"])
        distributed.load_sharded_optimizer_state(
            self.policy, self.optimizer, {"state": tensors["optimizer"], "param_groups": state["optimizer_groups"]}
        )
        if self.average is not None and not has_average:
            logger.warning("%s holds no weight average: the average starts from its weights", path)
            _copy_each(self.average, self._averaged_parameters())
        self.load_learner_state_dict(tensors.get("learner", {}), state.get("learner", {}))
        restore_rng(path, self.world.rank)
        return state

    def _restore_metrics(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Make metrics.jsonl hold exactly one row per step up to the checkpoint's, then rewrite it atomically.

        Rows after the checkpoint were logged by the interrupted process and the resumed run redoes them;
        rows the checkpoint carries but the file lacks (killed between the checkpoint and the metrics write)
        are written back from the checkpoint and returned; a torn last line is dropped.
        """
        rows: dict[int, str] = {}
        if self.metrics_path.is_file():
            for line in self.metrics_path.read_text().splitlines():
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    if line.strip():
                        logger.warning("%s: dropping a damaged line: %.80s", self.metrics_path, line)
                    continue
                if step <= self.step:
                    rows.setdefault(step, line)
        restored = [row for row in saved if row["step"] <= self.step and row["step"] not in rows]
        for row in restored:
            rows[int(row["step"])] = json.dumps(row)
        if restored:
            steps = [row["step"] for row in restored]
            logger.info("%s lacked the rows of steps %s; written back from the checkpoint", self.metrics_path, steps)
        write_text_atomic(self.metrics_path, "".join(rows[step] + "\n" for step in sorted(rows)))
        return restored

    # --- the weight average (--weight-average) ----------------------------------------------------------
    def _averaged_parameters(self) -> list[torch.Tensor]:
        """The parameters the average covers: the policy's trainable ones (a learner's value head or critic not)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def _new_average(self) -> list[torch.Tensor] | None:
        if self.config.weight_average is None:
            return None
        return [p.detach().clone() for p in self._averaged_parameters()]

    def update_average(self) -> None:
        """Fold the weights of the step just taken into the average (a no-op without one).

        The decay is min(weight_average, (1 + step) / (10 + step)): the first steps, whose weights are far from
        what the run ends with, weigh little in the end (the starting weights ~0.2% of it after 60 steps at 0.9).
        """
        if self.average is None:
            return
        decay = min(float(self.config.weight_average), (1 + self.step) / (10 + self.step))
        with torch.no_grad():  # tensor by tensor: DTensor shards (--fsdp) have no rule for torch's _foreach_ ops
            for kept, p in zip(self.average, self._averaged_parameters(), strict=True):
                kept.lerp_(p, 1.0 - decay)

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Within the block the policy holds the averaged weights; its own come back after it (also on an error)."""
        if self.average is None:
            yield
            return
        params = self._averaged_parameters()
        own = [p.detach().clone() for p in params]
        _copy_each(params, self.average)
        try:
            yield
        finally:
            _copy_each(params, own)

    def use_average(self) -> None:
        """Make the averaged weights the policy's own for good (the run's end: the final model, the evaluation)."""
        if self.average is not None:
            _copy_each(self._averaged_parameters(), self.average)
            self.push_weights(force=True)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Put a checkpoint's trainable weights into the policy; the optimizer, rule and data position stay as they
        are (the final model's selection, `algos.evaluation.select_checkpoint`)."""
        if is_sharded(path):  # each rank reads its shards (the whole tensors without --fsdp)
            names = [name for name, p in self.policy.named_parameters() if p.requires_grad]
            tensors = {"model": distributed.sharded_model_state(self.policy, names)}
            load_sharded_tensors(path, tensors)
            distributed.load_sharded_model_state(self.policy, tensors["model"])
        else:
            weights = load_checkpoint(path).weights
            self._put_weights(
                {k: v for k, v in weights.items() if not k.startswith((_LEARNER_PREFIX, _AVERAGE_PREFIX))}, path
            )
        self.push_weights(force=True)

    def _put_weights(self, weights: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
        """Copy a checkpoint's policy weights into the policy (under --fsdp each rank keeps its shard)."""
        unexpected = distributed.load_full_state_dict(self.policy, weights)
        if unexpected:
            raise ValueError(f"{path} has parameters this model lacks: {unexpected[:5]}")

    def save_final_model(self) -> Path | None:
        """Write the model in Hugging Face format to ``run_dir/final`` (LoRA merged in), atomically.

        Rank 0 writes; under ``--fsdp`` every rank must call this (the whole weights are gathered from the shards).
        Returns the directory (None on the other ranks).
        """
        state = None
        if self.fsdp:  # the module's own tensors are shards: save the gathered state dict instead
            tensors = self.policy.state_dict(keep_vars=True)
            once = {id(t): name for name, t in reversed(tensors.items())}  # tied weights under their first name
            state = distributed.full_state_dict(
                self.policy, [name for name in tensors if once[id(tensors[name])] == name]
            )
        if not self.world.is_main:
            return None
        target = self.run_dir / "final"
        with writing(target, self.run_dir):  # a full or read-only disk: one error naming the path and the cause
            tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=self.run_dir))
        try:
            model = self.policy
            if self.peft_model is not None:
                model = copy.deepcopy(self.peft_model).merge_and_unload()
            with writing(target, tmp):  # classified before the partial files that filled the disk are removed
                model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                outputs.describe_final_model(tmp, self.config, self.step)  # card, config; 0755/0644, not mkdtemp's 0700
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def publish(
        self,
        final: Path,
        evaluation: dict[str, Any] | None,
        validation: dict[str, Any] | None,
        curves: str | None,
    ) -> None:
        """Rank 0, at the end: final/'s card with the held-out table, the run config beside metrics.jsonl, the
        end-of-run wandb tables and images, and the upload to ``--push-to-hub``."""
        outputs.describe_final_model(final, self.config, self.step, evaluation, validation)
        outputs.write_run_config(self.config, self.run_dir)
        if self._wandb is not None:
            import wandb

            payload = outputs.wandb_outputs(wandb, evaluation, validation, curves)
            if payload:
                self._wandb.log(payload, step=self.step)
        if self.config.push_to_hub:
            try:
                url = outputs.push_to_hub(final, self.config.push_to_hub, f"{self.config.name}: {self.step} steps")
            except Exception as err:  # the run's outputs are on disk already: a failed upload must not lose them
                logger.error(
                    "upload to %s failed (%s); retry with: hf upload %s %s",
                    self.config.push_to_hub,
                    err,
                    self.config.push_to_hub,
                    final,
                )
            else:
                logger.info("uploaded %s to the Hugging Face Hub: %s", final, url)

    # --- metrics -------------------------------------------------------------------------------------------
    def _init_wandb(self) -> Any:
        try:
            import wandb
        except ImportError:
            logger.warning("wandb is not installed (pip install wandb); logging to metrics.jsonl only")
            return None
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        return wandb.init(
            project=self.config.wandb_project,
            name=self.config.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=mode,
            config=dataclasses.asdict(self.config),
        )

    def log(self, metrics: dict[str, float]) -> None:
        """Append to metrics.jsonl and send to wandb."""
        with writing(self.metrics_path), open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(metrics) + "\n")
        self._log_wandb(metrics)

    def _log_wandb(self, metrics: dict[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        """The few numbers the progress bar shows after a step: reward, answer F1 where the env scores answers,
        the SFT weight when the algorithm has an SFT term. Learners with their own key numbers extend it."""
        fields = {"reward": f"{metrics['critic/rewards/mean']:.2f}"}
        if "answer_f1/mean" in metrics:
            fields["f1"] = f"{metrics['answer_f1/mean']:.3f}"
        if self.weighting.uses_sft:
            fields["w"] = f"{metrics.get('sft/weight', 0.0):.2f}"
        return fields

    # --- the run -------------------------------------------------------------------------------------------
    def steps(self) -> Iterator[dict[str, float]]:
        """Run the remaining steps, checkpointing every ``save_every``; yield each step's metrics.

        SIGTERM or SIGINT (`run_control.StopSignals`) lets the step under way finish; then a checkpoint of the last
        finished step is written (unless one is on disk) and `run_control.Interrupted` is raised. Between steps the
        torch thread count follows the machine's load (`run_control.TorchThreads`).
        """
        cfg = self.config
        budget = math.inf if cfg.max_train_minutes is None else 60.0 * cfg.max_train_minutes
        last_step = 0.0
        saved_step = self.step if cfg.resume else None  # a resumed run's step has its checkpoint on disk
        with run_control.StopSignals() as stop:
            while True:
                # data parallel: a signal to any rank stops every rank after the same step
                signum = distributed.all_max(stop.signum)
                if signum:
                    checkpoint = find_latest(self.checkpoint_dir) if self.step == saved_step else self.save()
                    raise run_control.Interrupted(signum, self.step, checkpoint if self.world.is_main else None)
                if self.step >= cfg.steps:
                    break
                if self.elapsed + last_step > budget:
                    logger.info("training-time budget of %.1f min reached at step %d", cfg.max_train_minutes, self.step)
                    self.stopped_early = True
                    break
                self.threads.recheck()
                start = time.perf_counter()
                self.set_lr()
                metrics = self.sft_step() if cfg.algo == "sft" else self.train_step()
                self.update_average()
                # data parallel: rank 0's clock on every rank, so all stop at the same step of a time budget (and set
                # the same lr); a rank that stopped alone would leave the others waiting in a collective
                last_step = distributed.broadcast_object(time.perf_counter() - start)
                self.elapsed += last_step
                metrics["time/elapsed"] = self.elapsed
                self._unsaved_metrics.append(metrics)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    ckpt_start = time.perf_counter()
                    self.save()  # rank 0 writes (under --fsdp every rank writes its shards)
                    saved_step = self.step
                    metrics["time/checkpoint"] = time.perf_counter() - ckpt_start
                if self.world.is_main:
                    self.log(metrics)
                yield metrics

    def set_lr(self) -> None:
        """Scale every parameter group's lr by `lr_factor` of the run's progress (steps or minutes, the further)."""
        cfg = self.config
        done = self.step / cfg.steps
        if cfg.max_train_minutes is not None:
            done = max(done, self.elapsed / (60.0 * cfg.max_train_minutes))
        for group in self.optimizer.param_groups:
            group.setdefault("peak_lr", group["lr"])
            group["lr"] = group["peak_lr"] * lr_factor(cfg.lr_schedule, done)

    def train(self) -> dict[str, Any]:
        """Run to ``config.steps``, save the final checkpoint and model, evaluate, print and return a summary."""
        from tqdm.auto import tqdm

        budget = self.config.max_train_minutes
        bar_kwargs: dict[str, Any] = {"total": self.config.steps, "initial": self.step, "unit": "step"}
        if budget is not None:  # the budget ends the run, so the bar counts training minutes, not steps
            bar_kwargs = {
                "total": budget,
                "initial": self.elapsed / 60,
                "unit": "min",
                "bar_format": "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.0f} training min {postfix}",
            }
        show = self.config.progress and self.world.is_main
        with tqdm(desc=self.config.name, disable=not show, dynamic_ncols=True, **bar_kwargs) as bar:
            for metrics in self.steps():
                bar.set_postfix({"step": self.step, **self.progress_fields(metrics)}, refresh=False)
                bar.update(1 if budget is None else min(self.elapsed / 60, budget) - bar.n)
        summary: dict[str, Any] = {"run": self.config.name, "steps": self.step, "rank": self.world.rank}
        checkpoint = self.save()  # rank 0 writes; the other ranks nothing (under --fsdp each its shards)
        distributed.barrier()  # every checkpoint is on disk before any rank lists them
        validation = None
        if self.config.validation_questions:  # the best kept checkpoint on held-out training questions
            from algos.evaluation import select_checkpoint

            validation = select_checkpoint(self)
        self.use_average()  # --weight-average: the final model and the evaluation are the average
        final = self.save_final_model()
        if checkpoint is not None and final is not None:
            summary = self.summary(checkpoint, final)
            summary["torch_threads"] = self.threads.describe()
            if validation is not None:
                summary["validation"] = validation
        if self.config.eval_questions > 0 and not self.config.is_query_rewrite:
            from algos.evaluation import before_after, plot_curves

            evaluation = before_after(self)  # every rank scores its share of the questions
            if self.world.is_main:
                summary["evaluation"] = evaluation
                curves = plot_curves(
                    self.metrics_path, self.run_dir / "curves.png", evaluation=evaluation, validation=validation
                )
                summary["curves"] = str(curves)
                summary["process_wall_time_s"] = time.perf_counter() - self.started
        if final is not None:
            self.publish(final, summary.get("evaluation"), validation, summary.get("curves"))
        distributed.barrier()  # every file is written before any rank returns
        if self.world.is_main:
            print_summary(summary)
        return summary

    def summary(self, checkpoint: Path, final: Path) -> dict[str, Any]:
        """Steps, wall time, first vs last steps' reward and F1 (from metrics.jsonl), where things are."""
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        k = max(1, min(10, len(rows) // 4))
        first, last = rows[:k], rows[-k:]
        return {
            "run": self.config.name,
            "algo": self.config.algo,
            "steps": self.step,
            "stopped_early": self.stopped_early,
            "wall_time_s": self.elapsed,
            "process_wall_time_s": time.perf_counter() - self.started,
            "window": k,
            "reward_first": _mean([r["critic/rewards/mean"] for r in first]),
            "reward_last": _mean([r["critic/rewards/mean"] for r in last]),
            "f1_first": _mean([r.get("answer_f1/mean", math.nan) for r in first]),
            "f1_last": _mean([r.get("answer_f1/mean", math.nan) for r in last]),
            "sft_weight_last": _mean([r.get("sft/weight", 0.0) for r in last]),
            "checkpoint": str(checkpoint),
            "final_model": str(final),
            "metrics": str(self.metrics_path),
        }

    def close(self) -> None:
        """Close the envs, finish the wandb run, leave the process group and release the run directory's lock."""
        self.collector.shutdown()
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


def _copy_each(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for each i (no gradient), tensor by tensor so that DTensor shards work too."""
    with torch.no_grad():
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


COOLDOWN = 0.2
"""The last share of the run over which the cooldown schedule brings the lr down."""


def training_indices(config: Config, size: int) -> range:
    """The questions of a `size`-question training split that rollouts draw from: the first ``num_questions``
    (all when None), less the last ``validation_questions`` (`validation_indices`)."""
    end = size - config.validation_questions
    if end < 1:
        raise DataError(
            f"--validation-questions {config.validation_questions} leaves none of the {size} training questions"
        )
    return range(end if config.num_questions is None else min(end, config.num_questions))


def validation_indices(config: Config, size: int) -> range:
    """The last ``validation_questions`` of a `size`-question training split: held out of training, they choose
    the final model among the kept checkpoints (`algos.evaluation.select_checkpoint`)."""
    return range(max(0, size - config.validation_questions), size)


def lr_factor(schedule: str, done: float) -> float:
    """The lr multiplier at `done` (0..1) of the run: 1 throughout (constant), 1 -> 0.1 in a straight line
    (linear), or 1 until the last `COOLDOWN` of the run, then 1 -> 0.1 in a straight line (cooldown)."""
    done = min(max(done, 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "cooldown":
        done = max(0.0, done - (1.0 - COOLDOWN)) / COOLDOWN
    return 1.0 - 0.9 * done


def cpu_threads(requested: int | None) -> int:
    """CPU threads for torch at start: `requested`, or every core that other processes leave idle now (at least one).

    What other processes use is measured over half a second (`busy_cores`); the load average, minutes behind, stands
    in where that cannot be read. A run decides again between steps from longer windows (`run_control.TorchThreads`,
    whose rule is `run_control.choose_threads`), so a spike at start does not fix the count for the whole run.
    """
    if requested:
        return requested
    busy = busy_cores()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    return run_control.choose_threads(os.cpu_count() or 1, busy)


def busy_cores(window: float = 0.5, stat: str = "/proc/stat") -> float | None:
    """Cores other processes keep busy over the next `window` seconds, from the kernel's CPU time counters (Linux);
    None where they cannot be read."""
    start = run_control.read_cpu(stat)
    time.sleep(window)
    end = run_control.read_cpu(stat)
    if start is None or end is None:
        return None
    return run_control.others_busy(start, end, os.cpu_count() or 1)


def print_summary(summary: dict[str, Any]) -> None:
    """Print a run summary as a table."""
    from rich.console import Console
    from rich.table import Table

    k = summary["window"]
    table = Table(title=f"{summary['run']} ({summary['algo']})", show_header=False)
    budget = " (training-time budget reached)" if summary.get("stopped_early") else ""
    table.add_row("steps", f"{summary['steps']}{budget}")
    table.add_row("training time", f"{summary['wall_time_s']:.0f} s ({summary['wall_time_s'] / 60:.1f} min)")
    process = summary["process_wall_time_s"]
    table.add_row("this process (setup, steps, saving)", f"{process:.0f} s ({process / 60:.1f} min)")
    if "torch_threads" in summary:
        table.add_row("torch threads", summary["torch_threads"])
    table.add_row(f"reward, first/last {k} steps", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    table.add_row(f"answer F1, first/last {k} steps", f"{summary['f1_first']:.3f} -> {summary['f1_last']:.3f}")
    table.add_row("SFT weight (last steps)", f"{summary['sft_weight_last']:.3f}")
    table.add_row("checkpoint", summary["checkpoint"])
    table.add_row("final model", summary["final_model"])
    if "validation" in summary:
        v = summary["validation"]
        scores = ", ".join(f"{c['step']}: {c['metrics']['f1']['mean']:.3f}" for c in v["candidates"])
        table.add_row(
            f"final model's step (F1 on {v['questions']} validation questions)", f"{v['selected_step']} ({scores})"
        )
    table.add_row("metrics", summary["metrics"])
    if "curves" in summary:
        table.add_row("learning curves", summary["curves"])
    console = Console()
    if not console.is_terminal:  # a log file: the table at its natural width, not wrapped at 80 columns
        console = Console(width=10_000)
    console.print(table)
    if "evaluation" in summary:
        console.print(summary["evaluation"]["table"], markup=False, highlight=False)


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def main(
    argv: Sequence[str] | None = None,
    *,
    algo: AlgoName,
    description: str | None = None,
    trainer_cls: type[TrainingRun],
    config_cls: type[Config] = Config,
    **defaults: object,
) -> dict[str, Any]:
    """Parse the command line, train, and return the summary (the entry points' shared body).

    A fault ends the process with one line: exit status 2 for settings, data files and a run directory that cannot
    be used (holding another run's checkpoints, or locked by a run in progress: `run_control.lock_run_dir`), 1 for
    the rest (a full or read-only disk among them, with the checkpoint to resume from). SIGTERM or Ctrl-C stops
    after the step under way with a checkpoint of it and one line that says how to resume; the exit status is then
    143 or 130 (`run_control.StopSignals`).

    Args:
        argv: Arguments without the program name; None reads sys.argv.
        algo: grpo, grpo_sft, red_grpo, sft, ppo or archer.
        description: The entry point's ``--help`` text.
        trainer_cls: The trainer to run: `algos.trainer.Trainer` (the GRPO family, SFT), or a learner with its own
            advantages and losses (`algos.ppo.PPOTrainer`). The entry point names it, so that this module, which
            the trainers build on, never imports one.
        config_cls: The settings class its command line parses (a learner's own extends `Config`).
        **defaults: The entry point's own defaults over the preset's (flags still override them).
    """
    config = parse_config(argv, algo=algo, description=description, config_cls=config_cls, **defaults)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_http_logs()
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # pyserini imports faiss; its CPU probing is noise
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            with run_control.StopSignals(at_once=True):  # SIGTERM or Ctrl-C in setup ends it: nothing trained yet
                trainer = trainer_cls(config)
        except (DataError, CorpusError, FileExistsError, FileNotFoundError, DoesNotFit, run_control.RunDirInUse) as err:
            _exit_with(err, 2)  # a user's data or corpus, run dir (holding checkpoints, or in use) or model size
        except (TrainingStopped, ConnectionError, CheckpointWriteError) as err:  # nothing to resume, no server, disk
            _exit_with(err, 1)
        except RuntimeError as err:
            _exit_if_timed_out(err, config)
            raise
        except run_control.Interrupted as err:
            command = run_control.rerun_command(args, config.output_dir, resume=config.resume)
            _stop_with(err, command, show=True)
        try:
            return trainer.train()
        except TrainingStopped as err:
            _exit_with(err, 1)
        except CheckpointWriteError as err:  # a full or read-only disk: the checkpoints written before it are intact
            latest = find_latest(trainer.checkpoint_dir)
            command = run_control.rerun_command(args, config.output_dir, resume=latest is not None)
            where = f"the last good checkpoint is {latest}" if latest is not None else "no checkpoint was written yet"
            _exit_with(OSError(f"{err}; {where}: once there is room (or it is writable again), run {command}"), 1)
        except RuntimeError as err:
            _exit_if_timed_out(err, config)
            raise
        except run_control.Interrupted as err:  # a checkpoint of the last finished step is on disk
            command = run_control.rerun_command(args, config.output_dir, resume=True)
            _stop_with(err, command, show=trainer.world.is_main)
        finally:
            trainer.close()
    finally:
        run_control.release_run_dir(config.output_dir)  # for a caller that goes on (the process's end releases it too)


def _exit_with(err: BaseException, status: int) -> NoReturn:
    """Print a fault as one line (no traceback: the message says what to do) and exit with `status`."""
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(status) from None


def _exit_if_timed_out(err: RuntimeError, config: Config) -> None:
    """Exit with one line (status 1) when `err` is a collective that waited past ``--dist-timeout-seconds``.

    gloo raises its timeout as a plain RuntimeError ("Timed out waiting ...ms"), NCCL as a DistBackendError; either
    means another rank stopped, hung or died, which its own output explains, so a traceback here says nothing more.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if not (isinstance(err, dist.DistError) or "timed out" in str(err).lower()):
        return
    detail = (str(err).strip().splitlines() or [""])[0][:200]
    distributed.shutdown()
    _exit_with(
        TimeoutError(
            f"a collective operation waited more than --dist-timeout-seconds {config.dist_timeout_seconds:g} for the "
            f"other ranks (one stopped, hung or died: see its output), so this rank stopped too ({detail})"
        ),
        1,
    )


def _stop_with(err: run_control.Interrupted, command: str, show: bool) -> NoReturn:
    """Print how to go on after a stop by a signal as one line (when `show`) and exit with 128 + its number."""
    if show:
        print(err.message(command), file=sys.stderr)
    raise SystemExit(err.exit_status) from None
