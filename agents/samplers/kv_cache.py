"""Keys and values of the transformers sampler (`agents.samplers.hf`): kept between calls, grown in place.

`PrefixStore` keeps the keys and values of finished rows under a token budget and matches a new prompt against
them by longest common prefix; `AppendLayer` is a cache layer that writes each step's keys and values into
reserved room; `narrow_linears` gives a model's float32 `nn.Linear` layers the W @ x^T form for few-row inputs
on a CPU (`agents.samplers.static_decode.narrow_linear`; measured in docs/results/throughput.md), and
`grouped_attention` lets a CPU prefill attend over grouped key/value heads without copying them per query head;
`choose_prefill_attention` and `sampling_attention` pick and apply the attention a sampler's prefill runs.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from agents.samplers.static_decode import narrow_linear

__all__ = [
    "AppendLayer",
    "KeptSequence",
    "PrefixStore",
    "choose_prefill_attention",
    "common_length",
    "grouped_attention",
    "is_prefix",
    "narrow_linears",
    "sampling_attention",
]


@dataclass(eq=False)
class KeptSequence:
    """Keys and values of one token sequence fed from position 0, each (layers, kv_heads, n, head_dim)."""

    tokens: np.ndarray  # (n,) int64
    keys: torch.Tensor
    values: torch.Tensor


class PrefixStore:
    """Kept sequences under a token budget, least recently used out first, matched by longest common prefix."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, KeptSequence] = OrderedDict()
        self.tokens = 0

    def match(self, ids: np.ndarray, *, touch: bool = True) -> tuple[KeptSequence | None, int]:
        """The kept sequence sharing the longest prefix with `ids`, and that prefix's length (0: none); with `touch`,
        it becomes the most recently used (False: a look that leaves the eviction order as it was)."""
        best, best_len = None, 0
        for kept in self.entries.values():
            n = min(len(kept.tokens), len(ids))
            if n <= best_len or kept.tokens[0] != ids[0]:
                continue
            differ = np.flatnonzero(kept.tokens[:n] != ids[:n])
            common = int(differ[0]) if differ.size else n
            if common > best_len:
                best, best_len = kept, common
        if best is not None and touch:
            self.entries.move_to_end(id(best))
        return best, best_len

    def add(self, kept: KeptSequence) -> None:
        if len(kept.tokens) > self.max_tokens:
            return
        self.entries[id(kept)] = kept
        self.tokens += len(kept.tokens)
        while self.tokens > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= len(old.tokens)

    def discard(self, kept: KeptSequence) -> None:
        if self.entries.pop(id(kept), None) is not None:
            self.tokens -= len(kept.tokens)

    def release(self, ids: np.ndarray) -> None:
        """Drop every kept sequence that is a prefix of `ids`."""
        for kept in [k for k in self.entries.values() if is_prefix(k.tokens, ids)]:
            self.discard(kept)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def is_prefix(head: np.ndarray, ids: np.ndarray) -> bool:
    return len(head) <= len(ids) and bool(np.array_equal(head, ids[: len(head)]))


class AppendLayer(DynamicLayer):
    """A `DynamicLayer` that writes new keys and values into reserved room instead of concatenating the whole
    cache at every decode step (which reads and writes all of it, as much memory traffic per step as the
    attention itself); `keys` and `values` are views of the filled part.

    Args:
        reserve: columns to allocate at the first update (the widest the call's cache can get: past + prompt +
            new tokens); an update past the room grows it by half.
    """

    def __init__(self, reserve: int = 0) -> None:
        super().__init__()
        self.reserve = reserve
        self._keys: torch.Tensor | None = None  # (batch, kv_heads, room, head_dim)
        self._values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = 0 if self._keys is None else self.keys.shape[-2]
        need = used + key_states.shape[-2]
        if self._keys is None or need > self._keys.shape[-2]:
            room = max(need, self.reserve) if self._keys is None else need + need // 2
            shape = (*key_states.shape[:-2], room, key_states.shape[-1])
            keys, values = key_states.new_empty(shape), value_states.new_empty(shape)
            if used:
                keys[..., :used, :] = self.keys
                values[..., :used, :] = self.values
            self._keys, self._values = keys, values
        self._keys[..., used:need, :] = key_states
        self._values[..., used:need, :] = value_states
        self.keys, self.values = self._keys[..., :need, :], self._values[..., :need, :]
        return self.keys, self.values

    @staticmethod
    def allocate_all(
        layers: Sequence[AppendLayer], like: torch.Tensor, rows: int, used: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Give every layer room for `rows` rows (at least its `reserve` columns), of which the first `used` count
        as filled, all in one buffer; returns those filled columns' keys and values, (layers, rows, kv_heads, used,
        head_dim) each, for the caller to write: a call's reused past, written in place rather than built apart
        and copied in, a row's columns of every layer in one copy. `like`: a tensor whose dtype and device the room
        takes, (.., kv_heads, .., head_dim)."""
        room = max([used, *(layer.reserve for layer in layers)])
        shape = (len(layers), rows, like.shape[-3], room, like.shape[-1])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        for layer, layer_keys, layer_values in zip(layers, keys, values, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(layer_keys, layer_values)
            layer._keys, layer._values = layer_keys, layer_values
            layer.keys, layer.values = layer_keys[..., :used, :], layer_values[..., :used, :]
        return keys[..., :used, :], values[..., :used, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._keys is not None:
            used = self.keys.shape[-2]
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[..., :used, :], self._values[..., :used, :]

    def release(self) -> None:
        """Drop the keys and values (the layer is then as if never filled)."""
        self._keys = self._values = self.keys = self.values = None
        self.is_initialized = False

    def move_rows(self, sources: torch.Tensor, targets: torch.Tensor, rows: int) -> None:
        """Copy rows `sources` into rows `targets` (filled columns only), then keep the first `rows` rows: a batch
        that loses a few rows fills their places with its last rows instead of copying all it keeps."""
        if self._keys is None:
            return
        used = self.keys.shape[-2]
        if len(sources):
            self._keys[targets, :, :used] = self._keys[sources, :, :used]
            self._values[targets, :, :used] = self._values[sources, :, :used]
        self._keys, self._values = self._keys[:rows], self._values[:rows]
        self.keys, self.values = self._keys[..., :used, :], self._values[..., :used, :]


@contextlib.contextmanager
def narrow_linears(model: torch.nn.Module, max_rows: int) -> Iterator[None]:
    """While open, every plain float32 `nn.Linear` of `model` computes an input of at most `max_rows` rows as
    (W @ x^T)^T, a lone row doubled first (why, and the gain: `agents.samplers.hf`).

    Only layers of exactly `nn.Linear` whose weight is a plain tensor are changed, and only those without a
    forward of their own already (a hook library's wrapper stays in charge); each gets an instance `forward`
    that is deleted on exit, so the model is as it was afterwards, also after an exception.
    """
    layers = []
    if max_rows > 0:
        layers = [
            module
            for module in model.modules()
            if type(module) is torch.nn.Linear
            and type(module.weight.data) is torch.Tensor
            and module.weight.dtype == torch.float32
            and "forward" not in vars(module)
        ]
    for layer in layers:
        layer.forward = _narrow_forward(layer, max_rows)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _narrow_forward(layer: torch.nn.Linear, max_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= max_rows or x.dtype != layer.weight.dtype or torch.is_autocast_enabled(x.device.type):
            return torch.nn.functional.linear(x, layer.weight, layer.bias)
        out = narrow_linear(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias)
        return out.reshape(*x.shape[:-1], layer.weight.shape[0])

    return forward


GROUPED_SDPA = "redcoda_sdpa_grouped"
"""The attention implementation name `grouped_attention` registers with transformers for the time it is open."""


def _grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked pass of several query tokens over grouped key/value
    heads gives the groups to SDPA (`enable_gqa`) instead of first copying each key/value head once per query head
    it serves (`repeat_kv`): the same kernel over the same numbers, without the copy."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and attention_mask is not None
    special = (
        dropout
        or kwargs.get("output_attentions")
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
    )
    if grouped and not special:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


@contextlib.contextmanager
def grouped_attention(model: torch.nn.Module) -> Iterator[None]:
    """While open, a CPU model with transformers' SDPA attention attends over grouped key/value heads without
    copying them per query head in passes of several tokens (a prefill); decode steps already do so.

    SDPA's CPU kernel takes the groups itself (`enable_gqa`), but transformers copies the heads whenever a mask is
    given, as it is for every padded batch: three times SmolLM2's keys and values, copied in every layer (the cost:
    docs/results/throughput.md). The outputs are the same numbers (tested). Other attention implementations and
    other devices are left as they are. The model's config names the implementation and is restored on exit, also
    after an exception.
    """
    config = getattr(model, "config", None)
    device = next(model.parameters()).device
    if config is None or device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


SDPA_KINDS = frozenset({"sdpa", "sdpa-grouped"})
"""The prefill attentions of `choose_prefill_attention` that run torch's scaled_dot_product_attention."""


def choose_prefill_attention(model: torch.nn.Module, device: torch.device) -> tuple[str, str]:
    """The attention a sampler's prefill runs for `model` on `device`, and why, in a few words.

    A prefill attends from every prompt token to every earlier one: at a GPU's rows and contexts its eager form
    (scores as a full matrix, softmax, a second product, each through memory) is several passes over a matrix that
    torch's fused scaled_dot_product_attention (SDPA) never writes out. So SDPA where the model's class supports it,
    even where the model was loaded with eager attention (the switch lasts for the sampler's call: a trainer's own
    passes keep the model's choice); on a CPU its grouped form (`grouped_attention`: no copy of the key/value heads
    per query head). On CUDA transformers' SDPA still copies the heads when a padding mask is given, since SDPA's
    grouped heads with a mask would fall back to its unfused math kernel there. Other implementations (flash
    attention, a registered kernel) are the model's choice and stay.

    Returns:
        ("sdpa-grouped" | "sdpa" | the model's implementation name, the reason).
    """
    current = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager")
    supported = current == "sdpa" or (current == "eager" and bool(getattr(model, "_supports_sdpa", False)))
    if not supported:
        why = "its class does not support SDPA" if current == "eager" else "an implementation the model was given"
        return current, f"the model's own {current!r} attention ({why})"
    switched = "" if current == "sdpa" else ", switched from the eager attention it was loaded with"
    if device.type == "cpu":
        return "sdpa-grouped", f"torch's fused SDPA over grouped key/value heads{switched}"
    return "sdpa", f"torch's fused SDPA{switched}"


@contextlib.contextmanager
def sampling_attention(model: torch.nn.Module, kind: str) -> Iterator[None]:
    """While open, `model` attends with `kind` (`choose_prefill_attention`): an SDPA kind sets the model's config
    to transformers' SDPA (and on a CPU opens `grouped_attention`); any other leaves the model as it is. The
    config's implementation is restored on exit, also after an exception."""
    config = getattr(model, "config", None)
    if kind not in SDPA_KINDS or config is None:
        yield
        return
    was = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        if kind == "sdpa-grouped":
            with grouped_attention(model):
                yield
        else:
            yield
    finally:
        config._attn_implementation = was
