"""The tiny-preset runs that tests/test_distributed.py and tests/test_sharded_checkpoint.py play in one process
and under torchrun in two.

    torchrun --nproc-per-node 2 tests/distributed_runs.py OUT_DIR           # `RUNS`, in OUT_DIR/<name>
    torchrun --nproc-per-node 2 tests/distributed_runs.py OUT_DIR sharded   # `SHARDED_RUNS`

Each run is a function of its run directory, so the test plays the same function in its own process for the
one-process reference. GRPO's runs replace the tiny random model's rewards (all -3: every advantage would be
0) by a deterministic function of each episode's first action, so the policy gradient is not zero. The
``*_fsdp`` runs shard the model over the two ranks (``--fsdp``); in one process they are the plain runs.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from algos import distributed
from algos.checkpoints.files import rng_state
from algos.config import preset_config
from algos.learners.ppo import PPO_DEFAULTS, PPO_PRESETS, PPOConfig, PPOTrainer
from algos.learners.trainer import Trainer
from algos.run.training_run import TrainingRun

LR = 1e-4
"""AdamW's learning rate: each weight moves by up to about this much per step."""
AVERAGE = 0.5
"""The red_grpo runs end with a weight average (--weight-average) of this decay: the ranks must average alike."""
ADAM_EPS = 1e-6
"""AdamW's eps, over its 1e-8 default. The ranks sum their micro-batches in another order (and with other
padding) than one process, so a gradient component differs by float32 rounding, ~1e-8 where large terms
cancel; at eps 1e-8 Adam's g / (|g| + eps) turns such a component's noise into a full +-lr step, at 1e-6
into at most ~1e-2 lr: far below the 1e-5 tolerance, while real gradients still move weights by ~lr."""


class SmallEpsRun(TrainingRun):
    """A run with AdamW's eps at `ADAM_EPS` (every run here), training `learner` (None: its algorithm's)."""

    def __init__(self, config: Any, learner: type[Trainer] | None = None) -> None:
        super().__init__(config, learner=learner)
        for group in self.optimizer.param_groups:
            group["eps"] = ADAM_EPS


def _varied(trajectories: Sequence[Any]) -> list[Any]:
    return [dataclasses.replace(t, reward=float(len(t.actions[0]) % 4)) for t in trajectories]


class VaryingRewards(Trainer):
    """GRPO on rewards that differ within a group (first action's length mod 4), so GRPO's advantages are not all 0."""

    def make_batch(self, trajectories: Sequence[Any]) -> Any:
        return super().make_batch(_varied(trajectories))


class VaryingRewardsPPO(PPOTrainer):
    """PPO on the same varied rewards. With the tiny model's equal rewards the first step's advantages would be
    float noise (a KL of ~1e-8 between the sampler's and the reference's log-probs of the same weights) that
    whitening scales up to unit variance, so its result would hang on the summation order."""

    def make_batch(self, trajectories: Sequence[Any]) -> Any:
        return super().make_batch(_varied(trajectories))


class RankDrawing(VaryingRewards):
    """`VaryingRewards` whose ranks draw a different amount from the global RNGs (torch, Python, NumPy) each step, as
    dropout over each rank's own micro-batches would, so the ranks' streams part."""

    def train_step(self) -> dict[str, float]:
        draws = 1 + self.run.world.rank
        torch.rand(draws)
        np.random.rand(draws)
        for _ in range(draws):
            random.random()
        return super().train_step()


class RankDraws(SmallEpsRun):
    """A run of `RankDrawing`. Each rank's RNG states are recorded where a checkpoint takes them and right after a
    resume, in ``<run_dir>_rng/<when>_rank<r>.pt``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, learner=RankDrawing)

    def save(self, *, background: bool = False) -> Path | None:
        self._record(f"saved_step{self.step}")
        return super().save(background=background)

    def load(self, path: Any) -> list[dict[str, Any]]:
        restored = super().load(path)
        self._record(f"resumed_step{self.step}")
        return restored

    def _record(self, when: str) -> None:
        out = self.run_dir.with_name(self.run_dir.name + "_rng")
        out.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), out / f"{when}_rank{self.world.rank}.pt")


class SearchFirst:
    """Wraps a sampler: a flat context that holds no search results yet gets a search call after the model's own
    sampled text, so episodes of the tiny random model search once and can branch there (`agents.tree`)."""

    def __init__(self, inner: Any, query: str = "Ed Wood") -> None:
        self.inner, self.call = inner, f"<search>{query}</search>"

    def __getattr__(self, name: str) -> Any:  # tokenizer, max_context, release, ...
        return getattr(self.inner, name)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
        from agents.records import Completion
        from envs.protocol import FLAT_INSTRUCTIONS

        out = []
        for prompt, done in zip(prompts, self.inner.generate(prompts, params), strict=True):
            seen = self.tokenizer.decode(prompt).count("<information>") - FLAT_INSTRUCTIONS.count("<information>")
            if seen or done.finish_reason == "error":
                out.append(done)
                continue
            ids = tuple(self.tokenizer(self.call, add_special_tokens=False)["input_ids"])
            out.append(
                Completion(done.text + self.call, done.token_ids + ids, done.logprobs + (0.0,) * len(ids), "stop")
            )
        return out


def _varied_last(trajectories: Sequence[Any]) -> list[Any]:
    return [dataclasses.replace(t, reward=float(len(t.actions[-1]) % 4)) for t in trajectories]


class TreeRewards(Trainer):
    """Tree rollouts whose episodes search first (`SearchFirst`) and whose rewards differ by the last action's length
    mod 4: the branches of a tree share their first turn and part after it, so the within-tree advantages are not 0."""

    def __init__(self, run: TrainingRun) -> None:
        super().__init__(run)
        agent = run.agent
        agent.sampler = agent.executor_sampler = SearchFirst(agent.sampler)

    def make_batch(self, trajectories: Sequence[Any]) -> Any:
        return super().make_batch(_varied_last(trajectories))


def _train(run: TrainingRun) -> None:
    try:
        run.train()
    finally:
        run.close()


def sft(run_dir: Path, fsdp: bool = False) -> None:
    """SFT alone, 2 steps, then the held-out evaluation (split over the ranks)."""
    config = preset_config("tiny", algo="sft", run_dir=str(run_dir), lr=LR, eval_questions=4, fsdp=fsdp)
    _train(SmallEpsRun(config))


def grpo(run_dir: Path, fsdp: bool = False) -> None:
    """GRPO with a fixed SFT term (so each term's gradient norm is logged), 2 steps."""
    config = preset_config("tiny", algo="grpo_sft", run_dir=str(run_dir), lr=LR, eval_questions=0, fsdp=fsdp)
    _train(SmallEpsRun(config, learner=VaryingRewards))


def grpo_tree(run_dir: Path) -> None:
    """GRPO on tree rollouts (``--rollout tree``: 2 trees of 2 episodes per question), 2 steps."""
    config = preset_config(
        "tiny", algo="grpo", run_dir=str(run_dir), lr=LR, eval_questions=0, rollout="tree", group_size=4
    )
    _train(SmallEpsRun(config, learner=TreeRewards))


def ppo(run_dir: Path, fsdp: bool = False) -> None:
    """PPO (its tiny preset: the query-rewrite env, 4 questions, 2 epochs per step, KL to the start), 2 steps."""
    settings = {**PPO_DEFAULTS, **PPO_PRESETS["tiny"], "algo": "ppo", "lr": LR, "value_lr": LR, "fsdp": fsdp}
    _train(SmallEpsRun(preset_config("tiny", PPOConfig, run_dir=str(run_dir), **settings), learner=VaryingRewardsPPO))


def sft_fsdp(run_dir: Path) -> None:
    """`sft` with the model sharded (``--fsdp``)."""
    sft(run_dir, fsdp=True)


def grpo_fsdp(run_dir: Path) -> None:
    """`grpo` with the model sharded (``--fsdp``)."""
    grpo(run_dir, fsdp=True)


def ppo_fsdp(run_dir: Path) -> None:
    """`ppo` with the model sharded (``--fsdp``)."""
    ppo(run_dir, fsdp=True)


def red_grpo_config(run_dir: Path, **overrides: Any) -> Any:
    """The red_grpo runs' settings (the tiny preset, a weight average), with `overrides`."""
    return preset_config(
        "tiny", algo="red_grpo", run_dir=str(run_dir), lr=LR, eval_questions=0, weight_average=AVERAGE, **overrides
    )


def red_grpo(run_dir: Path) -> None:
    """GRPO + RED, 2 steps, its final model the weight average (``--weight-average``)."""
    _train(RankDraws(red_grpo_config(run_dir)))


def red_grpo_resumed(run_dir: Path) -> None:
    """GRPO + RED: 1 step, stop, then --resume to step 2 (the weight average resumes too)."""
    config = red_grpo_config(run_dir)
    _train(RankDraws(config.with_values(steps=1)))
    _train(RankDraws(config.with_values(resume=True)))


def red_grpo_step1(run_dir: Path) -> None:
    """GRPO + RED stopped after step 1 (of 2): a checkpoint to resume elsewhere."""
    _train(RankDraws(red_grpo_config(run_dir, steps=1)))


def red_grpo_fsdp(run_dir: Path) -> None:
    """`red_grpo` with the model sharded (``--fsdp``): 2 steps without a stop, each checkpoint sharded. Then the
    weights of step 1's checkpoint are read back as the final model's selection does (each rank its shards), and
    written whole to ``<run_dir>_step1_reloaded.safetensors``."""
    run = RankDraws(red_grpo_config(run_dir, fsdp=True))
    try:
        run.train()
        run.load_weights(run_dir / "checkpoints" / "step_000001")
        names = [name for name, p in run.policy.named_parameters() if p.requires_grad]
        weights = distributed.full_state_dict(run.policy, names)  # a collective: rank 0 gets them
        if run.world.is_main:
            save_file(weights, run_dir.with_name(run_dir.name + "_step1_reloaded.safetensors"))
    finally:
        run.close()


def red_grpo_fsdp_resumed(run_dir: Path) -> None:
    """`red_grpo_resumed` with the model sharded (``--fsdp``); the run directory after step 1 is kept as
    ``<run_dir>_step1``, for a resume by another number of processes."""
    config = red_grpo_config(run_dir, fsdp=True)
    _train(RankDraws(config.with_values(steps=1)))
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(run_dir, run_dir.with_name(run_dir.name + "_step1"))
    dist.barrier()
    _train(RankDraws(config.with_values(resume=True)))


def red_grpo_plain_to_fsdp(run_dir: Path) -> None:
    """--resume under ``--fsdp`` of the whole-tensor checkpoint one process left in `run_dir` after step 1
    (`red_grpo_step1`, run by the test beforehand), to step 2."""
    _train(RankDraws(red_grpo_config(run_dir, fsdp=True, resume=True)))


RUNS = {
    "sft": sft,
    "grpo": grpo,
    "grpo_tree": grpo_tree,
    "ppo": ppo,
    "red_grpo_resumed": red_grpo_resumed,
    "sft_fsdp": sft_fsdp,
    "grpo_fsdp": grpo_fsdp,
    "ppo_fsdp": ppo_fsdp,
}
"""What the two-process launch plays for tests/test_distributed.py (red_grpo is the one-process reference of
red_grpo_resumed)."""

SHARDED_RUNS = {
    "red_grpo_fsdp": red_grpo_fsdp,
    "red_grpo_fsdp_resumed": red_grpo_fsdp_resumed,
    "red_grpo_plain_to_fsdp": red_grpo_plain_to_fsdp,
}
"""What the two-process launch plays for tests/test_sharded_checkpoint.py."""


def checkpoint_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, Any]]]:
    """A checkpoint's tensors under one process's names, whatever its layout: the weights as weights.safetensors
    names them (``average/`` and ``learner/`` prefixes) and the optimizer state by parameter index.

    A sharded checkpoint is read whole by torch's own converter (``dcp_to_torch_save``), not by the code under test;
    its optimizer state is keyed by parameter name, put in index order by the saved parameter groups.
    """
    if not (path / "shards").is_dir():
        return load_file(path / "weights.safetensors"), torch.load(path / "optimizer.pt", weights_only=True)["state"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path / "shards", Path(tmp) / "whole.pt")
        whole = torch.load(Path(tmp) / "whole.pt", weights_only=True)
    parts = (("model", ""), ("average", "average/"), ("learner", "learner/"))
    weights = {prefix + name: t for part, prefix in parts for name, t in whole.get(part, {}).items()}
    groups = json.loads((path / "state.json").read_text())["optimizer_groups"]
    order = [name for group in groups for name in group["params"]]
    return weights, {i: whole["optimizer"][name] for i, name in enumerate(order)}


def main(out: Path, group: str = "") -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for every run (a run leaves a group it did not make)
    try:
        for name, run in (SHARDED_RUNS if group == "sharded" else RUNS).items():
            run(out / name)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
