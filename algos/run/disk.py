"""What a training run writes to its run directory, counted at start against the free space there.

`plan` adds up the bytes on disk at the run's fullest moment: its checkpoints (each the trainable weights, AdamW's two
moments in the weights' dtype, the weight average where there is one; as many as ``--keep-checkpoints`` keeps, plus
the one being written, since the oldest goes only once the new one is whole), the final model (every weight, in the
weights' dtype, with its tokenizer), the metrics rows and the held-out evaluation's outputs. A resumed run's
checkpoints already on disk count as written. `check` compares that with the free space (`free_bytes`) and refuses
in one line, with the numbers and the settings that shrink it, or warns when less than one checkpoint is left to
spare. The trainer runs it beside the memory check (``--no-memory-check`` skips both).

    python -m algos.run.disk --model Qwen/Qwen2.5-3B-Instruct --preset gpu --run-dir runs/big
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from algos.run.memory import GIB, DoesNotFit

logger = logging.getLogger(__name__)

__all__ = ["DiskDoesNotFit", "DiskPlan", "check", "check_run", "free_bytes", "plan", "present_bytes"]

STATE_BYTES = 1 << 20
"""A checkpoint's files besides its tensors (state.json with the metrics rows, the manifest, RNG states), at most."""
TOKENIZER_BYTES = 32 << 20
"""The final model's files besides its weights (tokenizer, config, model card), at most."""
METRICS_ROW_BYTES = 16 << 10
"""One step's metrics row in metrics.jsonl and in wandb's offline copy, at most."""
TRANSCRIPT_BYTES_PER_TOKEN = 8
"""eval.json's bytes per context token of an episode's transcript (text and its JSON escapes), at most."""


class DiskDoesNotFit(DoesNotFit):
    """A run that would write more than its run directory's disk holds; the message says what would shrink it."""


@dataclass(frozen=True)
class DiskPlan:
    """Bytes a run writes, by part, at its fullest moment on disk."""

    checkpoint: float
    """One checkpoint."""
    checkpoints: int
    """Checkpoints on disk at once at most."""
    final_model: float
    outputs: float
    """Metrics rows and the held-out evaluation's outputs."""
    present: float = 0.0
    """Bytes of the checkpoints already on disk (a resumed run's), which count as written."""

    @property
    def total(self) -> float:
        """Bytes still to be written at the fullest moment."""
        return max(0.0, self.checkpoint * self.checkpoints - self.present) + self.final_model + self.outputs

    def describe(self) -> str:
        present = f", {_size(self.present)} of them on disk already" if self.present else ""
        return (
            f"{_size(self.total)} ({self.checkpoints} checkpoint(s) of {_size(self.checkpoint)}{present}, "
            f"final model {_size(self.final_model)}, metrics and evaluation {_size(self.outputs)})"
        )


def _size(count: float) -> str:
    """Bytes in GiB, or in MiB below one GiB (a tiny run's)."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / (1 << 20):.1f} MiB"


def _checkpoints_written(config: Any) -> int:
    """Checkpoints a run of `config` writes: every ``save_every`` steps before the last, and the final one."""
    every = int(config.run.save_every)
    steps = int(config.optim.steps)
    return (len(range(every, steps, every)) if every > 0 else 0) + 1


def plan(config: Any, *, parameters: int, trainable: int, present: tuple[int, float] = (0, 0.0)) -> DiskPlan:
    """The bytes a run of `config` (an `algos.config.Config`) writes on a model of `parameters` weights, `trainable`
    of which train; `present`: the checkpoints already on disk, as (count, bytes)."""
    param_bytes = 2 if config.model.param_dtype == "bfloat16" else 4
    copies = 3 + (1 if config.optim.weight_average is not None else 0)  # weights, AdamW's moments, the average
    checkpoint = trainable * param_bytes * copies + STATE_BYTES
    on_disk = min(present[0] + _checkpoints_written(config), max(1, int(config.run.keep_checkpoints)) + 1)
    episodes = 2 * max(int(config.run.eval_questions or 0), int(config.run.validation_questions or 0))
    outputs = config.optim.steps * METRICS_ROW_BYTES
    outputs += episodes * config.model.max_context_tokens * TRANSCRIPT_BYTES_PER_TOKEN
    return DiskPlan(checkpoint, on_disk, parameters * param_bytes + TOKENIZER_BYTES, outputs, present[1])


def free_bytes(path: str | Path) -> float:
    """Free bytes on the file system of `path`, or of its nearest existing parent (a run directory not made yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return float(shutil.disk_usage(path).free)


def present_bytes(checkpoint_dir: str | Path) -> tuple[int, float]:
    """The checkpoints under `checkpoint_dir` (a resumed run's), as (count, bytes)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return 0, 0.0
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")]
    return len(dirs), float(sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file()))


def check(found: DiskPlan, free: float, config: Any, where: str | Path) -> str | None:
    """Raise `DiskDoesNotFit` when `found` exceeds `free` bytes; return a warning line when less than one checkpoint
    would be left to spare, else None."""
    if found.total <= free:
        if free - found.total < found.checkpoint:
            return (
                f"disk: the run writes {found.describe()} into {where}, which has {_size(free)} free: less than "
                "one checkpoint to spare, so anything else written there stops the run at its next checkpoint"
            )
        return None
    hints = []
    room = free - found.final_model - found.outputs + found.present
    keep = int(room // found.checkpoint) - 1  # the one being written comes on top of those kept
    if 1 <= keep < int(config.run.keep_checkpoints):
        hints.append(f"--keep-checkpoints {keep}")
    if config.run.save_every and found.checkpoint + found.final_model + found.outputs - found.present <= free:
        hints.append("--save-every 0 (the final checkpoint alone)")
    if config.model.param_dtype != "bfloat16":
        hints.append("--param-dtype bfloat16 (weights and AdamW state at half the bytes)")
    if not config.model.lora:
        hints.append("--lora (a checkpoint holds the adapter)")
    hints.append("a --run-dir on a larger disk")
    raise DiskDoesNotFit(
        f"the run writes {found.describe()} into {where}, which has {_size(free)} free: try "
        f"{', '.join(hints)} (or --no-memory-check to start anyway)"
    )


def check_run(config: Any, *, parameters: int, trainable: int, is_main: bool) -> None:
    """The trainer's start-of-run check: rank 0 logs the plan (or a warning) against its run directory's free space;
    a refusal reaches every rank (data parallel: one rank refusing alone would leave the others waiting).

    Raises:
        DiskDoesNotFit: on every rank, when rank 0's run directory has no room for what the run writes.
    """
    from algos import distributed

    problem = None
    if is_main:
        present = present_bytes(config.run.output_dir / "checkpoints")
        found = plan(config, parameters=parameters, trainable=trainable, present=present)
        try:
            warning = check(found, free_bytes(config.run.output_dir), config, config.run.output_dir)
        except DiskDoesNotFit as err:
            problem = str(err)
        else:
            if warning is None:
                free = _size(free_bytes(config.run.output_dir))
                logger.info("disk: the run writes at most %s; %s free there", found.describe(), free)
            else:
                logger.warning(warning)
    problem = distributed.broadcast_object(problem)
    if problem is not None:
        raise DiskDoesNotFit(problem)


def main(argv: Sequence[str] | None = None) -> DiskPlan:
    """Print what a run writes against its run directory's free space, without loading weights."""
    from transformers import AutoConfig

    from algos.run.cli import parse_config
    from algos.run.memory import count_parameters

    config = parse_config(argv, algo="red_grpo", description="What a run writes to disk, against the free space.")
    source = config.model.model
    if source is None or source == "tiny":
        from agents.models import ensure_smollm2_cache

        source = str(ensure_smollm2_cache())
    parameters = count_parameters(AutoConfig.from_pretrained(source))
    found = plan(config, parameters=parameters, trainable=parameters)
    free = free_bytes(config.run.output_dir)
    print(f"{source}: {found.describe()}; {_size(free)} free at {config.run.output_dir}")
    return found


if __name__ == "__main__":
    main()
