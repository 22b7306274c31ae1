"""Each loss term's gradient norm over every rank: what ``rl/grad_norm`` and ``sft/grad_norm`` report.

A learner with an SFT term keeps a copy of the RL term's gradient before the SFT term's backward adds to it
(``--term-grad-norms``; the memory check counts the copy); once the ranks' gradients are summed, the RL term's is the
copy (summed the same way under DDP; a shard of the global one under FSDP) and the SFT term's is the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from algos.distributed import all_sum

__all__ = ["global_norm", "term_norms"]


def sum_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Sum each tensor over the ranks in place, one all-reduce each (a kept copy of a gradient, say)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for t in tensors:
        dist.all_reduce(t)


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of `tensors` together; a sharded tensor (``--fsdp``) adds every rank's shard, a whole one (a value
    head's, summed over the ranks already) counts once."""
    if not any(hasattr(t, "to_local") for t in tensors):
        squares = (
            torch.stack([t.detach().float().square().sum() for t in tensors]).sum() if tensors else torch.zeros(())
        )
        return float(squares.sqrt())
    shards = sum(float(t.to_local().detach().float().square().sum()) for t in tensors if hasattr(t, "to_local"))
    whole = sum(float(t.detach().float().square().sum()) for t in tensors if not hasattr(t, "to_local"))
    (total,) = all_sum(shards)
    return (total + whole) ** 0.5


def term_norms(
    grads: Sequence[torch.Tensor | None], kept: Sequence[torch.Tensor | None] | None, *, sum_kept: bool
) -> dict[str, float]:
    """``rl/grad_norm`` and ``sft/grad_norm`` of a step whose gradients are summed over the ranks: `grads` the whole
    gradient, `kept` a copy of the RL term's taken before the SFT term's backward (None: no SFT term, the RL term's
    is the whole). With `sum_kept` (DDP, which summed `grads` in a closing pass) the copy is summed over the ranks the
    same way; under FSDP the copy is already the global gradient's shard."""
    if kept is None:
        return {"rl/grad_norm": global_norm([g for g in grads if g is not None])}
    if sum_kept:
        sum_tensors([g for g in kept if g is not None])
    sft = [g if r is None else g - r for g, r in zip(grads, kept, strict=True) if g is not None]
    return {"rl/grad_norm": global_norm([g for g in kept if g is not None]), "sft/grad_norm": global_norm(sft)}
