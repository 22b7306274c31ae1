"""One function that builds a `Sampler` by name, for the trainers and the evaluation CLI alike.

- hf: the model object itself through transformers (`HFSampler`); it shares the trainer's weights, nothing to copy.
- vllm: a vLLM engine in this process (`VLLMSampler`) with its own copy of the weights, refreshed by `load_weights`.
- openai: an OpenAI-compatible completions server (`OpenAISampler`); a served model, which no weights reach.

Example: ``make_sampler("vllm", tokenizer=None, source="Qwen/Qwen2.5-3B-Instruct", max_context=4096)``.
"""

from __future__ import annotations

import os
from typing import Any, Literal

SamplerKind = Literal["hf", "vllm", "openai"]
SAMPLER_KINDS: tuple[str, ...] = ("hf", "vllm", "openai")


def make_sampler(
    kind: str,
    *,
    tokenizer: Any,
    max_context: int,
    seed: int = 0,
    model: Any = None,
    source: str | os.PathLike | None = None,
    max_batch_size: int = 64,
    decode: str = "auto",
    dtype: str | None = None,
    gpu_memory_utilization: float = 0.4,
    kv_cache_gib: float | None = None,
    url: str | None = None,
    served_model: str | None = None,
    timeout_s: float = 120.0,
    retries: int = 3,
) -> Any:
    """A sampler of the given kind.

    Args:
        kind: hf, vllm or openai.
        tokenizer: the model's tokenizer (hf, openai; vllm reads the tokenizer at `source`).
        max_context: tokens a row may hold (prompt and completion).
        seed: the sampler's seed.
        model: hf: the loaded causal LM to sample from.
        source: vllm: the Hugging Face directory or hub id the engine builds its model from (its weights are then
            replaced by `load_weights`); openai: unused.
        max_batch_size: hf: rows per forward pass.
        decode: hf: its decode steps (auto, dynamic, static, graphs).
        dtype: vllm: the engine's dtype (None: the model config's).
        gpu_memory_utilization: vllm: share of the GPU the engine may take.
        kv_cache_gib: vllm: the engine's KV cache in GiB instead of a share of the device's memory; None: the share.
        url: openai: the API root, e.g. http://127.0.0.1:8000/v1.
        served_model: openai: the model name the server expects (None: `source`).
        timeout_s: openai: the whole-request deadline of each generation, retries included.
        retries: openai: retries of a failed request.

    Raises:
        ValueError: an unknown kind, or a missing argument that kind needs (one line, naming it).
        ImportError: vllm without vLLM installed (with the install hint).
    """
    if kind == "hf":
        if model is None:
            raise ValueError("the hf sampler needs the loaded model")
        from agents.samplers.hf import HFSampler

        return HFSampler(
            model, tokenizer, max_context=max_context, max_batch_size=max_batch_size, seed=seed, decode=decode
        )
    if kind == "vllm":
        from agents.samplers.vllm_engine import VLLMSampler

        kwargs: dict[str, Any] = {"dtype": dtype} if dtype else {}
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        return VLLMSampler(
            source, max_context=max_context, seed=seed, gpu_memory_utilization=gpu_memory_utilization, **kwargs
        )
    if kind == "openai":
        if not url:
            raise ValueError(
                "--sampler openai needs --sampler-url (the server's API root, e.g. http://127.0.0.1:8000/v1)"
            )
        from agents.samplers.openai_api import OpenAISampler

        return OpenAISampler(
            url,
            str(served_model or source or "default"),
            tokenizer,
            max_context=max_context,
            timeout_s=timeout_s,
            max_retries=retries,
        )
    raise ValueError(f"unknown sampler {kind!r}; choose one of {', '.join(SAMPLER_KINDS)}")
