"""The training loop shared by GRPO, GRPO + fixed SFT and GRPO + RED.

The three algorithms differ only in the SFT weighting rule (`algos.weighting`: NoSFT, FixedSFT, RED);
everything else is this one loop. One step:

    trajectories = collector.collect()                         # G episodes for each of B questions
    batch = collate_trajectories(trajectories)                 # (N, T) contexts; adv shared per episode
    old_logp = batch["old_logp"]  or  token_logprobs(model)    # (N, T-1) sampler's, or recomputed
    w = rule.weight(rl_entropy=entropy_estimate(old_logp, mask), batch_accuracy=answer_accuracy(trajectories))
    loss = loss_pg [+ loss_kl] + w * sft_coef * sft_loss(demos)  # token means, micro-batched by token count
    loss.backward(); clip_grad_norm_; AdamW.step()
    rule.observe_sft_entropy(h_sft)                            # SFT entropy measured in the SFT forward pass

Details a reader may need:

- Advantages are group-normalized episode rewards (`group_advantages`), broadcast to every generation
  of the episode (a CoDA episode's planner and executor contexts alike).
- loss_pg is the clipped token-level objective over every sampled token of the batch, normalized by the
  batch's total count of sampled tokens (so micro-batching gives the same gradient as one big batch).
  Contexts whose advantage is exactly 0 contribute exactly 0 to it; with ``skip_zero_advantage`` (and no
  KL term) they are left out of the forward pass. clip_fraction and approx_kl are then measured over the
  contexts that were run.
- Old log-probs are the sampler's (the sampler shares the training model, so they are the current
  policy's up to numerics); ``old_logp=recompute`` (default under bf16) scores them with the training
  model instead, as a vLLM or bf16 sampler needs.
- The SFT minibatch (``sft_batch_size`` demonstration contexts, drawn by (seed, step)) runs through
  `token_logprobs_and_entropy`: one forward pass gives the loss and the predictive entropy RED needs. That
  entropy is measured on the weights before the update and handed to the rule after it.
- On GPU the forward passes run under bfloat16 autocast; weights and AdamW state stay float32.
- The model stays in eval mode while sampling and switches to train mode for the update.

Other learners reuse this loop by subclassing `Trainer` (`algos.ppo.PPOTrainer`, `algos.archer.ArCHerTrainer`):
``make_batch`` sets the advantages (per generation or per token), ``rl_loss_terms`` returns a micro-batch's
``loss_*`` terms, ``init_learner`` / ``learner_param_groups`` add modules (a value head, a critic) and
``learner_state_dict`` / ``load_learner_state_dict`` put their state into the checkpoints (``learner/*``).
``update_epochs`` > 1 takes several optimizer steps on one batch (PPO epochs); the GRPO family uses 1.

Outputs in the run directory: ``metrics.jsonl`` (one JSON object per step), ``checkpoints/`` (see
`algos.checkpoint`), ``final/`` (a Hugging Face model directory, ``agents.models.load_model(path)``),
and wandb's files (offline unless logged in; WANDB_MODE is respected).

Faults stop the run rather than being averaged into it: a step in which more than
``max_retrieval_error_rate`` of the searches failed (a dead or hung retrieval server) raises
`TrainingStopped` before the update; ``--resume`` without a usable checkpoint raises it, naming the
damaged checkpoints and changing nothing on disk. A checkpoint carries the metrics rows of its steps, so a
run killed between a checkpoint and its metrics write gets them back on resume. The command line prints
such errors, and settings or data files that cannot be used, as one line (exit status 1 or 2).
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
import torch.nn.functional as F
from tensordict import TensorDict

from agents.records import Completion, SamplingParams
from agents.samplers import SamplerWrapper
from algos.batch import answer_accuracy, collate_sft, collate_trajectories, token_logprobs, token_logprobs_and_entropy
from algos.checkpoint import damaged_checkpoints, find_latest, load_checkpoint, save_checkpoint, write_text_atomic
from algos.config import AlgoName, Config, parse_config
from algos.losses import entropy_estimate, group_advantages, kl_penalty, policy_loss, sft_loss, total_loss
from algos.sft_data import load_demonstrations, sample_indices
from algos.weighting import RED, FixedSFT, NoSFT, SFTWeighting
from envs.data import DataError

logger = logging.getLogger(__name__)

_LEARNER_PREFIX = "learner/"
"""Checkpoint weight names of a learner's own tensors (value head, critic) start with this."""

__all__ = ["Trainer", "TrainingStopped", "main", "make_weighting", "masked_token_logprobs", "micro_batches"]


class TrainingStopped(RuntimeError):
    """A fault that stops the run (a failing retriever, no checkpoint to resume); the message says what to do."""


def make_weighting(config: Config) -> SFTWeighting:
    """The SFT weighting rule of ``config.algo``: NoSFT (grpo), FixedSFT (grpo_sft) or RED (red_grpo)."""
    if config.algo in ("grpo", "ppo", "archer"):
        return NoSFT()
    if config.algo in ("grpo_sft", "sft"):
        return FixedSFT()
    return RED(max_factor=config.red_max_factor, decay=config.red_decay, use_accuracy=config.red_use_accuracy)


def micro_batches(lengths: Sequence[int], max_tokens: int, max_padding: float = 0.05) -> list[list[int]]:
    """Split rows into micro-batches of at most `max_tokens` padded tokens (rows x longest row) whose padding is at
    most `max_padding` of their padded tokens.

    Each micro-batch runs trimmed to its longest row (`Trainer._rows`), so its padding is what its shorter rows
    lack; with every micro-batch under `max_padding`, so is the whole pass. Rows are taken longest first and a row
    joins the current micro-batch while both bounds hold, else it starts the next one: rows of similar length
    share a micro-batch, and a row longer than `max_tokens` gets one of its own. Lengths spread wider than
    `max_padding` give more, smaller micro-batches (`max_padding=1` groups by the token budget alone).

    Args:
        lengths: Real (unpadded) length of each row.
        max_tokens: Budget of padded tokens per micro-batch.
        max_padding: Largest share of a micro-batch's padded tokens that may be padding.

    Returns:
        Lists of row indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    padding = 0  # padding tokens of the current micro-batch
    for i in order:
        if out:
            longest, rows = lengths[out[-1][0]], len(out[-1]) + 1
            extra = longest - lengths[i]
            if rows * longest <= max_tokens and padding + extra <= max_padding * rows * longest:
                out[-1].append(i)
                padding += extra
                continue
        out.append([i])
        padding = 0
    return out


def masked_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`algos.batch.token_logprobs` computed only where `mask` is set: the LM head runs on those positions only.

    In RL contexts most tokens are prompt and observations (mask 0); projecting only the sampled positions
    onto the vocabulary saves most of the LM head's compute and the (tokens, vocab) logit memory.

    Args:
        model: A Hugging Face causal LM with `get_decoder()` and `get_output_embeddings()` whose logits are
            the plain projection of the decoder's last hidden state (checked once by the trainer).
        input_ids: ``(n, L)`` right-padded ids.
        attention_mask: ``(n, L)``.
        mask: ``(n, L-1)`` bool, shifted like `algos.batch` (column t scores token t+1).
        temperature: Divides the logits.
        with_entropy: Also return the (detached) predictive entropy at the masked positions.

    Returns:
        ``(logp, entropy)``: ``(n, L-1)`` float32, 0 off the mask; entropy likewise or None.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = hidden.last_hidden_state[:, :-1][mask]  # (M, H): only the positions the loss sees
    logits = model.get_output_embeddings()(hidden).float()  # (M, V)
    if temperature != 1.0:
        logits = logits / temperature
    target = input_ids[:, 1:][mask]  # (M,)
    picked = -F.cross_entropy(logits, target, reduction="none")  # (M,)
    logp = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            log_probs = logits.detach().log_softmax(-1)  # (M, V)
            h = -(log_probs.exp() * log_probs).sum(-1)  # (M,)
            entropy = torch.zeros_like(logp).masked_scatter(mask, h)
    return logp, entropy


class _TimedSampler(SamplerWrapper):
    """Wraps a sampler to time its `generate` calls, so a rollout's time splits into generation and the rest."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(sampler)
        self.seconds = 0.0
        self.tokens = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        _sync()
        start = time.perf_counter()
        completions = self.inner.generate(prompts, params)
        _sync()
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(c.token_ids) for c in completions)
        return completions


def rewards_tied(trajectories: Sequence[Any]) -> bool:
    """Whether every GRPO group's episodes scored the same reward (so every group advantage is 0)."""
    groups: dict[int, set[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, set()).add(float(t.reward))
    return all(len(rewards) == 1 for rewards in groups.values())


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def lr_factor(schedule: str, done: float) -> float:
    """The lr multiplier at `done` (0..1) of the run: 1 throughout (constant), or 1 -> 0.1 in a straight line."""
    return 1.0 if schedule == "constant" else 1.0 - 0.9 * min(max(done, 0.0), 1.0)


class Trainer:
    """One training run: model, sampler, agent, collector, demonstrations, optimizer, weighting rule.

    Args:
        config: The run's settings.
        weighting: The SFT weighting rule; None builds the one of ``config.algo``.
    """

    def __init__(self, config: Config, weighting: SFTWeighting | None = None) -> None:
        import gymnasium as gym

        import envs  # noqa: F401  (registers the env ids)
        from agents.collector import RolloutCollector
        from agents.samplers.hf import HFSampler
        from agents.search_agents import CodaAgent, ContextAgent, SearchR1Agent

        self.config = config
        self.started = time.perf_counter()
        """When this process began setting up the run (the summary's process wall time)."""
        torch.set_num_threads(cpu_threads(config.torch_threads))
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.device = torch.device(config.torch_device)
        self.run_dir = config.output_dir
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.weighting = weighting if weighting is not None else make_weighting(config)
        self._resume_from = self._checkpoint_to_resume()

        self.model, self.tokenizer = self.build_model()
        self.ref_model = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
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
        else:
            self.peft_model = None
            self.policy = self.model
        self.policy.eval()

        max_context = min(
            config.max_context_tokens, int(getattr(self.policy.config, "max_position_embeddings", 1 << 30))
        )
        self.sampler = _TimedSampler(
            HFSampler(
                self.policy,
                self.tokenizer,
                max_context=max_context,
                max_batch_size=config.sampler_batch_size,
                seed=config.seed,
            )
        )
        params = SamplingParams(
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p
        )
        agent_cls = CodaAgent if config.protocol == "coda" else SearchR1Agent
        if config.is_query_rewrite:  # one <query> turn: a plain context agent that stops after </query>
            agent_cls, params = ContextAgent, dataclasses.replace(params, stop=("</query>",))
        self.agent = agent_cls(self.sampler, params, max_context_tokens=max_context)
        self.collector = RolloutCollector(
            lambda: gym.make(config.env_id, disable_env_checker=True, **config.env_kwargs),
            self.agent,
            questions_per_batch=config.questions_per_step,
            group_size=config.group_size,
            indices=None if config.num_questions is None else range(config.num_questions),
            seed=config.seed,
        )
        env = self.collector.envs[0].unwrapped
        if config.num_questions is not None and config.num_questions > env.num_examples:
            raise DataError(
                f"--num-questions {config.num_questions} is more than the {env.num_examples} questions of "
                f"{getattr(env, 'data_file', None) or config.split}"
            )
        self.demos = (
            load_demonstrations(config, self.tokenizer, max_tokens=max_context)
            if config.uses_sft and self.weighting.uses_sft
            else []
        )
        self.init_learner()
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        learner_groups = self.learner_param_groups()
        self.optimizer = torch.optim.AdamW(
            [{"params": self.trainable}, *learner_groups],
            lr=config.lr,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        self.trainable = self.trainable + [p for group in learner_groups for p in group["params"]]
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.masked_head = self._check_masked_head()
        """Whether log-probs are computed at loss-mask positions only (see `masked_token_logprobs`)."""
        self.step = 0
        self.last_step_tied = False
        """Whether every group of the last step had equal rewards (the next step then collects a probe batch)."""
        self.stopped_early = False
        """Whether the training-time budget ended the run before ``config.steps``."""
        self.elapsed = 0.0
        """Training seconds of earlier processes of this run (resumed runs)."""
        self.last_batch: TensorDict | None = None
        """The last step's RL batch (for benchmarks)."""
        self.last_micro_batches: list[list[int]] = []
        """Row indices of the last step's RL micro-batches that ran forward/backward."""
        self._unsaved_metrics: list[dict[str, Any]] = []
        """Metrics rows of the steps since the last checkpoint; the next checkpoint carries them."""
        self._restored_metrics: list[dict[str, Any]] = []
        self._start_or_resume()
        self._wandb = self._init_wandb() if config.wandb else None
        for row in self._restored_metrics:  # checkpointed rows a killed process never logged
            self._log_wandb(row)

    # --- seams for other learners (algos.ppo, algos.archer); the GRPO family uses these defaults ----------
    def init_learner(self) -> None:
        """Build the learner's own modules (a value head, a critic); runs after the model, before the optimizer."""

    def learner_param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups the main optimizer trains besides the policy's (e.g. a value head, its own lr)."""
        return []

    def learner_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The learner's checkpoint state: tensors by name (saved with the weights) and JSON-able values."""
        return {}, {}

    def load_learner_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Restore what `learner_state_dict` returned."""
        if tensors or state:
            raise ValueError(f"checkpoint holds learner state ({sorted(tensors)[:3]}) that {self.config.algo} lacks")

    def make_batch(self, trajectories: Sequence[Any]) -> tuple[TensorDict, dict[str, float]]:
        """The RL batch of one step, advantages included, and metrics about them (GRPO: group-normalized).

        Runs before the update; sets ``adv`` per generation ``(N,)`` or per token ``(N, T-1)``.
        """
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (B,)
        group_id = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)  # (B,)
        adv = group_advantages(rewards, group_id, scale=self.config.advantage_std_scale)  # (B,)
        batch = collate_trajectories(trajectories, pad_token_id=self.pad_id, adv=adv)
        if self.config.recompute_old_logp:
            self._old_logp(batch)
        return batch, {"critic/advantages/abs_mean": float(adv.abs().mean())}

    def rl_loss_terms(self, part: TensorDict, num_tokens: float) -> TensorDict:
        """Loss terms (``loss_*``) and per-token metrics of one RL micro-batch, under autocast (GRPO: pg + KL)."""
        cfg = self.config
        mask = part["loss_mask"]  # (n, L-1)
        logp, _ = self._logprobs(self.policy, part, temperature=cfg.temperature)  # (n, L-1)
        terms = policy_loss(
            logp, part["old_logp"], part["adv"], mask, cfg.clip_eps, cfg.clip_eps_high, num_tokens=num_tokens
        )
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = self._logprobs(self.ref_model, part, temperature=cfg.temperature)
            terms["loss_kl"] = cfg.kl_coef * kl_penalty(logp, ref_logp, mask, cfg.kl_estimator, num_tokens=num_tokens)
        return terms

    # --- setup -------------------------------------------------------------------------------------------
    def build_model(self) -> tuple[torch.nn.Module, Any]:
        """The run's starting model and tokenizer, on the training device (also the 'before' of the evaluation)."""
        from agents.models import load_model, tiny_model

        if self.config.model == "tiny":
            model, tokenizer = tiny_model(seed=self.config.seed, max_context=self.config.max_context_tokens)
            return model.to(self.device), tokenizer
        # float32 master weights; bf16 (when on) comes from autocast around each forward pass
        return load_model(self.config.model, dtype=torch.float32, device=self.device)

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint ``--resume`` continues from (None for a new run); checked before anything is built.

        Raises:
            FileExistsError: a new run (no ``--resume``) in a directory that holds checkpoints.
            TrainingStopped: ``--resume`` with no usable checkpoint (none, or all damaged: each is named).
        """
        latest = find_latest(self.checkpoint_dir)
        damaged = damaged_checkpoints(self.checkpoint_dir) if latest is None else {}
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
        return latest

    def _start_or_resume(self) -> None:
        if self._resume_from is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics_path.write_text("")
            return
        self.load(self._resume_from)

    def load(self, path: str | os.PathLike) -> None:
        """Restore the run from a checkpoint directory (weights, optimizer, RNGs, rule, data position)."""
        checkpoint = load_checkpoint(path)
        weights = {k: v for k, v in checkpoint.weights.items() if not k.startswith(_LEARNER_PREFIX)}
        learner_tensors = {
            k[len(_LEARNER_PREFIX) :]: v for k, v in checkpoint.weights.items() if k.startswith(_LEARNER_PREFIX)
        }
        names = {name for name, p in self.policy.named_parameters() if p.requires_grad}
        missing = names - set(weights)
        if missing:
            raise ValueError(f"{path} lacks trainable parameters {sorted(missing)[:5]} (saved with other settings?)")
        result = self.policy.load_state_dict(weights, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"{path} has parameters this model lacks: {result.unexpected_keys[:5]}")
        self.optimizer.load_state_dict(checkpoint.optimizer)
        self.load_learner_state_dict(learner_tensors, checkpoint.state.get("learner", {}))
        self.weighting.load_state_dict(checkpoint.state["weighting"])
        self.collector.load_state_dict(checkpoint.state["collector"])
        self.step = checkpoint.step
        self.last_step_tied = bool(checkpoint.state.get("last_step_tied", False))
        self.elapsed = float(checkpoint.state.get("elapsed", 0.0))
        saved = checkpoint.state.get("config", {})
        ignore = {
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
        }
        changed = {k: (saved.get(k), v) for k, v in dataclasses.asdict(self.config).items() if k not in ignore}
        changed = {k: pair for k, pair in changed.items() if k in saved and _jsonable(pair[0]) != _jsonable(pair[1])}
        if changed:
            logger.warning("resuming with settings that differ from the checkpoint's: %s", changed)
        self._restore_metrics(checkpoint.state.get("metrics", []))
        logger.info("resumed from %s at step %d", path, self.step)

    def _restore_metrics(self, saved: list[dict[str, Any]]) -> None:
        """Make metrics.jsonl hold exactly one row per step up to the checkpoint's, then rewrite it atomically.

        Rows after the checkpoint were logged by the interrupted process and the resumed run redoes them;
        rows the checkpoint carries but the file lacks (killed between the checkpoint and the metrics write)
        are written back from the checkpoint; a torn last line is dropped.
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
        self._restored_metrics = [row for row in saved if row["step"] <= self.step and row["step"] not in rows]
        for row in self._restored_metrics:
            rows[int(row["step"])] = json.dumps(row)
        if self._restored_metrics:
            steps = [row["step"] for row in self._restored_metrics]
            logger.info("%s lacked the rows of steps %s; written back from the checkpoint", self.metrics_path, steps)
        write_text_atomic(self.metrics_path, "".join(rows[step] + "\n" for step in sorted(rows)))

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

    # --- one step ----------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.use_bf16)

    def _logprobs(
        self, model: torch.nn.Module, part: TensorDict, *, with_entropy: bool = False, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and optionally entropies) of a micro-batch at its loss-mask positions, ``(n, L-1)`` each."""
        ids, attn, mask = part["input_ids"], part["attention_mask"], part["loss_mask"]
        if self.masked_head:
            return masked_token_logprobs(model, ids, attn, mask, temperature=temperature, with_entropy=with_entropy)
        if with_entropy:
            return token_logprobs_and_entropy(model, ids, attn, micro_batch_size=len(ids), temperature=temperature)
        return token_logprobs(model, ids, attn, micro_batch_size=len(ids), temperature=temperature), None

    def _check_masked_head(self) -> bool:
        """Whether `masked_token_logprobs` reproduces `token_logprobs` for this model (no logit scaling or
        soft-capping after the LM head); the trainer falls back to the full-vocabulary path otherwise."""
        ids = torch.tensor([[1, 5, 17, 300, 42, 7, 99, 3]], device=self.device) % len(self.tokenizer)
        attn = torch.ones_like(ids)
        mask = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool, device=self.device)
        try:
            with torch.no_grad():
                fast, _ = masked_token_logprobs(self.policy, ids, attn, mask)
                full = token_logprobs(self.policy, ids, attn)
        except (AttributeError, NotImplementedError, TypeError):
            return False
        return bool(torch.allclose(fast, full, atol=1e-4, rtol=1e-4))

    def _rows(self, batch: TensorDict, rows: list[int]) -> TensorDict:
        """Rows of a padded batch trimmed to their longest real length, on the training device."""
        part = batch[torch.tensor(rows)]
        length = int(part["attention_mask"].sum(-1).max())
        out = {
            key: (value[:, :length] if value.ndim == 2 and key in ("input_ids", "attention_mask") else value)
            for key, value in part.items()
        }
        for key, value in out.items():  # per-token tensors (loss_mask, old_logp, per-token adv, ...): T-1 columns
            if value.ndim == 2 and key not in ("input_ids", "attention_mask"):
                out[key] = value[:, : length - 1]
        return TensorDict(out, batch_size=[len(rows)]).to(self.device)

    def _old_logp(self, batch: TensorDict) -> None:
        """Replace the sampler's log-probs by the training model's (no grad), micro-batched."""
        old_logp = torch.zeros_like(batch["old_logp"])  # (N, T-1)
        lengths = batch["attention_mask"].sum(-1).tolist()
        with torch.no_grad(), self._autocast():
            for rows in micro_batches(lengths, self.config.micro_batch_tokens):
                part = self._rows(batch, rows)
                logp, _ = self._logprobs(self.policy, part, temperature=self.config.temperature)  # (n, L-1)
                old_logp[torch.tensor(rows), : logp.shape[1]] = logp.float().cpu()
        batch["old_logp"] = torch.where(batch["loss_mask"], old_logp, torch.zeros_like(old_logp))

    def _rl_backward(self, batch: TensorDict) -> dict[str, float]:
        """Forward/backward of loss_pg (+ loss_kl) over the RL batch in micro-batches; returns its metrics."""
        cfg = self.config
        num_tokens = float(batch["loss_mask"].sum())  # every sampled token of the batch: the token-mean divisor
        rows = list(range(batch.batch_size[0]))
        if cfg.skip_zero_advantage and cfg.kl_coef == 0 and batch["adv"].ndim == 1:
            rows = [i for i in rows if float(batch["adv"][i]) != 0.0]
        lengths = batch["attention_mask"].sum(-1).tolist()
        groups = [[rows[j] for j in mb] for mb in micro_batches([lengths[i] for i in rows], cfg.micro_batch_tokens)]
        self.last_micro_batches = groups
        losses: dict[str, float] = {"loss_pg": 0.0}  # and every other loss_* term the micro-batches return
        token_sums: dict[str, float] = {}  # per-token metrics (clip_fraction, approx_kl, ...) times tokens
        run_tokens, trained_tokens = 0.0, 0
        for group in groups:
            part = self._rows(batch, group)
            with self._autocast():
                terms = self.rl_loss_terms(part, num_tokens)
            total_loss(terms).backward()
            n_mask = float(part["loss_mask"].sum())
            run_tokens += n_mask
            trained_tokens += int(part["attention_mask"].sum())
            for key in terms.keys():
                if key.startswith("loss_"):
                    losses[key] = losses.get(key, 0.0) + float(terms[key].detach())
                else:
                    token_sums[key] = token_sums.get(key, 0.0) + float(terms[key]) * n_mask
        out = {**losses, "tokens/trained_rl": trained_tokens, "rl/contexts_run": len(rows)}
        if run_tokens:
            out.update({f"rl/{key}": value / run_tokens for key, value in token_sums.items()})
        return out

    def _sft_backward(self, sft_batch: TensorDict, coef: float) -> dict[str, float]:
        """Forward/backward of ``coef * sft_loss`` over the SFT minibatch; also measures its predictive entropy."""
        num_tokens = float(sft_batch["loss_mask"].sum())
        lengths = sft_batch["attention_mask"].sum(-1).tolist()
        nll, entropy_sum, trained_tokens = 0.0, 0.0, 0
        for rows in micro_batches(lengths, self.config.micro_batch_tokens):
            part = self._rows(sft_batch, rows)
            with self._autocast():
                logp, entropy = self._logprobs(self.policy, part, with_entropy=True)  # (n, L-1) each
                part_nll = sft_loss(logp, part["loss_mask"], num_tokens=num_tokens)
            (coef * part_nll).backward()
            nll += float(part_nll.detach())
            entropy_sum += float(entropy[part["loss_mask"]].sum())
            trained_tokens += int(part["attention_mask"].sum())
        return {
            "loss_sft": coef * nll,
            "sft/nll": nll,
            "sft/entropy": entropy_sum / max(num_tokens, 1.0),
            "tokens/trained_sft": trained_tokens,
        }

    def sft_minibatch(self, step: int) -> TensorDict:
        """The SFT minibatch of `step` (a function of the seed and the step only)."""
        picks = sample_indices(len(self.demos), self.config.sft_batch_size, self.config.seed, step)
        return collate_sft([self.demos[i] for i in picks], pad_token_id=self.pad_id)

    def train_step(self) -> dict[str, float]:
        """Collect one batch, update the model once; return the step's metrics."""
        cfg = self.config
        step_start = time.perf_counter()

        # rollouts: generation (sampler) vs everything else (env, retrieval, agent bookkeeping)
        self.policy.eval()
        self.sampler.seconds, self.sampler.tokens = 0.0, 0
        probe = cfg.tie_probe_questions if self.last_step_tied else None
        with self._autocast():  # under bf16 the sampler runs in bf16 too; old_logp="auto" then recomputes
            trajectories = self.collector.collect(probe)
        t_rollout = time.perf_counter() - step_start
        infos = [t.info for t in trajectories]
        retrieval_errors, retrieval_error_rate = self.check_retrieval(infos)  # stops the run before the update

        # old log-probs and the rule's weight, before the update
        start = time.perf_counter()
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (B,)
        batch, batch_metrics = self.make_batch(trajectories)
        self.last_step_tied = rewards_tied(trajectories)
        _sync()
        t_old_logp = time.perf_counter() - start
        rl_entropy = float(entropy_estimate(batch["old_logp"], batch["loss_mask"]))
        accuracy = answer_accuracy(trajectories)
        w = self.weighting.weight(rl_entropy=rl_entropy, batch_accuracy=accuracy)
        sft_coef = w * cfg.sft_coef if self.demos else 0.0

        # the update
        t_fwd_bwd, t_optimizer = 0.0, 0.0
        self.policy.train()
        for _ in range(cfg.update_epochs):  # PPO epochs over the same batch; 1 for the GRPO family
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = self._rl_backward(batch)
            if sft_coef > 0:
                metrics.update(self._sft_backward(self.sft_minibatch(self.step), sft_coef))
            _sync()
            t_fwd_bwd += time.perf_counter() - start
            start = time.perf_counter()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            _sync()
            t_optimizer += time.perf_counter() - start
        self.policy.eval()
        if "sft/entropy" in metrics:
            self.weighting.observe_sft_entropy(metrics["sft/entropy"])
        self.collector.update_policy_weights_()
        self.step += 1
        self.last_batch = batch

        t_step = time.perf_counter() - step_start
        sampled = int(batch["loss_mask"].sum())
        trained = metrics.pop("tokens/trained_rl") + metrics.pop("tokens/trained_sft", 0)
        metrics.update(
            {
                "step": self.step,
                "total_loss": sum(v for k, v in metrics.items() if k.startswith("loss_")),
                "critic/rewards/mean": float(rewards.mean()),
                "critic/rewards/max": float(rewards.max()),
                "critic/rewards/min": float(rewards.min()),
                **batch_metrics,
                "answer_f1/mean": _mean([float(i.get("f1", 0.0)) for i in infos]),
                "answer_em/mean": _mean([float(i.get("em", 0.0)) for i in infos]),
                "format_scores/mean": _mean([float(i.get("format", 0.0)) for i in infos]),
                "refine_scores/mean": _mean([float(i.get("refine", 0.0)) for i in infos]),
                "env/num_searches": _mean([float(i.get("num_searches", 0)) for i in infos]),
                "env/retrieval_errors": retrieval_errors / max(len(infos), 1),
                "env/retrieval_error_rate": retrieval_error_rate,
                "env/recall": _mean([float(i.get("recall", 0.0)) for i in infos]),
                **({"env/recall_at_k": _mean([i["recall_at_k"] for i in infos])} if cfg.is_query_rewrite else {}),
                "env/invalid_actions": _mean([float(i.get("invalid_actions", 0)) for i in infos]),
                "env/answered": _mean([float(bool(i.get("answered", False))) for i in infos]),
                "train/batch_accuracy": accuracy,
                "train/questions": len({t.group_id for t in trajectories}),
                "train/rl_entropy": rl_entropy,
                "train/grad_norm": float(grad_norm),
                "train/lr": self.optimizer.param_groups[0]["lr"],
                **self.weighting.metrics(),
                "time/step": t_step,
                "time/rollout": t_rollout,
                "time/generation": self.sampler.seconds,
                "time/env_and_retrieval": t_rollout - self.sampler.seconds,
                "time/old_logp": t_old_logp,
                "time/forward_backward": t_fwd_bwd,
                "time/optimizer": t_optimizer,
                "tokens/sampled": sampled,
                "tokens/trained": trained,
                "tokens/s": trained / t_fwd_bwd if t_fwd_bwd > 0 else 0.0,
                "tokens/s_generation": self.sampler.tokens / self.sampler.seconds if self.sampler.seconds else 0.0,
            }
        )
        return metrics

    def check_retrieval(self, infos: Sequence[dict[str, Any]]) -> tuple[int, float]:
        """Count the failed searches of a step's episodes; stop the run when too many failed.

        Args:
            infos: The episodes' terminal infos (``num_searches`` counts searches that returned results,
                ``retrieval_errors`` those the retriever failed).

        Returns:
            (failed searches, their share of all searches).

        Raises:
            TrainingStopped: more than ``max_retrieval_error_rate`` of the searches failed: training on episodes
                whose searches all said "Search failed" would teach the policy that searching is useless.
        """
        errors = sum(int(i.get("retrieval_errors", 0)) for i in infos)
        searches = errors + sum(int(i.get("num_searches", 0)) for i in infos)
        rate = errors / searches if searches else 0.0
        if rate > self.config.max_retrieval_error_rate:
            last = next((i["retrieval_error"] for i in reversed(infos) if i.get("retrieval_error")), "unknown")
            raise TrainingStopped(
                f"step {self.step + 1}: {errors} of {searches} searches failed ({rate:.0%}, over "
                f"--max-retrieval-error-rate {self.config.max_retrieval_error_rate}); last failure: {last}. "
                f"Check the retriever ({self.config.retriever}), then run again with --resume"
            )
        return errors, rate

    def sft_step(self) -> dict[str, float]:
        """One supervised step on oracle demonstrations alone: the warm start of ``python -m algos.sft``.

        No rollouts: the model learns the protocol from the demonstrations (loss = sft_loss, weight 1), so
        GRPO's groups later hold valid episodes with different rewards. Reward and F1 are logged as NaN.
        """
        start = time.perf_counter()
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._sft_backward(self.sft_minibatch(self.step), 1.0)
        _sync()
        t_fwd_bwd = time.perf_counter() - start
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.eval()
        self.step += 1
        trained = metrics.pop("tokens/trained_sft")
        metrics.update(
            {
                "step": self.step,
                "total_loss": metrics["loss_sft"],
                "sft/weight": 1.0,
                "critic/rewards/mean": float("nan"),
                "answer_f1/mean": float("nan"),
                "train/grad_norm": float(grad_norm),
                "train/lr": self.optimizer.param_groups[0]["lr"],
                "time/step": time.perf_counter() - start,
                "time/forward_backward": t_fwd_bwd,
                "tokens/trained": trained,
                "tokens/s": trained / t_fwd_bwd if t_fwd_bwd > 0 else 0.0,
            }
        )
        return metrics

    # --- the run -----------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step (atomically; keeps the newest ``keep_checkpoints``)."""
        weights = {name: p for name, p in self.policy.named_parameters() if p.requires_grad}
        state = {
            "config": dataclasses.asdict(self.config),
            "weighting": self.weighting.state_dict(),
            "collector": self.collector.state_dict(),
            "last_step_tied": self.last_step_tied,
            "elapsed": self.elapsed,
        }
        learner_tensors, learner_state = self.learner_state_dict()
        weights.update({_LEARNER_PREFIX + name: t for name, t in learner_tensors.items()})
        if learner_state:
            state["learner"] = learner_state
        state["metrics"] = self._unsaved_metrics  # durable with the checkpoint, whatever happens to metrics.jsonl
        path = save_checkpoint(
            self.checkpoint_dir,
            self.step,
            weights=weights,
            optimizer=self.optimizer.state_dict(),
            state=state,
            keep=self.config.keep_checkpoints,
        )
        self._unsaved_metrics = []
        return path

    def save_final_model(self) -> Path:
        """Write the model in Hugging Face format to ``run_dir/final`` (LoRA merged in), atomically."""
        target = self.run_dir / "final"
        tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=self.run_dir))
        try:
            model = self.policy
            if self.peft_model is not None:
                model = copy.deepcopy(self.peft_model).merge_and_unload()
            model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            tmp.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def log(self, metrics: dict[str, float]) -> None:
        """Append to metrics.jsonl and send to wandb."""
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(metrics) + "\n")
        self._log_wandb(metrics)

    def _log_wandb(self, metrics: dict[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def steps(self) -> Iterator[dict[str, float]]:
        """Run the remaining steps, checkpointing every ``save_every``; yield each step's metrics."""
        cfg = self.config
        budget = math.inf if cfg.max_train_minutes is None else 60.0 * cfg.max_train_minutes
        last_step = 0.0
        while self.step < cfg.steps:
            if self.elapsed + last_step > budget:
                logger.info("training-time budget of %.1f min reached at step %d", cfg.max_train_minutes, self.step)
                self.stopped_early = True
                break
            start = time.perf_counter()
            self.set_lr()
            metrics = self.sft_step() if cfg.algo == "sft" else self.train_step()
            last_step = time.perf_counter() - start
            self.elapsed += last_step
            metrics["time/elapsed"] = self.elapsed
            self._unsaved_metrics.append(metrics)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                ckpt_start = time.perf_counter()
                self.save()
                metrics["time/checkpoint"] = time.perf_counter() - ckpt_start
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

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        """The few numbers the progress bar shows after a step: reward, answer F1 on QA envs, the SFT weight
        when the algorithm has an SFT term. Learners with their own key numbers extend it."""
        fields = {"reward": f"{metrics['critic/rewards/mean']:.2f}"}
        if "QueryRewrite" not in (self.config.env_id or ""):  # a rewrite episode has no answer to score
            fields["f1"] = f"{metrics['answer_f1/mean']:.3f}"
        if self.weighting.uses_sft:
            fields["w"] = f"{metrics.get('sft/weight', 0.0):.2f}"
        return fields

    def train(self) -> dict[str, Any]:
        """Run to ``config.steps``, save the final checkpoint and model, print and return a summary."""
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
        with tqdm(desc=self.config.name, disable=not self.config.progress, dynamic_ncols=True, **bar_kwargs) as bar:
            for metrics in self.steps():
                bar.set_postfix({"step": self.step, **self.progress_fields(metrics)}, refresh=False)
                bar.update(1 if budget is None else min(self.elapsed / 60, budget) - bar.n)
        checkpoint = self.save()
        final = self.save_final_model()
        summary = self.summary(checkpoint, final)
        if self.config.eval_questions > 0 and self.config.algo not in ("archer",) and not self.config.is_query_rewrite:
            from algos.evaluation import before_after, plot_curves

            summary["evaluation"] = before_after(self)
            summary["curves"] = str(plot_curves(self.metrics_path, self.run_dir / "curves.png"))
            summary["process_wall_time_s"] = time.perf_counter() - self.started
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
            "f1_first": _mean([r["answer_f1/mean"] for r in first]),
            "f1_last": _mean([r["answer_f1/mean"] for r in last]),
            "sft_weight_last": _mean([r.get("sft/weight", 0.0) for r in last]),
            "checkpoint": str(checkpoint),
            "final_model": str(final),
            "metrics": str(self.metrics_path),
        }

    def close(self) -> None:
        """Close the envs and finish the wandb run."""
        self.collector.shutdown()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def cpu_threads(requested: int | None) -> int:
    """CPU threads for torch: `requested`, or every core the load average leaves idle (at least one).

    One thread per process beats several when the cores are contended (OpenMP threads spin-wait on each
    other), while on an idle machine every core helps: the load average at start decides.
    """
    if requested:
        return requested
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(cores, cores - int(load + 0.5)))


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
    table.add_row(f"reward, first/last {k} steps", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    table.add_row(f"answer F1, first/last {k} steps", f"{summary['f1_first']:.3f} -> {summary['f1_last']:.3f}")
    table.add_row("SFT weight (last steps)", f"{summary['sft_weight_last']:.3f}")
    table.add_row("checkpoint", summary["checkpoint"])
    table.add_row("final model", summary["final_model"])
    table.add_row("metrics", summary["metrics"])
    if "curves" in summary:
        table.add_row("learning curves", summary["curves"])
    console = Console()
    console.print(table)
    if "evaluation" in summary:
        console.print(summary["evaluation"]["table"], markup=False, highlight=False)


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
    trainer_cls: type[Trainer] | None = None,
    **defaults: object,
) -> dict[str, Any]:
    """Parse the command line, train, and return the summary (the entry points' shared body).

    Args:
        argv: Arguments without the program name; None reads sys.argv.
        algo: grpo, grpo_sft, red_grpo or sft.
        description: The entry point's ``--help`` text.
        trainer_cls: The `Trainer` subclass to run (a learner with its own advantages and losses); None: Trainer.
        **defaults: The entry point's own defaults over the preset's (flags still override them).
    """
    config = parse_config(argv, algo=algo, description=description, **defaults)  # bad settings: exits 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # pyserini imports faiss; its CPU probing is noise
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        trainer = (trainer_cls or Trainer)(config)
    except (DataError, FileExistsError, FileNotFoundError) as err:  # a user's data or run directory
        _exit_with(err, 2)
    except (TrainingStopped, ConnectionError) as err:  # nothing to resume, no retrieval server
        _exit_with(err, 1)
    try:
        return trainer.train()
    except TrainingStopped as err:
        _exit_with(err, 1)
    finally:
        trainer.close()


def _exit_with(err: BaseException, status: int) -> NoReturn:
    """Print a fault as one line (no traceback: the message says what to do) and exit with `status`."""
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(status) from None
