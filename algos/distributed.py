"""Data-parallel training on torch.distributed: ranks, sharding, reductions and the gradient all-reduce.

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), every trainer runs
as N data-parallel ranks; without those variables (or with WORLD_SIZE=1) it is one process and every function
here is a no-op:

    torchrun --nproc-per-node 2 -m algos.red_grpo --preset tiny --run-dir runs/dp2

One step on N ranks equals one process's step on the same global batch (`World` says what each rank does and
why): each rank plays its share of the step's questions, the losses are token means over the global batch, and the
ranks' gradients are summed (`sync_gradients`). With ``--fsdp`` the policy is sharded instead of replicated
(`wrap_fsdp` says what changes in the step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "World",
    "all_max",
    "all_sum",
    "as_forward",
    "barrier",
    "broadcast_object",
    "clip_grad_norm_",
    "full_state_dict",
    "gather_episodes",
    "gather_objects",
    "gathered",
    "init",
    "load_full_state_dict",
    "load_sharded_model_state",
    "load_sharded_optimizer_state",
    "main_first",
    "matched_passes",
    "mean_over_ranks",
    "shard",
    "shard_optimizer_state",
    "sharded_model_state",
    "sharded_optimizer_state",
    "shutdown",
    "sum_gradients",
    "sum_over_ranks",
    "sync_gradients",
    "token_mean",
    "wrap_ddp",
    "wrap_fsdp",
    "zero_pass",
]


_created = False
"""Whether `init` created the process group (and `shutdown` therefore ends it)."""


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks.

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
    - Gradients: `DistributedDataParallel` over the policy with a summing comm hook (`wrap_ddp`). A rank runs its
      own number of micro-batches, which DDP's per-backward all-reduce cannot match up across ranks, so those passes
      call the unwrapped model and accumulate locally, and one closing pass through the DDP wrapper all-reduces the
      sums (`sync_gradients`: DDP's ``no_sync``, one synchronized backward per optimizer step). Trainable tensors
      outside the policy (a value head, a critic) are summed with one all-reduce each.
    - Statistics: episode statistics (rewards, F1, the tie test, RED's batch accuracy) are computed from every
      rank's episodes (`gather_episodes`); token statistics (RL entropy, SFT entropy, losses) from summed
      numerators and denominators. RED's weight is therefore the same on every rank. Timings are rank 0's, and so
      is the clock of a training-time budget (`TrainingRun.steps`): every rank stops after the same step.
    - Files: rank 0 alone writes metrics.jsonl, wandb, checkpoints, the final model and the evaluation files
      (`World.is_main`); every rank reads the checkpoint on ``--resume`` (a shared file system on several nodes),
      which holds every rank's RNG states (`algos.checkpoints.files`).
    - Caches (indexes, the converted model, SFT data): rank 0 builds them first, the others load (`main_first`).
    """

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


def init(device: str, timeout_seconds: float | None = None) -> tuple[World, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment (no-op for one process).

    gloo on CPU, NCCL on CUDA (each rank on GPU ``LOCAL_RANK``). `timeout_seconds` bounds every collective: a
    rank that waits longer than that for the others (one stopped, hung or dead) gets an error instead of waiting
    on. gloo raises it in the waiting call; NCCL's watchdog ends the process (its asynchronous error handling,
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, is on by default; set to 0 it would leave the timeout unenforced).

    Args:
        device: the configured device ("cpu", "cuda", "cuda:0", ...).
        timeout_seconds: how long a collective may wait for the other ranks; None: PyTorch's default (10 minutes
            for NCCL, 30 for gloo).

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
        timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
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


def all_max(value: int) -> int:
    """The largest `value` over the ranks."""
    if not _active():
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


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


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (any picklable object), in rank order; over `group` (None: the default group)."""
    if not _active():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def broadcast_object(value: Any, group: Any = None) -> Any:
    """Rank 0's `value` on every rank; over `group` (None: the default group)."""
    if not _active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_episodes(trajectories: Sequence[Any]) -> list[Any]:
    """Every rank's trajectories in global batch order, without their generations (statistics need rewards,
    group ids and infos only; the token ids stay on their rank)."""
    if not _active():
        return list(trajectories)
    light = [dataclasses.replace(t, generations=(), turns=()) for t in trajectories]
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
    backward through the wrapper (`zero_pass`) makes DDP all-reduce each parameter's accumulated ``.grad``.
    `others` (trainable tensors outside the policy) are summed directly.
    """
    if ddp is None:
        return
    zero_pass(ddp, pad_token_id)
    sum_gradients(others)


def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum each parameter's ``.grad`` over the ranks, one all-reduce each (a missing gradient counts as zeros)."""
    if not _active():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def zero_pass(model: torch.nn.Module, pad_token_id: int = 0) -> None:
    """One forward and backward pass that adds exact zeros to every gradient: two pad tokens, loss multiplied by 0.

    What a wrapper's collectives need when a rank has no real pass left: DDP's closing all-reduce
    (`sync_gradients`), FSDP2's all-gathers and reduce-scatters of a pass another rank runs (`matched_passes`).
    """
    device = next(model.parameters()).device
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    (out.logits.float().sum() * 0.0).backward()


# --- FSDP2 (--fsdp) ------------------------------------------------------------------------------------------


def wrap_fsdp(model: torch.nn.Module, device: torch.device) -> bool:
    """Shard `model` over the ranks in place with FSDP2: ``fully_shard`` on each decoder layer, then on the root.

    The decoder layers are the modules whose class Hugging Face lists in ``model._no_split_modules`` (what its own
    FSDP integration wraps). Gradients are summed over the ranks, not averaged (the losses are already divided by
    the global token count), with plain sum reductions; every parameter is reduce-scattered in every backward pass,
    zeros where unused, so the ranks' collectives always match. The mesh is a 1-D mesh of every rank on
    `device`'s type: ``cpu`` with gloo, ``cuda`` with NCCL. The optimizer must be built afterwards (its parameters
    become sharded DTensors).

    Each rank then holds 1/N of the weights, gradients and AdamW state; what changes in the step:

    - Every rank runs as many forward and backward passes as the busiest one (`matched_passes`), as each pass
      all-gathers the weights and reduce-scatters the gradients (plain sum reductions: gloo has no pre-multiplied
      sum).
    - Sampling and the no-grad passes before the update (old log-probs, PPO's values) run a different number of
      forward passes on each rank, so they run with the full weights held on every rank (`gathered`): one full copy
      of the weights per rank during the rollout, not a second model, as the sampler uses the same modules.
    - Functions that call the decoder and the LM head separately (the masked LM head, PPO's value head) run inside
      the root's forward hooks (`as_forward`).
    - Gradient clipping uses the global norm (`clip_grad_norm_`).
    - Checkpoints are sharded (`sharded_model_state`, `sharded_optimizer_state`, `algos.checkpoints.sharded`) and
      load with any number of ranks (`load_sharded_model_state`, `load_sharded_optimizer_state`); a whole-tensor
      checkpoint (one process, DDP) resumes under ``--fsdp`` too (`load_full_state_dict`, `shard_optimizer_state`),
      and a sharded one in one process or under DDP. The final model holds the whole weights, gathered once
      (`full_state_dict`) and written by rank 0.
    - The frozen reference model (``--kl-coef`` > 0) stays a full copy on every rank (no gradients or optimizer
      state, and it runs once per micro-batch, so its forward passes need no matching).

    Returns:
        Whether the model was sharded (False for one process: nothing to shard).

    Raises:
        ValueError: the model names no decoder layer class, or this torch's FSDP2 lacks what is used here.
    """
    if not _active():
        return False
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError as err:
        raise ValueError(
            f"--fsdp needs FSDP2, which torch {torch.__version__} lacks: upgrade torch (pip install -U torch), "
            "or train without --fsdp"
        ) from err
    needed = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params")
    missing = [name for name in needed if not hasattr(FSDPModule, name)]
    if missing or not hasattr(torch.nn.utils, "get_total_norm"):
        raise ValueError(
            f"--fsdp needs a newer FSDP2 than torch {torch.__version__} has ({', '.join(missing) or 'get_total_norm'} "
            "missing): upgrade torch (pip install -U torch), or train without --fsdp"
        )
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules), so it cannot be "
            "sharded layer by layer; train it without --fsdp"
        )
    with torch.no_grad():  # as DDP does: every shard comes from rank 0's weights, whatever each rank built
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True, recurse=False)
    model.run_as_forward = _call  # see as_forward
    register_fsdp_forward_method(model, "run_as_forward")
    return True


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def as_forward(model: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run as a forward pass of `model`: a plain call, unless `model` is sharded by
    `wrap_fsdp`, where it runs inside the root's forward hooks.

    FSDP2 gathers a module's own weights in hooks around its ``forward``. A function that calls the decoder and
    the LM head apart (`algos.batch.masked_token_logprobs`, `algos.learners.value.logprobs_and_values`) bypasses the
    root's ``forward``, so without this the root's weights (embeddings, final norm, LM head) would stay sharded.
    """
    run = getattr(model, "run_as_forward", None)
    return fn(*args, **kwargs) if run is None else run(fn, *args, **kwargs)


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Hold every weight of a `wrap_fsdp` model, unsharded, on every rank for the block (no-op for another model).

    On entry every FSDP unit all-gathers its weights (every rank enters at the same point, so the collectives
    match); inside, forward passes communicate nothing, so each rank may run as many as it needs (sampling, no-grad
    scoring); on exit the gathered copies are freed and each unit reshards after its forward passes again (the
    layers do; the root keeps its weights until the backward pass, FSDP2's own default). The module's registered
    parameters are the full tensors inside the block and the shards outside it.
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)


@contextlib.contextmanager
def matched_passes(model: torch.nn.Module, passes: int, pad_token_id: int = 0) -> Iterator[None]:
    """Under `wrap_fsdp`: around a block in which this rank runs `passes` forward and backward passes, make every
    rank run as many as the busiest one (no-op for a model that is not sharded).

    FSDP2 all-gathers each unit's weights in every forward pass and reduce-scatters its gradients in every
    backward pass, so a rank that ran fewer micro-batches than another would leave that one waiting in a
    collective for ever. Before the block, while every rank is at the same point, one all-reduce agrees on the
    largest count; after it, a rank that ran fewer adds zero-loss passes (`zero_pass`: exact zeros in the
    gradients). A block that raises is not padded (the run is stopping).
    """
    most = all_max(passes) if _fsdp_modules(model) else passes
    yield
    for _ in range(most - passes):
        zero_pass(model, pad_token_id)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def clip_grad_norm_(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the global gradient, also when some gradients are FSDP2 shards.

    Sharded gradients (DTensors) give their norm over every rank's shard (DTensor's norm all-reduces); tensors
    outside the policy (a value head: the same on every rank after their all-reduce) add theirs; every gradient is
    scaled by ``max_norm / (norm + 1e-6)`` when that is below 1, as torch does. Returns the total norm (a plain
    tensor). Without DTensors this is torch's function.
    """
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if _is_dtensor(g)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    local = [g for g in grads if not _is_dtensor(g)]
    norms = [torch.nn.utils.get_total_norm(sharded).full_tensor()]
    if local:
        norms.append(torch.nn.utils.get_total_norm(local).to(norms[0].device))
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for group in (sharded, local):
            if group:
                torch._foreach_mul_(group, coef)
    return total


def full_state_dict(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of `model`'s state dict, whole and on the CPU: a collective under `wrap_fsdp`, where every
    rank must call it and rank 0 alone gets the tensors (the others get an empty dict); otherwise the module's own
    tensors on every rank."""
    if not _fsdp_modules(model):
        state = model.state_dict(keep_vars=True)
        return {name: state[name] for name in names}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: state[name] for name in names if name in state}


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Load whole tensors (a `full_state_dict`, present on every rank) into `model`, each rank keeping its shard
    under `wrap_fsdp`; returns the names `model` lacks (the load is not strict about the others)."""
    if not _fsdp_modules(model):
        return list(model.load_state_dict(state, strict=False).unexpected_keys)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    known = set(model.state_dict())
    unexpected = [name for name in state if name not in known]
    if not unexpected:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return unexpected


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state dict (``optimizer.state_dict()`` of one process, present on every rank) made ready for
    ``optimizer.load_state_dict`` over sharded parameters: each state tensor shaped like its DTensor parameter
    becomes this rank's shard of it (no communication: every rank holds the whole tensor); the rest is unchanged."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[int, dict[str, Any]] = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        out[index] = {}
        for key, value in values.items():
            if _is_dtensor(param) and torch.is_tensor(value) and value.shape == param.shape and value.ndim > 0:
                value = distribute_tensor(
                    value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                )
            out[index][key] = value
    return {"state": out, "param_groups": state["param_groups"]}


def sharded_model_state(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of `model`'s state dict as this rank holds them, for torch.distributed.checkpoint to save
    or to load into in place: its DTensor shards under `wrap_fsdp`, the module's own whole tensors otherwise.

    No communication. Tied weights come once, under the name `names` gives them.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    return {name: state[name] for name in names}


def load_sharded_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a `sharded_model_state` (filled from a checkpoint) into `model`; the names it lacks stay as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def _optimized_module(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """A module naming every parameter of `optimizer`: `model` as ``policy``, the optimizer's parameters outside it
    (a value head, a critic) as ``others.<i>`` in the optimizer's order. torch's state-dict functions key the optimizer
    state by these names (FQNs) and need a module that holds every parameter."""
    inside = {id(p) for p in model.parameters()}
    holder = torch.nn.Module()
    holder.policy = model
    holder.others = torch.nn.ParameterList(
        [p for group in optimizer.param_groups for p in group["params"] if id(p) not in inside]
    )
    return holder


def sharded_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer`'s state dict keyed by parameter name (``policy.<name>``, ``others.<i>``; see `_optimized_module`),
    its state tensors as this rank holds them (DTensor shards under `wrap_fsdp`): what torch.distributed.checkpoint
    saves, and loads into in place for `load_sharded_optimizer_state`.

    No communication. An optimizer that has not stepped yet gets its state made first (one step of zero gradients
    at lr 0, torch's own way, which leaves the weights exactly as they are), so that there is something to load into.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_optimized_module(model, optimizer), optimizer)


def load_sharded_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a `sharded_optimizer_state` (its tensors filled from a checkpoint, its parameter groups the saved ones)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(_optimized_module(model, optimizer), optimizer, state)


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's argument that turns off the buffer broadcast on each forward (renamed in recent torch)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
