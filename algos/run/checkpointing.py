"""The state a training run keeps on disk and in memory besides its weights: checkpoints, resume, the weight average.

`RunCheckpoints` is a base of `training_run.TrainingRun`; its methods use the run's attributes (``config``, ``policy``,
``optimizer``, ``weighting``, ``collector``, ``learner``, ``world``, ``step``, ...). A checkpoint holds the trainable
weights, the AdamW state, the weighting rule's state, the learner's own tensors and state
(`algos.run.learner.Learner.state_dict`), the data position, every rank's RNG states and the metrics rows written
since the last checkpoint; under ``--fsdp`` each rank writes its own shards. The checkpoints every ``save_every``
steps are written on a thread beside the next steps (`algos.checkpoints.background`); the final one is on disk before
the run goes on to its final model. ``--resume`` restores all of it (`RunCheckpoints.load`) and warns about settings
that differ from the checkpoint's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from algos import distributed
from algos.checkpoints.atomic import write_text_atomic
from algos.checkpoints.background import BackgroundWriter
from algos.checkpoints.files import restore_rng, rng_state, step_dir_name
from algos.checkpoints.sharded import (
    load_sharded_tensors,
    save_sharded_checkpoint,
    sharded_keys,
    side_group,
    snapshot_sharded_checkpoint,
)
from algos.checkpoints.store import checkpoint_problem, is_sharded, load_checkpoint, read_state, snapshot_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["RunCheckpoints"]

_LEARNER_PREFIX = "learner/"  # checkpoint names of a learner's own tensors (value head, critic)
_AVERAGE_PREFIX = "average/"  # checkpoint names of the weight average's tensors (--weight-average)
_RESUME_MAY_CHANGE = {
    "resume",
    "resume_changed",
    "run_dir",
    "run_name",
    "push_to_hub",
    "memory_check",
    "dist_timeout_seconds",
    "wandb_project",
    "steps",
    "save_every",
    "keep_checkpoints",
    "wandb",
    "progress",
    "verbose",
    "torch_threads",
    "max_train_minutes",
    "eval_questions",
    "eval_batch_size",
    "max_eval_error_rate",
    "fsdp",
}
"""Settings a resumed run may change without a warning (they do not change what the steps compute)."""


def changed_settings(saved: dict[str, Any], config: Any) -> dict[str, tuple[Any, Any]]:
    """The settings of `config` that differ from a checkpoint's `saved` ones, as ``{name: (saved, now)}``, leaving out
    those a resumed run may change (`_RESUME_MAY_CHANGE`) and those the checkpoint does not record."""
    current = config.flat()
    return {
        k: (saved[k], v)
        for k, v in current.items()
        if k not in _RESUME_MAY_CHANGE and k in saved and _jsonable(saved[k]) != _jsonable(v)
    }


class RunCheckpoints:
    """Checkpoints, resume and the weight average of a `algos.run.training_run.TrainingRun` (a base class of it).

    What it reads of the run, which `TrainingRun` sets up before the first checkpoint, is declared below.
    """

    config: Any
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    learner: Any  # algos.run.learner.Learner: its state_dict / load_state_dict
    collector: Any  # its state (the data order) is in every checkpoint
    weighting: Any  # algos.objectives.weighting.SFTWeighting: its state too
    world: Any  # algos.distributed.World
    fsdp: bool
    step: int
    elapsed: float  # training seconds of the run's earlier processes
    metrics_path: Path
    checkpoint_dir: Path
    average: list[torch.Tensor] | None  # --weight-average: the running average
    _unsaved_metrics: list[dict[str, Any]]
    push_weights: Callable[[], float | None]

    @property
    def checkpoint_writer(self) -> BackgroundWriter:
        """The thread that writes checkpoints beside the steps (`algos.checkpoints.background`), made on first use."""
        if "_checkpoint_writer" not in self.__dict__:
            self._checkpoint_writer = BackgroundWriter()
        return self._checkpoint_writer

    def wait_for_checkpoint(self) -> Path | None:
        """Wait until a checkpoint written in the background is on disk; raise its write error, if it failed."""
        return self.checkpoint_writer.wait()

    def save(self, *, background: bool = False) -> Path | None:
        """Write a checkpoint of the current step (atomically; keeps the newest ``keep_checkpoints``).

        Every rank must call this. One process and DDP: rank 0 writes the whole tensors, with every rank's RNG states
        (gathered); with `background` it copies them and writes the copies on the writer's thread while the steps go
        on (`checkpoint_writer`), after waiting for the write before it. ``--fsdp``: every rank writes its own shards
        (`_save_sharded`), with `background` likewise from a copy in host memory on each rank's writer thread.
        Returns the checkpoint's directory (None on the other ranks); a
        background write puts it there later (`wait_for_checkpoint`).
        """
        self.wait_for_checkpoint()  # one write at a time, and a failed one raises here
        names = [name for name, p in self.policy.named_parameters() if p.requires_grad]
        rng = None if self.fsdp else distributed.gather_objects(rng_state())  # under --fsdp each rank writes its own
        if not self.world.is_main and not self.fsdp:
            return None
        state = {
            "config": self.config.flat(),
            "weighting": self.weighting.state_dict(),
            "collector": self.collector.state_dict(),
            "elapsed": self.elapsed,
            "ranks": self.world.size,
        }
        learner_tensors, learner_state = self.learner.state_dict()
        if learner_state:
            state["learner"] = learner_state
        state["metrics"] = self._unsaved_metrics  # durable with the checkpoint, whatever happens to metrics.jsonl
        if self.fsdp:
            path = self._save_sharded(names, state, learner_tensors, background)
        else:
            weights = distributed.full_state_dict(self.policy, names)
            if self.average is not None:
                weights = {name: t.detach().clone() for name, t in weights.items()}  # the live tensors
                with self.averaged_weights():
                    average = distributed.full_state_dict(self.policy, names)
                    weights.update({_AVERAGE_PREFIX + name: t.detach().clone() for name, t in average.items()})
            weights.update({_LEARNER_PREFIX + name: t for name, t in learner_tensors.items()})
            write = snapshot_checkpoint(
                self.checkpoint_dir,
                self.step,
                weights=weights,
                optimizer=self.optimizer.state_dict(),
                state=state,
                keep=self.config.run.keep_checkpoints,
                rng=rng,
            )
            if background:
                self.checkpoint_writer.submit(write)
                path = self.checkpoint_dir / step_dir_name(self.step)
            else:
                path = write()
        self._unsaved_metrics = []
        return path if self.world.is_main else None

    def _save_sharded(
        self, names: list[str], state: dict[str, Any], learner_tensors: dict[str, torch.Tensor], background: bool
    ) -> Path:
        """``--fsdp``: every rank writes its own shards of the weights, the AdamW state and the weight average with
        torch.distributed.checkpoint, and its RNG states; rank 0 the JSON `state`, with the optimizer's parameter
        groups (`algos.checkpoints.sharded.save_sharded_checkpoint`). Nothing is gathered. With `background`, each
        rank copies its shards to host memory and writes them on its writer thread beside the next steps
        (`algos.checkpoints.sharded.snapshot_sharded_checkpoint`), the write's collectives on a gloo group of their
        own (`checkpoint_group`)."""
        optimizer = distributed.sharded_optimizer_state(self.policy, self.optimizer)
        tensors: dict[str, Any] = {
            "model": distributed.sharded_model_state(self.policy, names),
            "optimizer": optimizer["state"],
        }
        if self.average is not None:
            tensors["average"] = dict(zip(names, self.average, strict=True))
        if learner_tensors:  # replicated on every rank: written once
            tensors["learner"] = dict(learner_tensors)
        state = {**state, "optimizer_groups": optimizer["param_groups"]}
        keep = self.config.run.keep_checkpoints
        if not background:
            return save_sharded_checkpoint(self.checkpoint_dir, self.step, tensors=tensors, state=state, keep=keep)
        write = snapshot_sharded_checkpoint(
            self.checkpoint_dir, self.step, tensors=tensors, state=state, keep=keep, group=self.checkpoint_group
        )
        self.checkpoint_writer.submit(write)
        return self.checkpoint_dir / step_dir_name(self.step)

    @property
    def checkpoint_group(self) -> Any:
        """The gloo group the background writes of sharded checkpoints use (`distributed.side_group`), made at the
        first one (every rank makes it there: a collective); None without a process group."""
        if "_checkpoint_group" not in self.__dict__:
            self._checkpoint_group = side_group()
        return self._checkpoint_group

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
        self.elapsed = float(state.get("elapsed", 0.0))
        changed = changed_settings(state.get("config", {}), self.config)
        if changed:  # allowed by --resume-changed (`TrainingRun` refused it otherwise, before the model)
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
        self.learner.load_state_dict(learner_tensors, _learner_state(checkpoint.state))
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
        learner = {name: t.detach().clone() for name, t in self.learner.state_dict()[0].items()}
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
        self.learner.load_state_dict(tensors.get("learner", {}), _learner_state(state))
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
        if self.config.optim.weight_average is None:
            return None
        return [p.detach().clone() for p in self._averaged_parameters()]

    def update_average(self) -> None:
        """Fold the weights of the step just taken into the average (a no-op without one).

        The decay is min(weight_average, (1 + step) / (10 + step)): the first steps, whose weights are far from
        what the run ends with, weigh little in the end (the starting weights ~0.2% of it after 60 steps at 0.9).
        """
        if self.average is None:
            return
        decay = min(float(self.config.optim.weight_average), (1 + self.step) / (10 + self.step))
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
        are (the final model's selection, `algos.run.evaluation.select_checkpoint`)."""
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


def _learner_state(state: dict[str, Any]) -> dict[str, Any]:
    """The learner's JSON state of a checkpoint's `state`; a checkpoint written before the GRPO learner kept its tie
    probe's flag itself holds it at the top level, from where it joins the learner's."""
    learner = dict(state.get("learner", {}))
    if "last_step_tied" in state:
        learner.setdefault("last_step_tied", state["last_step_tied"])
    return learner


def _copy_each(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for each i (no gradient), tensor by tensor so that DTensor shards work too."""
    with torch.no_grad():
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
