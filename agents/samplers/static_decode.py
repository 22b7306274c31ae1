"""Decode steps over preallocated key/value buffers of fixed shapes, replayed as CUDA graphs on a GPU.

A small model's decode step is hundreds of tiny kernels, launched one by one from Python, so on a GPU it is bound
by host-side dispatch (`benchmarks.sampler_gpu`; figures in docs/results/throughput.md). A CUDA graph replays the
whole step with one launch, but needs every tensor at a fixed address with a fixed shape, which a growing,
shrinking `DynamicCache` never has. Here the keys and values live in buffers allocated once and reused across
calls, ``(rows, kv_heads, columns, head_dim)`` per layer; the step is our own function of the model's modules that
writes the new token's keys and values into one column and attends over a fixed number of columns under a mask.

Shapes come in buckets (rows in powers of two up to the batch size, columns in multiples of `COLUMN_BUCKET`), so a
few graphs, captured on first need and sharing one memory pool, serve every call. Finished rows keep their slot
until the live rows fit a smaller bucket, then are gathered into the first slots (`StaticDecoder.compact`). The
largest bucket is the sampler's batch size (on a GPU chosen from free memory: `algos.run.memory.sampler_rows`).

Memory: the buffers grow to the largest bucket a call needed and stay allocated until the parameters are replaced,
the autocast state or key dtype changes, or `StaticDecoder.clear()` (which also drops the graphs). The step reads
q, k, v as one stacked matrix and gate, up as another (copies refreshed in place each call, in the autocast dtype
under autocast); in-place weight updates need no recapture: a graph reads them by address.

The step reproduces the Llama decoder layer (pre-norm RMS norms, rotary grouped-query attention, a SwiGLU MLP) in
fewer operations than the model's own forward. `SUPPORTED_MODEL_TYPES` have that layer: Llama, Qwen2 (biases on
q, k, v) and Mistral; `supports` refuses, with a reason, sliding-window attention, layers with other parameters
(Qwen3's query and key norms), length-rescaled rotary embeddings and linear layers wrapped by LoRA or quantization.
On a CPU the same step runs without graphs (`graphs=False`, the sampler's ``decode="static"``); tests check that it
samples what dynamic decoding samples.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

logger = logging.getLogger(__name__)

COLUMN_BUCKET = 256
"""Key/value columns come in multiples of this: a call attends over its need rounded up to it."""

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
"""`config.model_type`s whose decoder layer is Llama's up to biases and a sliding window, both of which `supports`
checks per model. Named, not recognised by their modules: look-alike layers with the same module names compute
other things (Granite scales the residuals and the logits, Gemma's norms multiply by 1 + weight)."""

_LAYER_PARAMETERS = frozenset(
    {"input_layernorm.weight", "post_attention_layernorm.weight"}
    | {
        f"{linear}.{kind}"
        for linear in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for kind in ("weight", "bias")
    }
)
"""The parameters of a decoder layer that `_step` reads; a layer with any other computes something the step skips."""


def supports(model: torch.nn.Module) -> bool:
    """Whether `_step` reproduces this model's forward pass (a Llama, Qwen2 or Mistral causal LM without a sliding
    window; `SUPPORTED_MODEL_TYPES`)."""
    return _refusal(model) is None


def choose_decode(model: torch.nn.Module, device: torch.device, *, plain: bool = True) -> tuple[str, str]:
    """What the sampler's ``decode="auto"`` runs for `model` on `device`, and why, in a few words.

    CUDA graphs on a CUDA device where the static step reproduces the model (a GPU decode step is bound by launching
    its kernels, which one graph replay removes); the same static steps without graphs elsewhere (on a CPU a step is
    fewer operations than the model's forward); else the model's own forward over a dynamic cache.

    Args:
        model: the causal LM to sample from (only inspected: its type, layers and linear layers).
        device: where it runs (the choice reads the device's type only, so a test on a CPU can ask about CUDA).
        plain: whether the model's cache is plain per-layer keys and values (`HFSampler` checks it).
    """
    if not plain:
        return "dynamic", "its cache is not plain per-layer keys and values"
    reason = _refusal(model)
    if reason is not None:
        return "dynamic", reason
    if device.type == "cuda":
        return "graphs", "one CUDA graph replay per decode step over static key/value buffers"
    return "static", f"static key/value buffers without graphs on {device.type}"


def _refusal(model: torch.nn.Module) -> str | None:
    """Why `_step` would not compute this model's forward pass, or None when it would."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if not (
        kind in SUPPORTED_MODEL_TYPES
        and inner is not None
        and all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))
        and hasattr(model, "lm_head")
    ):
        return (
            f"static decoding reproduces Llama-architecture decoder layers (model types "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}: SmolLM2's, Qwen2.5's), not {kind!r}"
        )
    if wrapped := _wrapped_linears(model):
        name, module = wrapped[0]
        return (
            f"static decoding reads plain linear weights, and {len(wrapped)} of this model's linear layers are wrapped "
            f"({name} is a {type(module).__name__}: LoRA adapters?); merge them first"
        )
    unread = sorted({name for layer in inner.layers for name, _ in layer.named_parameters()} - _LAYER_PARAMETERS)
    if unread:
        return f"this model's decoder layers have parameters the static step does not apply: {', '.join(unread[:4])}"
    norms = [
        inner.norm,
        *(n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)),
    ]
    if other := [norm for norm in norms if not hasattr(norm, "variance_epsilon")]:  # `_norm` computes RMS norms
        return f"static decoding computes RMS norms, and this model has a {type(other[0]).__name__}"
    # The model's own cache tells where attention is windowed (a sliding or chunked layer keeps only its window);
    # a window set in the config but on no layer (Qwen2's max_window_layers >= layers) changes nothing.
    windowed = [i for i, layer in enumerate(DynamicCache(config=config).layers) if type(layer) is not DynamicLayer]
    if windowed:
        return (
            f"static decoding attends over every column, and this model's layers {windowed[:4]} use sliding-window "
            f"attention (window {getattr(config, 'sliding_window', None)})"
        )
    # rotary embeddings that rescale with the sequence length read it on the host: not a fixed-shape step
    rope = str(getattr(inner.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope or rope == "longrope":
        return f"static decoding needs fixed rotary embeddings, and this model's ({rope!r}) rescale with the length"
    return None


def _wrapped_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The decoder's linear layers that are not plain `nn.Linear` (LoRA adapters, quantized layers), by name: the
    step reads their weights directly, which would skip what the wrapper adds."""
    names = [
        f"model.layers.{i}.{name}"
        for i in range(len(model.model.layers))
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    wrapped = []
    for name in [*names, "lm_head"]:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # a layer the step needs is missing: as unusable as a wrapped one
            module = None
        if type(module) is not torch.nn.Linear:
            wrapped.append((name, module))
    return wrapped


def row_bucket(rows: int) -> int:
    """The smallest power of two holding `rows` rows."""
    return 1 << max(rows - 1, 0).bit_length()


def column_bucket(columns: int) -> int:
    """`columns` rounded up to a multiple of `COLUMN_BUCKET`."""
    return -(-columns // COLUMN_BUCKET) * COLUMN_BUCKET


@dataclass
class _LayerWeights:
    """One decoder layer's linear weights as a step reads them: q, k and v stacked into one product, gate and up
    into another (fewer, larger matrix products: a decode step of a small model is bound by its kernel count)."""

    qkv: torch.Tensor  # (heads + 2 kv_heads) * head_dim, hidden
    qkv_bias: torch.Tensor | None  # Qwen2's; None where the projections have none (Llama's default)
    o: torch.Tensor
    gate_up: torch.Tensor  # 2 * intermediate, hidden
    gate_up_bias: torch.Tensor | None  # Llama's with mlp_bias
    down: torch.Tensor


def _stacked_bias(linears: tuple[torch.nn.Linear, ...], stacked: Callable[..., torch.Tensor]) -> torch.Tensor | None:
    """The biases of `linears` stacked as their weights are (`stacked` makes the copy), or None where none has a
    bias: a bias-free model's step then adds nothing."""
    if all(m.bias is None for m in linears):
        return None
    return stacked(*(m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias for m in linears))


def narrow_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 2-D `x` of few rows, computed as (W @ x^T)^T with a lone row doubled: on a
    CPU the BLAS streams the weight at the memory's rate this way, and far below it as x @ W^T (see
    `agents.samplers.hf`, "Decode steps on a CPU"). The same sums in another order."""
    rows = x.shape[0]
    flat = torch.cat((x, x)) if rows == 1 else x  # one row would take the single-threaded matrix-vector path
    out = torch.mm(weight, flat.t()).t()[:rows]
    return out if bias is None else out + bias


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (b, heads, head_dim) with (b, 1, head_dim) cos and sin (Llama's half split)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _step(
    model: PreTrainedModel,
    tokens: torch.Tensor,  # (b,) the token each row feeds
    positions: torch.Tensor,  # (b,) its position id
    column: torch.Tensor,  # (1,) the key/value column it is written to
    mask: torch.Tensor,  # (b, 1, 1, L) bool, True where a row attends
    keys: list[torch.Tensor],  # per layer (b, kv_heads, L, head_dim)
    values: list[torch.Tensor],
    weights: list[_LayerWeights],
    lm_head: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """One decode step of a Llama-architecture model over static key/value buffers; returns (b, vocab) logits.

    Computes what `LlamaForCausalLM.forward` (or Qwen2's, Mistral's: `supports`) computes for one token per row, with
    the row's keys and values written in place, in fewer operations: q, k and v as one product (their biases, where
    the model has them, added as one stacked vector), their rotary embedding applied to q and k at once, gate and up
    as one product, the norms as `F.rms_norm` (the same formula, fused where the device has a kernel).
    `weights` and `lm_head` are the decoder's copies (`StaticDecoder._refresh_weights`); `linear` computes every
    product (`narrow_linear` for a CPU's few rows).
    """
    inner, config = model.model, model.config
    rows = tokens.shape[0]
    hidden = inner.embed_tokens(tokens)  # (b, hidden)
    cos, sin = inner.rotary_emb(hidden[:, None], positions[:, None])  # (b, 1, head_dim)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for layer, w, layer_keys, layer_values in zip(inner.layers, weights, keys, values, strict=True):
        attn = layer.self_attn
        x = _norm(layer.input_layernorm, hidden)
        qkv = linear(x, w.qkv, w.qkv_bias).view(rows, heads + 2 * kv_heads, attn.head_dim)
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
        key = qk[:, heads:, None]  # (b, kv_heads, 1, head_dim)
        layer_keys.index_copy_(2, column, key.to(layer_keys.dtype))
        layer_values.index_copy_(2, column, qkv[:, heads + kv_heads :, None].to(layer_values.dtype))
        # query head h reads key/value head h // groups: for one new token, the groups are rows of one head
        query = qk[:, :heads].reshape(rows, kv_heads, -1, attn.head_dim)  # (b, kv_heads, groups, head_dim)
        out = F.scaled_dot_product_attention(query, layer_keys, layer_values, attn_mask=mask, scale=attn.scaling)
        hidden = hidden + linear(out.reshape(rows, -1), w.o, attn.o_proj.bias)
        mlp = layer.mlp
        gate, up = linear(_norm(layer.post_attention_layernorm, hidden), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        hidden = hidden + linear(mlp.act_fn(gate) * up, w.down, mlp.down_proj.bias)
    return linear(_norm(inner.norm, hidden), lm_head, model.lm_head.bias)


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm` of float32 `x`: x / sqrt(mean(x^2) + eps) * weight, in one call."""
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


class StaticDecoder:
    """Static key/value buffers and the decode-step graphs over them, kept by one sampler across its calls.

    Args:
        model: a Llama-architecture causal LM (Llama, Qwen2 or Mistral: `supports`); never modified.
        graphs: capture and replay each (rows, columns) bucket's step as a CUDA graph (the model must be on a
            CUDA device); False runs the same step eagerly.
        compact: when a call's live rows fit a smaller row bucket, gather them into the first slots and step that
            bucket from then on (`decode_steps.StaticSteps.select`): a step's attention reads the keys and values of
            every row it runs, finished or not, so a call whose rows end early runs fewer rows per step. False runs
            the call's first bucket to its end (the same samples; for parity tests and benchmarks).
    """

    def __init__(self, model: PreTrainedModel, *, graphs: bool, compact: bool = True) -> None:
        if (reason := _refusal(model)) is not None:
            raise ValueError(f"{reason}; use the dynamic cache (decode='dynamic') for this model")
        self.model = model
        self.device = next(model.parameters()).device
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {self.device}; use decode='static'")
        self.graphs = graphs
        self.compact = compact
        """Whether finished rows leave the stepped row bucket (see the class docstring)."""
        self.narrow_rows = 0
        """On a CPU, steps of at most this many float32 rows compute their products with `narrow_linear` (the
        sampler sets it per call, as it does for the dynamic path's layers)."""
        self.captured = 0
        """Graphs captured so far (a running count; recaptures after a `clear` count again)."""
        self._key: tuple | None = None  # what the buffers and graphs were made for
        self._rows = self._columns = 0
        self.keys: list[torch.Tensor] = []  # per layer (rows, kv_heads, columns, head_dim)
        self.values: list[torch.Tensor] = []
        self.all_keys = self.all_values = torch.empty(0)  # (layers, rows, kv_heads, columns, head_dim)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._runners: dict[tuple[int, int, bool], Callable[[], torch.Tensor]] = {}
        self._pool = None
        self._weights: list[_LayerWeights] = []  # the step's weights (`_refresh_weights`), per layer
        self._lm_head = torch.empty(0)
        self._copies: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []  # (copy, the parameters it stacks)

    def clear(self) -> None:
        """Free the buffers and the weight copies and drop every graph."""
        self.keys, self.values, self._graphs, self._runners, self._pool = [], [], {}, {}, None
        self.all_keys = self.all_values = torch.empty(0)
        self._weights, self._lm_head, self._copies = [], torch.empty(0), []
        self._rows = self._columns = 0
        self._key = None

    def begin(self, cache: DynamicCache, columns: int) -> None:
        """Make room for a call whose prefilled cache is `cache` and whose columns reach `columns`, and copy the
        prefilled keys and values into the buffers' first rows and columns."""
        first = cache.layers[0].keys
        rows = first.shape[0]
        device_type = self.device.type
        self.cache_dtypes = (first.dtype, cache.layers[0].values.dtype)  # what a kept row is given back as
        # Under autocast the attention casts its keys and values to the autocast dtype at each step, so buffers
        # of that dtype hold exactly what it reads, and a step reads half the bytes (the prefill's keys come
        # out of the rotary embedding in float32; kept in float32, each step would read them and cast a copy).
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else first.dtype
        key = (
            dtype,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            tuple(id(p) for p in self.model.parameters()),
        )
        if key != self._key:
            self.clear()
            self._key = key
        autocast = torch.is_autocast_enabled(device_type)
        self._refresh_weights(dtype if autocast else next(self.model.parameters()).dtype)
        need_rows, need_columns = max(row_bucket(rows), self._rows), max(column_bucket(columns), self._columns)
        if need_columns > self._columns and self._columns:
            # contexts grow turn by turn: doubling keeps the regrowths (and recaptures) to a handful per run
            need_columns = max(need_columns, 2 * self._columns)
        if (need_rows, need_columns) != (self._rows, self._columns):
            # grown buffers: the graphs read the old addresses, so they go too
            self.keys, self.values, self._graphs, self._runners, self._pool = [], [], {}, {}, None
            self.all_keys = self.all_values = torch.empty(0)
            shape = (need_rows, first.shape[1], need_columns, first.shape[-1])
            # zeros, never uninitialised memory: a masked column still meets a zero attention weight, and 0 * NaN
            # would be NaN
            layers = len(cache.layers)
            # one tensor for all layers, so that a row's keys and values move (`gather`) or are read out (a kept
            # row) in one copy; `keys` and `values` are its per-layer views
            self.all_keys = torch.zeros((layers, *shape), dtype=dtype, device=first.device)
            self.all_values = torch.zeros((layers, *shape), dtype=dtype, device=first.device)
            self.keys, self.values = list(self.all_keys.unbind(0)), list(self.all_values.unbind(0))
            self._rows, self._columns = need_rows, need_columns
            self.tokens = torch.zeros(need_rows, dtype=torch.long, device=first.device)
            self.positions = torch.zeros(need_rows, dtype=torch.long, device=first.device)
            self.column = torch.zeros(1, dtype=torch.long, device=first.device)
            self.mask = torch.zeros((need_rows, 1, 1, need_columns), dtype=torch.bool, device=first.device)
        used = first.shape[-2]
        self.mask.zero_()
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            keys[:rows, :, :used] = layer.keys
            values[:rows, :, :used] = layer.values
        self.call_columns = column_bucket(columns)

    def step(self, rows: int) -> torch.Tensor:
        """Run one step over the first `rows` slots (a row bucket) with the inputs already in `tokens`,
        `positions`, `column` and `mask`; returns the (rows, vocab) logits (a graph's output buffer: read it
        before the next step)."""
        columns = self.call_columns
        # the copies are float32 exactly when no autocast is on (`begin`)
        narrow = self.device.type == "cpu" and rows <= self.narrow_rows and self._lm_head.dtype == torch.float32
        run = self._runners.get((rows, columns, narrow))
        if run is None:  # the buffer views of a bucket, made once: a step is on the hot path
            run = self._runners[rows, columns, narrow] = self._runner(rows, columns, narrow)
        if not self.graphs:
            return run()
        entry = self._graphs.get((rows, columns))
        if entry is None:
            entry = self._capture(run)
            if entry is None:  # capture failed: this decoder steps eagerly from now on (logged once)
                return run()
            self._graphs[rows, columns] = entry
        graph, logits = entry
        graph.replay()
        return logits

    def gather(self, slots: torch.Tensor, columns: int) -> None:
        """Move the rows at `slots` (in order) into the first slots, their first `columns` columns."""
        count = len(slots)
        for buffer in (self.all_keys, self.all_values):
            buffer[:, :count, :, :columns] = buffer[:, slots, :, :columns]
        self.mask[:count] = self.mask[slots]

    def _runner(self, rows: int, columns: int, narrow: bool) -> Callable[[], torch.Tensor]:
        keys = [k[:rows, :, :columns] for k in self.keys]
        values = [v[:rows, :, :columns] for v in self.values]
        tokens, positions, mask = self.tokens[:rows], self.positions[:rows], self.mask[:rows, :, :, :columns]
        linear = narrow_linear if narrow else F.linear
        return lambda: _step(
            self.model, tokens, positions, self.column, mask, keys, values, self._weights, self._lm_head, linear
        )

    def _refresh_weights(self, dtype: torch.dtype) -> None:
        """Bring the step's weights (`_step`: q, k and v stacked, gate and up stacked, in `dtype`) up to date with
        the model's, making them at the first call.

        Copies that each call refreshes in place keep their addresses, so the graphs read them, and follow
        in-place updates (an optimizer step) from the next call on. Under autocast they are in the autocast dtype:
        autocast itself casts a linear layer's weight at every call, or once per autocast context with its
        cache, and a graph can use neither (captured with the cache, it would read the casts of the context it
        was captured in, freed when that context closes and stale after an optimizer step; without it, every
        replay casts all the weights again: a kernel per layer and the weights' bytes read twice). So the weights
        are cast once per `generate` call, not once per decode step. Layers that need no stacking or cast (o,
        down and the LM head in float32) are read where they are. The norms and the embedding keep theirs.
        """
        if not self._weights:
            self._copies = []

            def stacked(*parts: torch.Tensor) -> torch.Tensor:
                shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                target = torch.empty(shape, dtype=dtype, device=self.device)
                self._copies.append((target, parts))
                return target

            def own(weight: torch.Tensor) -> torch.Tensor:
                return weight if weight.dtype == dtype else stacked(weight)

            for layer in self.model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
                self._weights.append(
                    _LayerWeights(
                        qkv=stacked(*(m.weight for m in qkv)),
                        qkv_bias=_stacked_bias(qkv, stacked),
                        o=own(attn.o_proj.weight),
                        gate_up=stacked(*(m.weight for m in gate_up)),
                        gate_up_bias=_stacked_bias(gate_up, stacked),
                        down=own(mlp.down_proj.weight),
                    )
                )
            self._lm_head = own(self.model.lm_head.weight)
        with torch.no_grad():
            for target, parts in self._copies:
                start = 0
                for part in parts:
                    target[start : start + part.shape[0]].copy_(part)
                    start += part.shape[0]

    def _capture(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Capture `run` as a CUDA graph. The warm-up run beforehand (lazy library set-up must not happen during
        capture) computes exactly what the step will, with the inputs in place, so it writes the same column."""
        kind = self.device.type
        # Under autocast the weights' low-precision casts are cached for the autocast context: captured with the
        # cache on, the graph would read the copies made in this context (freed when it exits, stale after an
        # optimizer step) instead of casting the weights at each replay. So both runs go without the cache.
        no_cache = functools.partial(
            torch.autocast,
            kind,
            dtype=torch.get_autocast_dtype(kind),
            enabled=torch.is_autocast_enabled(kind),
            cache_enabled=False,
        )
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), no_cache():
                run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), no_cache():
                logits = run()
        except Exception as err:
            logger.warning("capturing a decode step as a CUDA graph failed (%s); decoding without graphs", err)
            self.graphs = False
            self._graphs, self._pool = {}, None
            return None
        self._pool = graph.pool()
        self.captured += 1
        return graph, logits
