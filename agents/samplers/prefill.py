"""The transformers sampler's prefill of a batch (`agents.samplers.hf`): its cache, its reused past, and on a CPU
its rows in groups of like length.

A batch's rows are left-padded to the widest; the rows that prefill few tokens (a planner reading a one-line
result) then pay for the widest (an executor reading three passages). `prefill_groups` splits a batch into the
groups that minimise the padded tokens plus `PREFILL_SPLIT_TOKENS` a group, and `prefill_apart` prefills each
group padded to its own widest row, into one cache with the single pass's columns, so that all rows then decode
together. Measured in docs/results/throughput.md (a run's tail, change by change, and the sampler's design).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from agents.models import cache_argument
from agents.samplers.kv_cache import AppendLayer, KeptSequence

__all__ = [
    "PREFILL_SPLIT_ROWS",
    "PREFILL_SPLIT_TOKENS",
    "fill_past",
    "new_cache",
    "prefill_apart",
    "prefill_groups",
    "prefill_inputs",
]

PREFILL_SPLIT_TOKENS = 32
"""The padded prefill tokens that one more forward pass of a batch's prefill must save. A forward pass costs 27-40
ms beyond its tokens (the weights are read once more), what 17-26 prefill tokens cost on a 2-core CPU, and a pass
of one row of 128+ tokens runs within 10-20% of a batch's tokens/s (`benchmarks.investigations.prefill_pass`)."""

PREFILL_SPLIT_ROWS = 8
"""Fewest rows of a batch whose prefill may be split into groups. A GRPO group's calls (4 rollouts of a question)
stay one padded pass: they gain little, and their rollouts keep the exact numbers of earlier runs (a split changes
float rounding, and a sampled token can follow a last-bit change)."""

_Match = tuple[KeptSequence | None, int]  # a row's kept sequence (or None) and how many of its tokens it reuses


def new_cache(model: PreTrainedModel, reserve: int, plain: bool) -> DynamicCache:
    """An empty cache for `model`; of `AppendLayer`s with `reserve` columns of room where its layers are `plain`."""
    cache = DynamicCache(config=model.config)
    if plain:
        cache.layers = [AppendLayer(reserve) for _ in cache.layers]
    return cache


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """A batch's rows, by the tokens each prefills, in the groups whose prefills run apart, widest first.

    For a batch of `PREFILL_SPLIT_ROWS` or more, the groups minimise the padded prefill tokens plus
    `PREFILL_SPLIT_TOKENS` for each group beyond the first (an exact partition of the rows sorted by length);
    otherwise one group.
    """
    n = len(lengths)
    if n < PREFILL_SPLIT_ROWS:
        return [list(range(n))]
    order = sorted(range(n), key=lambda b: -lengths[b])
    # best[i]: the least cost of order[:i], whose last group starts at cut[i]
    best, cut = [0] + [math.inf] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):  # the group order[j:i], padded to its widest, order[j]
            cost = best[j] + (i - j) * lengths[order[j]] + (PREFILL_SPLIT_TOKENS if j else 0)
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], n
    while i:
        groups.append(sorted(order[cut[i] : i]))
        i = cut[i]
    return groups[::-1]


def prefill_apart(
    model: PreTrainedModel,
    groups: list[list[int]],
    lengths: list[int],
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    matches: list[_Match],
    reserve: int,
) -> tuple[DynamicCache, torch.Tensor]:
    """Prefill each group of a batch's rows by itself, padded to its own widest row, then gather their keys and
    values into one cache laid out as a single prefill's would be (the columns a group did not prefill are masked
    padding); returns that cache and every row's next logits, (rows, vocab).

    `input_ids`, `positions` (rows, width) and `attention` (rows, past + width) are the single pass's, `lengths`
    each row's fresh tokens, `matches` each row's reused past, `reserve` the cache's room in columns. A group
    attends only over its own columns: its widest reused past and its own fresh part, not the columns that are
    padding for all its rows (a planner's short past shares a batch with executors' long ones; measured in
    docs/results/throughput.md). Each row sees the same keys, positions and mask as in one padded
    pass; the numbers differ from it only by float rounding, as between any two batchings.
    """
    n, width = input_ids.shape
    past = attention.shape[1] - width
    parts: list[tuple[torch.Tensor, int, int, DynamicCache]] = []
    logits = None
    like = next((kept.keys for kept, m in matches if m), None)  # the past's dtype and shape, if any
    for group in groups:
        index = torch.tensor(group, device=input_ids.device)
        own = max(lengths[b] for b in group)  # the group's widest fresh part
        reused = max(matches[b][1] for b in group)  # and widest reused past: the columns it attends over
        part = new_cache(model, reused + own, plain=True)
        if reused:
            fill_past(part, [matches[b] for b in group], reused, reused, like)
        mask = torch.cat([attention[index, past - reused : past], attention[index, past + width - own :]], dim=1)
        out = model(
            input_ids=input_ids[index, width - own :],
            attention_mask=mask,
            position_ids=positions[index, width - own :],
            **{cache_argument(): part},
            use_cache=True,
            logits_to_keep=1,
        )
        if logits is None:
            logits = out.logits.new_empty((n, out.logits.shape[-1]))
            like = part.layers[0].keys if like is None else like
        logits[index] = out.logits[:, -1, :]
        parts.append((index, reused, own, part))
    if logits is None or like is None:
        raise ValueError("prefill_apart needs at least one group")
    cache = new_cache(model, reserve, plain=True)
    keys, values = AppendLayer.allocate_all(cache.layers, like, n, past + width)
    for layer in range(len(cache.layers)):
        for index, reused, own, part in parts:
            for into, got in ((keys[layer], part.layers[layer].keys), (values[layer], part.layers[layer].values)):
                # masked columns hold zeros, not what the buffer held (0 x NaN would not be 0)
                into[:, :, : past - reused].index_fill_(0, index, 0.0)
                into[:, :, past - reused : past].index_copy_(0, index, got[:, :, :reused])
                into[:, :, past : past + width - own].index_fill_(0, index, 0.0)
                into[:, :, past + width - own :].index_copy_(0, index, got[:, :, reused:])
            part.layers[layer].release()  # each group's copy goes once used: at most one layer held twice
    return cache, logits


def fill_past(
    cache: DynamicCache, matches: list[_Match], past: int, columns: int, like: torch.Tensor | None = None
) -> None:
    """Fill an empty cache of `AppendLayer`s with `columns` columns: each row's reused keys and values right-aligned
    in the first `past`, zeros elsewhere (masked; zero, since 0 x NaN would not be 0). `like`: a tensor of the
    cache's dtype and (layers, kv_heads, .., head_dim), needed where no row reuses."""
    if like is None:
        like = next(kept.keys for kept, m in matches if m)
    keys, values = AppendLayer.allocate_all(cache.layers, like, len(matches), columns)
    for b, (kept, m) in enumerate(matches):  # a copy a row for all layers
        keys[:, b, :, : past - m].zero_()
        values[:, b, :, : past - m].zero_()
        if kept is not None and m:
            keys[:, b, :, past - m : past] = kept.keys[:, :, :m]
            values[:, b, :, past - m : past] = kept.values[:, :, :m]
    keys[:, :, :, past:].zero_()
    values[:, :, :, past:].zero_()


def prefill_inputs(
    prompts: Sequence[Sequence[int]], reused: Sequence[int], pad_id: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens each prompt prefills (those after its first ``reused[b]``, kept from before), and the prefill's
    input ids ``(n, width)``, attention mask ``(n, past + width)`` and positions ``(n, width)``: batch row b is
    [pad | reused m_b] in the past (``past = max(reused)``) and [pad | fresh_b] as input, its positions continuing
    from m_b."""
    fresh = [list(ids[m:]) for ids, m in zip(prompts, reused, strict=True)]
    lengths = [len(ids) for ids in fresh]
    n, past, width = len(fresh), max(reused), max(lengths)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, past + width), dtype=torch.long)
    positions = torch.zeros((n, width), dtype=torch.long)
    for b, (ids, m) in enumerate(zip(fresh, reused, strict=True)):
        input_ids[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention[b, past - m : past] = 1
        attention[b, past + width - len(ids) :] = 1
        positions[b, width - len(ids) :] = torch.arange(m, m + len(ids))
    return lengths, input_ids, attention, positions
