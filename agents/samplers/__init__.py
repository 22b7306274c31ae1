"""Samplers: batched generation from token-id prompts, one protocol, three backends.

Agents own their contexts as token ids (so the loss mask is exact) and hand a batch of them to a `Sampler`, which
returns one `Completion` per prompt: the sampled token ids, their sampling log-probs, the decoded text (cut right
after the first stop string) and why it ended. A row that fails becomes `Completion(finish_reason="error",
error=...)`; the batch itself never fails.

Backends (imported lazily, so `import agents.samplers` loads neither torch nor vllm):
- `HFSampler` (agents.samplers.hf): transformers, CPU or GPU, the default.
- `VLLMSampler` (agents.samplers.vllm_engine): vLLM on a GPU, with weight sync from a trainer.
- `OpenAISampler` (agents.samplers.openai_api): any OpenAI-compatible `/v1/completions` endpoint.

State across calls: a sampler may keep per-context state (`HFSampler` keeps each context's KV cache, so a later
turn prefills only the new tokens) and then also offers `release(token_ids)`, which agents call when a context
closes (`SamplerWrapper` passes it on); results depend on that state only by float rounding. A prompt is
left-truncated so that prompt + `max_new_tokens` fits the sampler's `max_context` (`overflow`: by how much).

    from agents.models import load_model
    from agents.records import SamplingParams
    from agents.samplers import HFSampler, encode_chat

    sampler = HFSampler(*load_model())
    prompt = encode_chat(sampler.tokenizer, [{"role": "user", "content": "Who wrote Dune?"}])
    [completion] = sampler.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agents.records import Completion, SamplingParams

if TYPE_CHECKING:
    from agents.samplers.hf import HFSampler
    from agents.samplers.openai_api import OpenAISampler
    from agents.samplers.vllm_engine import VLLMSampler

__all__ = [
    "Sampler",
    "SamplerWrapper",
    "TokenizerContext",
    "HFSampler",
    "VLLMSampler",
    "OpenAISampler",
    "encode_chat",
    "overflow",
    "cut_at_stop",
]

_LAZY = {
    "HFSampler": "agents.samplers.hf",
    "VLLMSampler": "agents.samplers.vllm_engine",
    "OpenAISampler": "agents.samplers.openai_api",
}


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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
