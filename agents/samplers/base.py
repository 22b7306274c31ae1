"""What every sampler shares: the `Sampler` protocol, the tokenizer's chat context, a wrapper base, and the helpers
the backends use (`overflow`, `cut_at_stop`, `encode_chat`). `agents.samplers` re-exports each name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from agents.records import Completion, SamplingParams

__all__ = ["Sampler", "SamplerWrapper", "TokenizerContext", "cut_at_stop", "encode_chat", "overflow"]


@runtime_checkable
class Sampler(Protocol):
    """Batched generation from token-id prompts."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer whose ids the prompts and completions use."""
        ...

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + completion) one row may hold; longer prompts are left-truncated."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt.

        Args:
            prompts: token-id lists, one per row (not padded).
            params: sampling parameters shared by the batch.

        Returns:
            One `Completion` per prompt, in order.
        """
        ...


class TokenizerContext:
    """The `Sampler` protocol's `tokenizer` and `max_context`, for backends that set ``_tokenizer`` and
    ``_max_context`` when they are built."""

    _tokenizer: Any
    _max_context: int

    @property
    def tokenizer(self) -> Any:
        """The tokenizer whose ids prompts and completions use."""
        return self._tokenizer

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + completion) one row may hold; longer prompts are left-truncated."""
        return self._max_context


class SamplerWrapper:
    """A `Sampler` around another one: the wrapped sampler's tokenizer, context and extra methods (such as
    `load_weights`) pass through; subclasses override `generate` to observe the calls (timing, counting)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        return self.inner.generate(prompts, params)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def overflow(prompt_len: int, max_new_tokens: int, max_context: int) -> int:
    """How many tokens a sampler drops from the left of a prompt so prompt + max_new_tokens fits the context.

    At least one prompt token is always kept; generation then also stops at `max_context` tokens in all. An agent
    records the count: ``overflow(len(prompt), params.max_new_tokens, sampler.max_context)`` is its
    `Generation.truncated_tokens`.
    """
    budget = max(1, max_context - max_new_tokens)
    return max(0, prompt_len - budget)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cut `text` right after the earliest occurrence of any stop string.

    Returns:
        (text up to and including the stop string, whether one was found).
    """
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    return (text[: min(ends)], True) if ends else (text, False)


def encode_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: `{"role": ..., "content": ...}` dicts in order.
        add_generation_prompt: end with the assistant-turn header, ready for sampling.

    Returns:
        The token ids, without any extra special tokens beyond what the template writes.
    """
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
