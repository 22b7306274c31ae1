"""Decode steps of the transformers sampler (`agents.samplers.hf`) after a batch's prefill: one token per live row
a step, over the model's own forward pass and its cache (`CacheSteps`) or over a `StaticDecoder`'s buffers
(`StaticSteps`, CUDA graphs on a GPU); rows leave as they finish.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from agents.models import cache_argument
from agents.samplers.kv_cache import AppendLayer
from agents.samplers.static_decode import StaticDecoder, row_bucket

__all__ = ["CacheSteps", "StaticSteps"]


class CacheSteps:
    """Decode steps of one call through the model's own forward pass, over its `DynamicCache`."""

    def __init__(self, model: PreTrainedModel, cache: DynamicCache) -> None:
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device

    @property
    def rows(self) -> int:
        """Rows a step computes: the live rows (finished ones leave the cache at once)."""
        return int(self.cache.layers[0].keys.shape[0])

    def __call__(self, token: torch.Tensor, attention: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row ((alive,) each; `attention` (alive, columns) with the new column);
        returns the next logits, (alive, vocab)."""
        out = self.model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=position[:, None],
            **{cache_argument(): self.cache},
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def row(self, j: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Live row `j`'s keys and values at `columns`, each (layers, kv_heads, len(columns), head_dim)."""
        layers = self.cache.layers
        first = layers[0].keys[j]  # (kv_heads, columns, head_dim)
        shape = (len(layers), first.shape[0], len(columns), first.shape[-1])
        keys, values = first.new_empty(shape), layers[0].values[j].new_empty(shape)
        for layer, key_out, value_out in zip(layers, keys, values, strict=True):  # one copy each, no stack after
            torch.index_select(layer.keys[j], 1, columns, out=key_out)
            torch.index_select(layer.values[j], 1, columns, out=value_out)
        return keys, values

    def select(self, keep: list[int], columns: int, reorder: bool) -> list[int]:
        """Keep only the live rows `keep` (ascending); returns the order they are in now. With `reorder`, the last
        kept rows move into the places of the rows that left (a copy of a few rows, not of all that stay)."""
        rows = len(keep)
        if not reorder or not all(type(layer) is AppendLayer for layer in self.cache.layers):
            self.cache.batch_select_indices(torch.tensor(keep, device=self.device))
            return keep
        kept = set(keep)
        holes = [j for j in range(rows) if j not in kept]
        movers = [j for j in keep if j >= rows]  # as many as the holes
        order = list(range(rows))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        sources, targets = torch.tensor(movers, device=self.device), torch.tensor(holes, device=self.device)
        for layer in self.cache.layers:
            layer.move_rows(sources, targets, rows)
        return order


class StaticSteps:
    """Decode steps of one call over a `StaticDecoder`'s buffers (CUDA graphs on a GPU), from its prefilled cache.

    Live rows sit in slots of the decoder's buffers; a row that finishes leaves its slot behind until the live
    rows fit a smaller row bucket, when they are gathered into the first slots (`StaticDecoder.compact`; off, every
    step runs the call's first bucket to the end).
    """

    def __init__(self, decoder: StaticDecoder, cache: DynamicCache, attention: torch.Tensor, widest: int) -> None:
        decoder.begin(cache, widest)
        rows, columns = attention.shape
        decoder.mask[:rows, 0, 0, :columns] = attention.bool()
        self.decoder = decoder
        self.slots = list(range(rows))
        self._slots = torch.arange(rows, device=attention.device)
        self.rows = row_bucket(rows)

    def __call__(self, token: torch.Tensor, attention: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        decoder, column = self.decoder, attention.shape[1] - 1
        decoder.tokens[self._slots] = token
        decoder.positions[self._slots] = position
        decoder.column.fill_(column)
        # every slot of the bucket attends to the column it writes now: a finished or unused slot's step stays
        # finite (its output is ignored, but NaN keys in its slot could reach a later call's live row)
        decoder.mask[: self.rows, 0, 0, column] = True
        return decoder.step(self.rows)[self._slots]

    def row(self, j: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one gather for all layers (a gather per layer was 60 kernels a row, 0.1 s a 64-row call on a GPU), in
        # the dtypes the dynamic cache keeps them in
        slot, (key_dtype, value_dtype) = self.slots[j], self.decoder.cache_dtypes
        keys = self.decoder.all_keys[:, slot].index_select(2, columns).to(key_dtype)
        return keys, self.decoder.all_values[:, slot].index_select(2, columns).to(value_dtype)

    def select(self, keep: list[int], columns: int, reorder: bool) -> list[int]:
        """Keep only the live rows `keep` (ascending), in that order: their slots stay where they are until the
        live rows fit a smaller bucket."""
        index = torch.tensor(keep, device=self._slots.device)
        self.slots = [self.slots[j] for j in keep]
        self._slots = self._slots[index]
        if self.decoder.compact and row_bucket(len(self.slots)) < self.rows:
            self.decoder.gather(self._slots, columns)
            self.slots = list(range(len(self.slots)))
            self._slots = torch.arange(len(self.slots), device=index.device)
            self.rows = row_bucket(len(self.slots))
        return keep
