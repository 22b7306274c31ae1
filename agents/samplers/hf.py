"""Batched sampling with a transformers causal LM (CPU or GPU): the default `Sampler`.

The decoding loop is our own rather than `model.generate`, because the agents need three things
`generate` does not give together: per-row stop strings with the row removed from the batch as soon as it
stops (its KV-cache rows are dropped, so a batch costs what its live rows cost), the log-prob of every
sampled token under the exact distribution it was sampled from, and a batch that survives a bad row.

Each call left-pads the prompts (sorted by length, in chunks of `max_batch_size`), runs one prefill
forward pass, then one forward pass per new token over the rows still alive, reusing the KV cache.
Greedy output matches `model.generate(do_sample=False)` token for token, at about the same speed.

Speed on a CPU shared with other processes: torch's default of one OpenMP thread per core can be many
times slower than `torch.set_num_threads(1)` (threads spin-wait on each other when the cores are busy).
The sampler leaves that process-wide choice to the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from agents.records import Completion, SamplingParams
from agents.samplers import cut_at_stop, overflow

logger = logging.getLogger(__name__)

_Row = tuple[int, list[int], int]  # (index in the call, prompt ids after truncation, max new tokens)


class HFSampler:
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
        seed: seed of the sampler's random generator (a call's `SamplingParams.seed` reseeds it).
        stop_token_ids: token ids that end a completion; None means the generation config's EOS ids plus
            the tokenizer's EOS id.
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

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer whose ids prompts and completions use."""
        return self._tokenizer

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + completion) one row may hold."""
        return self._max_context

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
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
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
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                try:
                    completions = self._decode(chunk, params)
                except Exception as err:  # one bad row must not fail the others: retry each row alone
                    logger.warning("batch of %d failed (%s); retrying its rows one by one", len(chunk), err)
                    completions = [self._decode_alone(row, params) for row in chunk]
                for row, completion in zip(chunk, completions, strict=True):
                    results[row[0]] = completion
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: nothing to condition on")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        return ids

    def _decode_alone(self, row: _Row, params: SamplingParams) -> Completion:
        try:
            return self._decode([row], params)[0]
        except Exception as err:
            return _error(err)

    @torch.inference_mode()
    def _decode(self, rows: list[_Row], params: SamplingParams) -> list[Completion]:
        """Generate for a batch of valid rows; rows leave the batch (and the KV cache) as they finish."""
        n = len(rows)
        width = max(len(ids) for _, ids, _ in rows)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for b, (_, ids, _) in enumerate(rows):
            input_ids[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[b, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (n, width): left padding shifts no position
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_position = positions[:, -1] + 1  # (alive,)
        alive = list(range(n))  # batch row -> index into rows
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        reasons = ["length"] * n
        stop_window = max((len(s) for s in params.stop), default=0) + 8  # tokens; each decodes to >= 1 char
        while True:
            token, logp = self._sample(out.logits[:, -1, :], params)  # (alive,), (alive,)
            keep = []
            for j, (b, t, lp) in enumerate(zip(alive, token.tolist(), logp.tolist(), strict=True)):
                tokens[b].append(t)
                logps[b].append(lp)
                if t in self.stop_token_ids or (params.stop and self._hit_stop(tokens[b][-stop_window:], params)):
                    reasons[b] = "stop"
                elif len(tokens[b]) < rows[b][2]:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(alive):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                attention, token, next_position = attention[index], token[index], next_position[index]
                alive = [alive[j] for j in keep]
            attention = torch.cat([attention, attention.new_ones((len(alive), 1))], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_position = next_position + 1
        return [self._finish(tokens[b], logps[b], reasons[b], params) for b in range(n)]

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row from (rows, vocab) logits; return it and its sampling log-prob."""
        logits = logits.float()
        if params.temperature <= 0:
            logp_all = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        else:
            scores = logits / params.temperature
            if params.top_p < 1.0:
                scores = _top_p_filter(scores, params.top_p)
            logp_all = torch.log_softmax(scores, dim=-1)
            token = torch.multinomial(logp_all.exp(), 1, generator=self._generator).squeeze(-1)
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
