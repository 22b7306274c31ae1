"""Data-parallel training on torch.distributed: ranks, sharding, reductions and the gradient all-reduce.

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), every trainer runs
as N data-parallel ranks; without those variables (or with WORLD_SIZE=1) it is one process and every function
here is a no-op:

    torchrun --nproc-per-node 2 -m algos.red_grpo --preset tiny --run-dir runs/dp2

What each rank does in one step, and why the result equals one process's step on the same global batch:

- Rollouts: every rank advances the data order by the whole batch and plays its contiguous share of the
  step's questions (`agents.collector.shard_range`), whole GRPO groups, so group advantages need no
  communication. Sampling is seeded per episode (turn seed, group id, place in the group), never per rank
  or batch position, so the ranks sample what one process would.
- SFT: the step's minibatch is drawn from (seed, step) as in one process; each rank takes its share.
- Losses: the policy-gradient and SFT losses are token means over the *global* batch. Each rank divides its
  sum over its own tokens by the global token count (`all_sum` of the per-rank counts, before any
  backward pass), so the sum of the ranks' gradients is exactly the one-process gradient; the gradient
  all-reduce therefore sums (it does not average, as DDP's default hook would).
- Gradients: `DistributedDataParallel` over the policy with a summing comm hook. A rank runs its own number
  of micro-batches (token-budget micro-batching over different rollouts), which DDP's per-backward
  all-reduce cannot match up across ranks, so those passes call the unwrapped model and accumulate locally,
  and one closing pass through the DDP wrapper (two tokens, zero loss; `sync_gradients`) all-reduces the
  accumulated gradients: DDP's gradient accumulation with ``no_sync``, every rank doing exactly one
  synchronized backward per optimizer step. Trainable tensors outside the policy (a value head, a critic)
  are summed with one all-reduce each.
- Statistics: episode statistics (rewards, F1, the tie test, RED's batch accuracy) are computed from every
  rank's episodes (`gather_episodes`); token statistics (RL entropy, SFT entropy, losses) from summed
  numerators and denominators. RED's weight is therefore the same on every rank. Timings are rank 0's, and
  so is the clock of a training-time budget (`algos.run.TrainingRun.steps`): every rank stops after the same
  step.
- Files: rank 0 alone writes metrics.jsonl, wandb, checkpoints, the final model and the evaluation files
  (`World.is_main`); every rank reads the checkpoint on ``--resume`` (a shared file system on several nodes).
- Caches (indexes, the converted model, SFT data): rank 0 builds them first, the others load (`main_first`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "World",
    "all_sum",
    "barrier",
    "broadcast_object",
    "gather_episodes",
    "gather_objects",
    "init",
    "main_first",
    "mean_over_ranks",
    "shard",
    "shutdown",
    "sum_over_ranks",
    "sync_gradients",
    "token_mean",
    "wrap_ddp",
]


_created = False
"""Whether `init` created the process group (and `shutdown` therefore ends it)."""


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    """Global rank (0 writes the files)."""
    size: int = 1
    """Number of ranks."""
    local_rank: int = 0
    """Rank on this node (picks the GPU)."""

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that writes metrics, checkpoints and the final model."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """Whether there is more than one rank."""
        return self.size > 1


def init(device: str) -> tuple[World, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment (no-op for one process).

    gloo on CPU, NCCL on CUDA (each rank on GPU ``LOCAL_RANK``).

    Args:
        device: the configured device ("cpu", "cuda", "cuda:0", ...).

    Returns:
        The world and this rank's device.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 and not dist.is_initialized():
        return World(), torch.device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        global _created
        dist.init_process_group("nccl" if cuda else "gloo")
        _created = True
    world = World(dist.get_rank(), dist.get_world_size(), local_rank)
    return world, torch.device("cuda", local_rank) if cuda else torch.device(device)


def shutdown() -> None:
    """Leave the process group if `init` created it (a group the caller made is the caller's to end)."""
    global _created
    if _created and dist.is_initialized():
        dist.destroy_process_group()
    _created = False


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait for every rank."""
    if _active():
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (building any on-disk cache), then the other ranks (loading it)."""
    rank = dist.get_rank() if _active() else 0
    if rank != 0:
        barrier()
    try:
        yield
    finally:
        if rank == 0:
            barrier()


def shard(items: Sequence[Any], world: World) -> list[Any]:
    """This rank's contiguous share of `items` (shares differ in size by at most one)."""
    n = len(items)
    return list(items[n * world.rank // world.size : n * (world.rank + 1) // world.size])


def all_sum(*values: float) -> list[float]:
    """Each value summed over the ranks (float64 on the wire: counts stay exact)."""
    if not _active():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """`values` summed key by key over the ranks (a rank that ran no micro-batch may lack some keys)."""
    if not _active():
        return values
    out: dict[str, float] = {}
    for part in gather_objects(values):
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """`values` averaged key by key over the ranks (the same keys on every rank)."""
    if not _active():
        return values
    return {key: value / dist.get_world_size() for key, value in sum_over_ranks(values).items()}


def token_mean(mean: float, tokens: float) -> float:
    """The mean over every rank's tokens, from this rank's `mean` over its own `tokens`."""
    if not _active():
        return mean
    total, count = all_sum(mean * tokens, tokens)
    return total / max(count, 1.0)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (any picklable object), in rank order."""
    if not _active():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not _active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_episodes(trajectories: Sequence[Any]) -> list[Any]:
    """Every rank's trajectories in global batch order, without their generations (statistics need rewards,
    group ids and infos only; the token ids stay on their rank)."""
    if not _active():
        return list(trajectories)
    light = [dataclasses.replace(t, generations=()) for t in trajectories]
    return [t for part in gather_objects(light) for t in part]


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sum_hook(_state, bucket):  # noqa: ANN001, ANN202  (DDP checks real annotations; this module's are strings)
    """DDP comm hook: sum a `dist.GradBucket` over the ranks (the losses are already divided by the global token
    count); returns a future of the summed buffer."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
    """The policy in `DistributedDataParallel` with a summing all-reduce (None for one process).

    Module buffers are not broadcast on each forward (ranks run different numbers of forward passes; the
    buffers are constants such as rotary frequencies).
    """
    if not _active():
        return None
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, **_no_buffer_sync())
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def sync_gradients(
    ddp: torch.nn.Module | None, others: Sequence[torch.nn.Parameter] = (), pad_token_id: int = 0
) -> None:
    """Sum the locally accumulated gradients over the ranks (after every micro-batch's backward pass).

    The micro-batches ran on the unwrapped model, so DDP did not synchronize them; one closing forward and
    backward through the wrapper (two pad tokens, loss multiplied by 0, so it adds exact zeros) makes DDP
    all-reduce each parameter's accumulated ``.grad``. `others` (trainable tensors outside the policy) are
    summed directly.
    """
    if ddp is None:
        return
    device = next(ddp.parameters()).device
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long, device=device)
    out = ddp(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    (out.logits.float().sum() * 0.0).backward()
    for p in others:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's argument that turns off the buffer broadcast on each forward (renamed in recent torch)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
