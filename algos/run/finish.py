"""The end of a training run: the final model in Hugging Face format, what is published with it, the summary.

`RunFinish` is a base of `training_run.TrainingRun`; its methods use the run's attributes (``config``, ``policy``,
``tokenizer``, ``world``, ``step``, ...). ``final/`` is written atomically by rank 0 (LoRA merged in; under
``--fsdp`` the whole weights are gathered first); `RunFinish.publish` adds the model card with the held-out
table, the run config, the end-of-run wandb tables and the ``--push-to-hub`` upload (`algos.run.outputs`);
`print_summary` prints the summary that `algos.run.training_run.TrainingRun.train` returns.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from algos import distributed
from algos.checkpoints.atomic import writing
from algos.run import outputs
from algos.run.evaluation import run_provenance

logger = logging.getLogger(__name__)

__all__ = ["RunFinish", "print_summary"]


class RunFinish:
    """The final model, its publication and the summary of a `training_run.TrainingRun` (a base class of it).

    What it reads of the run, which `TrainingRun` sets up before training, is declared below.
    """

    config: Any
    policy: Any  # the trained model (a PEFT wrapper's base under --lora)
    peft_model: Any | None
    tokenizer: Any
    world: Any  # algos.distributed.World
    fsdp: bool
    step: int
    started: float  # the process's start (time.perf_counter)
    elapsed: float
    stopped_early: bool
    metrics_path: Path
    run_dir: Path
    _wandb: Any | None

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
        record: dict[str, Any] | None = None,
    ) -> None:
        """Rank 0, at the end: final/'s card with the held-out table, the run config beside metrics.jsonl, the
        end-of-run wandb tables and images, and the upload to ``--push-to-hub``. `record`: the summary's provenance
        (computed once: it hashes the weights); None computes it."""
        record = record if record is not None else run_provenance(self.config, final)
        outputs.describe_final_model(final, self.config, self.step, evaluation, validation, record)
        outputs.write_run_config(self.config, self.run_dir)
        outputs.write_provenance(record, self.run_dir)
        if self._wandb is not None:
            import wandb

            payload = outputs.wandb_outputs(wandb, evaluation, validation, curves)
            if payload:
                self._wandb.log(payload, step=self.step)
        if self.config.run.push_to_hub:
            try:
                url = outputs.push_to_hub(
                    final, self.config.run.push_to_hub, f"{self.config.run.name}: {self.step} steps"
                )
            except Exception as err:  # the run's outputs are on disk already: a failed upload must not lose them
                logger.error(
                    "upload to %s failed (%s); retry with: hf upload %s %s",
                    self.config.run.push_to_hub,
                    err,
                    self.config.run.push_to_hub,
                    final,
                )
            else:
                logger.info("uploaded %s to the Hugging Face Hub: %s", final, url)

    def summary(self, checkpoint: Path, final: Path) -> dict[str, Any]:
        """Steps, wall time, first vs last steps' reward and F1 (from metrics.jsonl), where things are, and the run's
        provenance (`evaluation.run_provenance`: command, code, packages, machine, seed, data and weight hashes)."""
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        k = max(1, min(10, len(rows) // 4))
        first, last = rows[:k], rows[-k:]
        return {
            "run": self.config.run.name,
            "algo": self.config.run.algo,
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
            "run_dir": str(self.run_dir),
            "provenance": run_provenance(self.config, final),
        }


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
        table.add_row("learning curves (per step, 10-step mean, held-out scores)", summary["curves"])
    console = Console()
    if not console.is_terminal:  # a log file: the table at its natural width, not wrapped at 80 columns
        console = Console(width=10_000)
    console.print(table)
    if "evaluation" in summary:
        console.print(summary["evaluation"]["table"], markup=False, highlight=False)
    if "run_dir" in summary:
        console.print("\n".join(next_commands(summary)), markup=False, highlight=False)


def next_commands(summary: dict[str, Any]) -> list[str]:
    """What to look at and run after a run: its pictures, scoring it again in its own env, and uploading a wandb run
    that was logged offline."""
    run_dir = Path(summary["run_dir"])
    lines = ["", "Next:"]
    if "curves" in summary:
        lines.append(f"  look at the learning curves: {summary['curves']}")
    lines.append(f"  score it again in its own env: python -m benchmarks.evaluate --run-dir {run_dir}")
    if "evaluation" in summary:
        lines.append(f"  reading or searching: python -m benchmarks.first_search {run_dir / 'eval.json'}")
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    if offline:  # logged without a wandb login: the run is on disk until synced
        lines.append(f"  upload the offline wandb run: wandb sync {offline[-1]}")
    return lines


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0
