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

from typing import TYPE_CHECKING, Any

from agents.samplers.base import Sampler, SamplerWrapper, TokenizerContext, cut_at_stop, encode_chat, overflow

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
