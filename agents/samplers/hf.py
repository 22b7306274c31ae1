"""Batched sampling with a transformers causal LM (CPU or GPU): the default `Sampler`.

The decoding loop is our own rather than `model.generate`: the agents need per-row stop strings with a row
leaving the batch (and its KV-cache rows) as soon as it stops, the log-prob of every sampled token under the
distribution it was sampled from, and a batch that survives a bad row. Each call left-pads the prompts (sorted
by length, in batches of at most `max_batch_size`; on a CPU grouped by the tokens each must prefill, `pad_limit`),
prefills each batch (on a CPU in groups of like length, each padded only to its own widest row:
`agents.samplers.prefill`), then runs one forward pass per new token over its live rows. Greedy output matches
`model.generate(do_sample=False)` token for token.

Reuse across calls: a context only grows between turns, so when a row finishes its keys and values are kept
(`agents.samplers.kv_cache.PrefixStore`) with the token ids they belong to, and a later prompt copies those of
its longest kept prefix and prefills only the rest; rows with different reused lengths share one forward pass
(reused keys right-aligned in a padded past, explicit position ids). A prefix that several prompts of a call
share (at least `MIN_SHARED_TOKENS`) is prefilled once first. The result equals a full re-encode up to float
rounding (tested: same tokens, log-probs within 1e-5). At most `cache_tokens` tokens are kept, least recently
used out first; `release(token_ids)` drops a closed context's; a change of weights or autocast state drops all.

Decode steps (`agents.samplers.decode_steps`) on a CPU: few-row products run as (W @ x^T)^T (`narrow_rows`); a
finished greedy row leaves by a move of the last row into its place. `decode="graphs"` replays each step as one
CUDA graph (`agents.samplers.static_decode`), `"static"` runs the same steps without graphs (same samples, tested),
`"auto"` picks by device and model (`static_decode.choose_decode`, logged); static steps run the smallest row bucket
the live rows fit (`compact_rows`). The prefill attends with torch's SDPA where the model's class supports it
(`sdpa_prefill`, logged). `lever_counts` says what these levers did (a trainer logs ``sampler/*`` per step).
Threads: one OpenMP thread per core on a shared CPU can be many times slower than one; that is the caller's choice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from agents.models import cache_argument
from agents.records import Completion, SamplingParams
from agents.samplers import prefill
from agents.samplers.base import TokenizerContext, cut_at_stop, overflow
from agents.samplers.decode_steps import CacheSteps, StaticSteps
from agents.samplers.kv_cache import (
    KeptSequence,
    PrefixStore,
    choose_prefill_attention,
    common_length,
    is_prefix,
    narrow_linears,
    sampling_attention,
)
from agents.samplers.prefill import fill_past, new_cache, prefill_apart, prefill_groups, prefill_inputs
from agents.samplers.static_decode import StaticDecoder, choose_decode

logger = logging.getLogger(__name__)

_Row = tuple[int, list[int], int]  # (index in the call, prompt ids after truncation, max new tokens)

MIN_SHARED_TOKENS = 32
"""Shortest prefix that several prompts of one call must share for the sampler to prefill it once for all."""

PAD_SLACK = 1024
"""Padded prefill tokens a CPU batch may carry beyond `HFSampler.pad_limit` times its real ones before the call's
rows are split there: a batch of its own costs its decode steps, each about as dear as a dozen tokens' forward
pass at a few rows."""

DEFAULT_CACHE_TOKENS = 1 << 16
"""Default token budget of the keys and values an `HFSampler` keeps between calls (SmolLM2-135M holds 46 KB
per token in float32, so about 3 GB when full)."""


class HFSampler(TokenizerContext):
    """`Sampler` over a transformers causal LM.

    Log-probs: at temperature T > 0 the log-softmax of logits / T after top-p filtering (the distribution
    sampled from); at temperature 0 (greedy) the model's own log-softmax. A completion that ends on an
    end-of-turn token keeps that token in `token_ids` (the model sampled it; a loss should see it) but not
    in `text`. A completion that ends on a stop string keeps every sampled token in `token_ids`, up to the
    token that completed the stop string; `text` is cut right after the stop string, so it can lack a few
    characters that the last token carried past it.

    Args:
        model: a causal LM (`load_model()` or `tiny_model()`); switched to eval mode while sampling and back
            to its previous mode afterwards, so a trainer can share it; its weights are never modified.
        tokenizer: its tokenizer (needs a pad token: `load_model` sets one).
        max_context: most tokens one row may hold; None means the model's `max_position_embeddings`.
        max_batch_size: rows per forward pass; a call with more prompts runs in length-sorted chunks.
        seed: seed of the sampler's random generator (a call's `SamplingParams.seed` reseeds it; with
            `SamplingParams.row_seeds` each row samples from a generator of its own seed instead).
        stop_token_ids: token ids that end a completion; None means the generation config's EOS ids plus
            the tokenizer's EOS id.
        cache_tokens: most tokens whose keys and values are kept between calls for prefix reuse (see the
            module docstring); 0 turns reuse off. A model whose cache is not plain per-layer keys and
            values (sliding-window or linear-attention layers) never reuses.
        narrow_rows: on a CPU, linear layers fed at most this many rows compute W @ x^T (see the module
            docstring); None picks 4 with two or more torch threads and 3 with one, 0 turns it off.
        pad_limit: on a CPU a call's rows are batched by the prompt tokens each must prefill (after reuse), and a
            batch ends where one more row would pad its prefill to over `pad_limit` times the real tokens (and by
            over `PAD_SLACK` tokens): an agent's call that mixes short replies with long search results then
            runs as two batches instead of padding every short row to the longest (docs/results/throughput.md).
            Calls whose batches prefill in groups of like length (8 rows or more, `agents.samplers.prefill`) pad
            little and are not split. A call of more rows than one batch holds, or one that splits, samples
            (above temperature 0) with its random draws in another order than a sampler without reuse would:
            reuse decides what is left to prefill.
            None picks 2 on a CPU and no limit elsewhere (where a padded prefill costs little and every extra
            batch costs its decode steps); 0 means no limit.
        decode: how the decode steps after each call's prefill run. "dynamic": the model's own forward pass over a
            cache that grows and sheds rows (any model). "graphs": one CUDA graph replay per step over static
            key/value buffers (`agents.samplers.static_decode`; Llama, Qwen2 or Mistral models on a CUDA device), for
            GPUs, where a small model's step is bound by launching its kernels. "static": the same steps without
            graphs (any device); on a CPU the fastest, since a step is fewer operations than the model's forward
            and its few-row products take the W @ x^T form too (docs/results/throughput.md). "auto": graphs on a
            CUDA device and static elsewhere where the model allows them (`static_decode.choose_decode`: plain Llama,
            Qwen2 or Mistral layers, no sliding window, no LoRA wrappers), else dynamic; logged once at INFO.
        share_prefixes: prefill once, before the call's rows, every prefix that several of its prompts share (a GRPO
            group's identical prompts, the instructions under every prompt), and let the rows reuse its keys and
            values (`_share_prefixes`; needs `cache_tokens` > 0): a group of G rollouts then prefills its prompt
            once instead of G times. False prefills every row apart (the same samples; for parity tests).
        compact_rows: static decoding (``decode`` "static" or "graphs"): once a call's live rows fit a smaller row
            bucket, later steps run that bucket (`StaticDecoder.compact`). False steps the first bucket to the end.
        sdpa_prefill: run the prefill (and the dynamic path's steps) through torch's scaled_dot_product_attention
            where the model's class supports it, even if it was loaded with eager attention, on a CPU without
            copying key/value heads per query head (`kv_cache.choose_prefill_attention`); logged once at INFO.
            False keeps the model's own attention implementation.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_context: int | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        stop_token_ids: Iterable[int] | None = None,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        narrow_rows: int | None = None,
        decode: Literal["auto", "dynamic", "static", "graphs"] = "dynamic",
        pad_limit: float | None = None,
        share_prefixes: bool = True,
        compact_rows: bool = True,
        sdpa_prefill: bool = True,
    ) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self._max_context = int(max_context or getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        if stop_token_ids is None:
            eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
            eos = [eos] if isinstance(eos, int) else list(eos or [])
            stop_token_ids = [*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        """Token ids that end a completion (finish_reason "stop")."""
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(self.stop_token_ids), 0))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # whether the model's cache is plain per-layer keys and values (what reuse and `AppendLayer` handle)
        self._plain = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
        self._store = PrefixStore(cache_tokens) if cache_tokens > 0 and self._plain else None
        self._weights_key: tuple | None = None
        if narrow_rows is not None and narrow_rows < 0:
            raise ValueError(f"narrow_rows must be >= 0, got {narrow_rows}")
        self.narrow_rows = narrow_rows
        """Most rows a CPU linear layer computes as W @ x^T; None: 4 with >= 2 torch threads, else 3."""
        if pad_limit is not None and not (math.isfinite(pad_limit) and (pad_limit == 0 or pad_limit >= 1)):
            raise ValueError(f"pad_limit must be 0 (no limit) or a finite number >= 1, got {pad_limit}")
        self.pad_limit = (2.0 if self.device.type == "cpu" else 0.0) if pad_limit is None else float(pad_limit)
        """Most padded prefill tokens a batch of a call holds per real one, beyond `PAD_SLACK` (0: no limit)."""
        self._choose_decoding(decode, compact_rows=compact_rows, sdpa_prefill=sdpa_prefill)
        self.share_prefixes = share_prefixes
        """Whether prefixes that several prompts of a call share are prefilled once for all (`_share_prefixes`)."""
        self.reused_tokens = 0
        """Prompt tokens whose keys and values came from an earlier call (a running count)."""
        self.prefilled_tokens = 0
        """Prompt tokens run through a prefill forward pass (a running count)."""
        self.shared_prefilled_tokens = 0
        """Of `prefilled_tokens`, those prefilled once for several rows of a call (`_share_prefixes`); rows count
        what they take from such a prefix in `reused_tokens`."""
        self.shared_saved_tokens = 0
        """Prompt tokens a call did not prefill because its rows share them (`share_prefixes`; a running count): the
        tokens its rows would prefill beside what was kept before the call, less those it prefilled."""
        self.decode_steps = 0
        """Decode steps run (one token for every live row of a batch each; a running count)."""
        self.live_row_steps = 0
        """Live rows summed over the decode steps: over `decode_steps`, the average live rows a step."""
        self.stepped_row_steps = 0
        """Rows computed summed over the decode steps: the live rows and, in a static row bucket, the finished or
        unused slots beside them (`compact_rows`); over `decode_steps`, the average rows a step runs."""

    def _choose_decoding(self, decode: str, *, compact_rows: bool, sdpa_prefill: bool) -> None:
        """Sets `decode` (``auto`` chooses, `choose_decode`) and the prefill's attention, each said once at start."""
        if decode not in ("auto", "dynamic", "static", "graphs"):
            raise ValueError(f"decode must be 'auto', 'dynamic', 'static' or 'graphs', got {decode!r}")
        if decode == "auto":
            decode, why = choose_decode(self.model, self.device, plain=self._plain)
            logger.info("sampler decode: %s (%s)", decode, why)
        if decode != "dynamic" and not self._plain:
            raise ValueError(f"decode={decode!r} needs a model whose cache is plain per-layer keys and values")
        self.decode = decode
        """How decode steps run: the model's forward over a growing cache, or static buffers (with CUDA graphs)."""
        graphs = decode == "graphs"
        self._static = None if decode == "dynamic" else StaticDecoder(self.model, graphs=graphs, compact=compact_rows)
        if sdpa_prefill:
            self.prefill_attention, why = choose_prefill_attention(self.model, self.device)
            logger.info("sampler prefill attention: %s (%s)", self.prefill_attention, why)
        else:
            self.prefill_attention = str(getattr(self.model.config, "_attn_implementation", None) or "eager")
        """The attention the prefill runs (`kv_cache.choose_prefill_attention`): "sdpa", "sdpa-grouped" (a CPU's,
        over grouped key/value heads) or the model's own implementation's name."""

    def lever_counts(self) -> dict[str, float]:
        """The running counts of what the decoding levers did (the class's `share_prefixes`, `compact_rows`,
        `sdpa_prefill` and ``max_batch_size``), by name, for a trainer's metrics: rows per batch, decode steps,
        live and stepped rows summed over them, prompt tokens prefilled, and those prefix sharing saved."""
        return {
            "rows_per_batch": float(self.max_batch_size),
            "decode_steps": float(self.decode_steps),
            "live_row_steps": float(self.live_row_steps),
            "stepped_row_steps": float(self.stepped_row_steps),
            "prefilled_tokens": float(self.prefilled_tokens),
            "prefill_tokens_saved": float(self.shared_saved_tokens),
        }

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values are kept for reuse now."""
        return self._store.tokens if self._store is not None else 0

    @property
    def cached_sequences(self) -> list[tuple[int, ...]]:
        """The token ids of every sequence whose keys and values are kept now, least recently used first."""
        entries = self._store.entries.values() if self._store is not None else ()
        return [tuple(kept.tokens.tolist()) for kept in entries]

    def release(self, token_ids: Sequence[int]) -> None:
        """Forget the keys and values kept for a context that will not be extended again.

        Agents call it when a context closes (its episode ended, or an executor's task returned). Every kept
        sequence that is a prefix of `token_ids` goes; sequences of other contexts that only share a prefix
        with it (the same instructions) stay.
        """
        if self._store is not None and len(token_ids):
            self._store.release(np.asarray(token_ids, dtype=np.int64))

    def clear_cache(self) -> None:
        """Forget every kept sequence (done automatically when the model's weights change)."""
        if self._store is not None:
            self._store.clear()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (see the class docstring for what is returned).

        Args:
            prompts: token-id lists, one per row, unpadded. Over-long ones are left-truncated
                (`agents.samplers.overflow` says by how much) and a warning is logged.
            params: sampling parameters for the whole batch.

        Returns:
            One `Completion` per prompt, in order; a row that cannot be generated (empty prompt, ids outside
            the vocabulary, a failing forward pass) is `finish_reason="error"` with the reason in `error`.
        """
        if params.row_seeds is not None and len(params.row_seeds) != len(prompts):
            raise ValueError(f"{len(params.row_seeds)} row seeds for {len(prompts)} prompts")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        self._check_weights()
        results: list[Completion | None] = [None] * len(prompts)
        rows: list[_Row] = []
        for i, prompt in enumerate(prompts):
            try:
                ids = self._check_prompt(prompt)
            except (TypeError, ValueError) as err:
                results[i] = _error(err)
                continue
            if params.max_new_tokens <= 0:
                results[i] = Completion("", (), (), "length")
                continue
            drop = overflow(len(ids), params.max_new_tokens, self.max_context)
            if drop:
                logger.warning("prompt %d: dropped its first %d tokens to fit %d", i, drop, self.max_context)
                ids = ids[drop:]
            rows.append((i, ids, min(params.max_new_tokens, self.max_context - len(ids))))
        rows.sort(key=lambda row: len(row[1]))
        was_training = self.model.training
        self.model.eval()  # a trainer may share the model: sample without dropout, then give it back as it was
        try:
            narrow = self._narrow_limit()
            if self._static is not None:
                self._static.narrow_rows = narrow
            with narrow_linears(self.model, narrow), sampling_attention(self.model, self.prefill_attention):
                apart = self._fresh_tokens([ids for _, ids, _ in rows])  # before the call keeps anything
                prefilled = self.prefilled_tokens
                self._share_prefixes([ids for _, ids, _ in rows])
                for chunk in self._batches(rows):
                    try:
                        completions = self._decode(chunk, params)
                    except Exception as err:  # one bad row must not fail the others: retry each row alone
                        logger.warning("batch of %d failed (%s); retrying its rows one by one", len(chunk), err)
                        completions = [self._decode_alone(row, params) for row in chunk]
                    for row, completion in zip(chunk, completions, strict=True):
                        results[row[0]] = completion
                self.shared_saved_tokens += max(0, apart - (self.prefilled_tokens - prefilled))
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _share_prefixes(self, prompts: list[list[int]]) -> None:
        """Prefill once, and keep, every prefix that several prompts share (the same instructions, a GRPO
        group's identical first prompts) beyond what kept sequences already cover: the rows then reuse it.

        Only the longest shared prefixes are prefilled; the prefixes those share among themselves (the
        instructions under two groups' prompts) are found the same way first. Each stays at least one token
        short of its prompts (a row's first sample needs its last prompt token fed). A failure here costs
        only the reuse: it is logged and the rows prefill everything themselves.
        """
        if self._store is None or len(prompts) < 2 or not self.share_prefixes:
            return
        wanted: set[tuple[int, ...]] = set()
        ordered = sorted(prompts)
        for a, b in zip(ordered, ordered[1:], strict=False):
            n = min(common_length(a, b), len(a) - 1, len(b) - 1)
            if n >= MIN_SHARED_TOKENS and self._match(a[: n + 1])[1] < n:
                wanted.add(tuple(a[:n]))
        longest = [p for p in wanted if not any(len(q) > len(p) and q[: len(p)] == p for q in wanted)]
        if not longest:
            return
        reused, prefilled = self.reused_tokens, self.prefilled_tokens
        try:
            self._share_prefixes([list(p) for p in longest])
            greedy = SamplingParams(max_new_tokens=1, temperature=0.0)  # draws nothing from the random streams
            rows = sorted(((i, list(p), 1) for i, p in enumerate(longest)), key=lambda row: len(row[1]))
            for start in range(0, len(rows), self.max_batch_size):
                self._decode(rows[start : start + self.max_batch_size], greedy)  # keeps each prefix's keys/values
        except Exception as err:
            logger.warning("prefilling %d shared prefixes failed (%s); each row prefills its own", len(longest), err)
        finally:  # the counters speak of the call's rows: a prefix's own reuse is not theirs
            self.shared_prefilled_tokens += self.prefilled_tokens - prefilled
            self.reused_tokens = reused

    def _fresh_tokens(self, prompts: list[list[int]]) -> int:
        """The tokens `prompts` would prefill, each beside the longest kept sequence it starts with (what `_match`
        reuses), the store's recency left as it is."""
        if self._store is None:
            return sum(len(ids) for ids in prompts)
        return sum(
            len(ids) - min(self._store.match(np.asarray(ids, dtype=np.int64), touch=False)[1], len(ids) - 1)
            for ids in prompts
        )

    def _batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """A call's rows (sorted by length) in the batches that run together, `max_batch_size` at most each.

        A batch that prefills in groups (`_grouped`) pads little, so it needs no limit: one batch decodes all its
        rows in one loop of steps, where two batches would take a loop each. Otherwise, with a `pad_limit`, the
        rows are taken by the tokens each must prefill (its prompt less what it reuses) and a batch ends before a
        row that would pad its prefill to more than `pad_limit` times the real tokens and by more than
        `PAD_SLACK` (the row is the widest so far: every row before it would be padded to its length). Each batch
        keeps its rows in the call's order, so a call that fits one batch and needs no split runs exactly as
        without a limit, random draws at a temperature above 0 included.
        """
        size = self.max_batch_size
        last = len(rows) - (len(rows) - 1) // size * size  # the rows of the last, smallest batch by count
        if not self.pad_limit or len(rows) < 2 or self._grouped(last):
            return [rows[start : start + size] for start in range(0, len(rows), size)]
        fresh = [len(ids) - self._match(ids)[1] for _, ids, _ in rows]
        batches: list[list[int]] = [[]]
        real = 0
        for k in sorted(range(len(rows)), key=fresh.__getitem__):
            padded, total = (len(batches[-1]) + 1) * fresh[k], real + fresh[k]
            if batches[-1] and (
                len(batches[-1]) == size or (padded > self.pad_limit * total and padded - total > PAD_SLACK)
            ):
                batches.append([])
                real = 0
            batches[-1].append(k)
            real += fresh[k]
        return [[rows[k] for k in sorted(batch)] for batch in batches]

    def _narrow_limit(self) -> int:
        """Most rows a linear layer computes as W @ x^T in this call (0: none; GPUs never)."""
        if self.device.type != "cpu":
            return 0
        if self.narrow_rows is not None:
            return self.narrow_rows
        return 4 if torch.get_num_threads() >= 2 else 3

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: nothing to condition on")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        return ids

    def _check_weights(self) -> None:
        """Forget every kept sequence if a parameter or the autocast state changed since the last call."""
        if self._store is None:
            return
        device = self.device.type
        key = (
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
            *((id(p), p._version) for p in self.model.parameters()),
        )
        if key != self._weights_key:
            self._store.clear()
            self._weights_key = key

    def _decode_alone(self, row: _Row, params: SamplingParams) -> Completion:
        try:
            return self._decode([row], params)[0]
        except Exception as err:
            return _error(err)

    @torch.inference_mode()
    def _decode(self, rows: list[_Row], params: SamplingParams) -> list[Completion]:
        """Generate for a batch of valid rows; rows leave the batch (and the KV cache) as they finish."""
        n = len(rows)
        generators = None
        if params.row_seeds is not None and params.temperature > 0:
            generators = [torch.Generator(device=self.device) for _ in rows]
            for generator, (i, _, _) in zip(generators, rows, strict=True):
                generator.manual_seed(int(params.row_seeds[i]))
        matches = [self._match(ids) for _, ids, _ in rows]  # (kept sequence or None, its tokens reused)
        reused = [m for _, m in matches]
        lengths, input_ids, attention, positions = prefill_inputs([ids for _, ids, _ in rows], reused, self.pad_id)
        input_ids, attention, positions = (t.to(self.device) for t in (input_ids, attention, positions))
        past, width = attention.shape[1] - input_ids.shape[1], input_ids.shape[1]
        widest = past + width + max(budget for _, _, budget in rows)  # the widest the cache can get
        self.reused_tokens += sum(m for _, m in matches)
        self.prefilled_tokens += sum(lengths)
        reserve = widest if self._static is None else past + width  # static decoding copies the prefill out
        groups = self._prefill_groups(lengths)
        if len(groups) == 1:
            cache = new_cache(self.model, reserve, self._plain)
            if past:
                fill_past(cache, matches, past, past)
            logits = self.model(  # (alive, vocab) after the [:, -1]
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                **{cache_argument(): cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1, :]
        else:
            cache, logits = prefill_apart(
                self.model, groups, lengths, input_ids, attention, positions, matches, reserve
            )
        steps: CacheSteps | StaticSteps = CacheSteps(self.model, cache)
        next_position = positions[:, -1] + 1  # (alive,)
        alive = list(range(n))  # batch row -> index into rows
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        reasons = ["length"] * n
        reorder = self._static is None and (params.temperature <= 0 or generators is not None)  # draws order-free
        stop_window = max((len(s) for s in params.stop), default=0) + 8  # tokens; each decodes to >= 1 char
        while True:
            streams = None if generators is None else [generators[b] for b in alive]
            token, logp = self._sample(logits, params, streams)  # (alive,), (alive,)
            keep, finished = [], []
            for j, (b, t, lp) in enumerate(zip(alive, token.tolist(), logp.tolist(), strict=True)):
                tokens[b].append(t)
                logps[b].append(lp)
                if t in self.stop_token_ids or (params.stop and self._hit_stop(tokens[b][-stop_window:], params)):
                    reasons[b] = "stop"
                elif len(tokens[b]) < rows[b][2]:
                    keep.append(j)
                    continue
                finished.append((b, j))
            for b, j in sorted(finished):  # kept in the rows' order, however the live rows are placed
                self._keep(steps, j, attention[j], rows[b][1] + tokens[b][:-1], matches[b])
            if not keep:
                break
            if len(keep) < len(alive):
                order = steps.select(keep, attention.shape[1], reorder)
                index = torch.tensor(order, device=self.device)
                attention, token, next_position = attention[index], token[index], next_position[index]
                alive = [alive[j] for j in order]
            if self._static is not None and isinstance(steps, CacheSteps):
                steps = StaticSteps(self._static, steps.cache, attention, widest)
            attention = torch.cat([attention, attention.new_ones((len(alive), 1))], dim=1)
            self.decode_steps += 1
            self.live_row_steps += len(alive)
            self.stepped_row_steps += steps.rows
            logits = steps(token, attention, next_position)
            next_position = next_position + 1
        return [self._finish(tokens[b], logps[b], reasons[b], params) for b in range(n)]

    def _match(self, ids: list[int]) -> tuple[KeptSequence | None, int]:
        """The kept sequence a prompt reuses, and how many of its tokens: at most all but the prompt's last
        token, whose logits the first sample needs."""
        if self._store is None:
            return None, 0
        kept, common = self._store.match(np.asarray(ids, dtype=np.int64))
        return kept, min(common, len(ids) - 1)

    def _grouped(self, rows: int) -> bool:
        """Whether a batch of `rows` rows prefills in groups of like length (`prefill.prefill_groups`): on a CPU,
        with a plain cache, from `PREFILL_SPLIT_ROWS` rows on."""
        return self.device.type == "cpu" and self._plain and rows >= prefill.PREFILL_SPLIT_ROWS

    def _prefill_groups(self, lengths: list[int]) -> list[list[int]]:
        """A batch's rows in the groups whose prefills run apart (`prefill.prefill_groups`)."""
        return prefill_groups(lengths) if self._grouped(len(lengths)) else [list(range(len(lengths)))]

    def _keep(
        self,
        steps: CacheSteps | StaticSteps,
        j: int,
        attention: torch.Tensor,
        fed: list[int],
        match: tuple[KeptSequence | None, int],
    ) -> None:
        """Keep the keys and values of live row `j` of `steps`, which just finished (its unpadded columns in
        `attention`, one per token of `fed`); they supersede the kept sequence the row reused if `fed` extends it."""
        if self._store is None:
            return
        tokens = np.asarray(fed, dtype=np.int64)
        if match[0] is not None and is_prefix(match[0].tokens, tokens):
            self._store.discard(match[0])
        if len(fed) > self._store.max_tokens:
            return
        columns = attention.nonzero().squeeze(-1)  # (len(fed),)
        self._store.add(KeptSequence(tokens, *steps.row(j, columns)))

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row from (rows, vocab) logits; return it and its sampling log-prob.

        `generators`: one per row (from `SamplingParams.row_seeds`); None draws every row from the sampler's own.
        Draws use `torch.multinomial` (an exponential race over the vocabulary). An inverse-CDF draw (one
        uniform number against the cumulative probabilities) is 8x cheaper, but over a high-entropy distribution
        a 1e-5 rounding difference moves a cumulative boundary past the draw: a cached context then samples
        other tokens than its full re-encode (measured with the untrained SmolLM2, `benchmarks.rollout`).
        """
        logits = logits.float()
        if params.temperature <= 0:
            logp_all = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        else:
            scores = logits / params.temperature
            if params.top_p < 1.0:
                scores = _top_p_filter(scores, params.top_p)
            logp_all = torch.log_softmax(scores, dim=-1)
            probs = logp_all.exp()
            if not bool(torch.isfinite(probs).all()):
                raise ValueError("the logits give non-finite probabilities; nothing to sample from")
            if generators is None:
                token = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
            else:  # each row draws from its own stream, so its sample does not depend on its batch
                draws = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
                token = torch.cat(draws)
        return token, logp_all.gather(-1, token[:, None]).squeeze(-1)

    def _hit_stop(self, tail: list[int], params: SamplingParams) -> bool:
        text = self._tokenizer.decode(tail, skip_special_tokens=True)
        return any(s and s in text for s in params.stop)

    def _finish(self, tokens: list[int], logps: list[float], reason: str, params: SamplingParams) -> Completion:
        ended_on_token = reason == "stop" and tokens[-1] in self.stop_token_ids
        try:
            text = self._tokenizer.decode(tokens[:-1] if ended_on_token else tokens, skip_special_tokens=True)
        except Exception as err:  # a tokenizer that cannot decode what the model wrote: keep the tokens
            return Completion("", tuple(tokens), tuple(logps), "error", f"decode failed: {err!r}")
        text, _ = cut_at_stop(text, params.stop)
        return Completion(text, tuple(tokens), tuple(logps), reason)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every token outside the smallest set whose probability mass reaches top_p."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before the token already reaches top_p
    mask = torch.zeros_like(outside).scatter(-1, order, outside)
    return scores.masked_fill(mask, float("-inf"))


def _error(err: BaseException) -> Completion:
    return Completion("", (), (), "error", f"{type(err).__name__}: {err}")
