"""A recording stand-in for vLLM, for contract tests of `agents.samplers.vllm_engine` on machines without a GPU.

It has exactly the surface `VLLMSampler` uses: `LLM(model=..., seed=..., max_model_len=..., **kwargs)`,
`get_tokenizer`, `generate(prompts, sampling_params=...)` over `inputs.TokensPrompt` and `SamplingParams`,
`llm_engine.model_config.max_model_len`, `collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
"is_checkpoint_format": True})`, `reset_prefix_cache`, and the model runner's ``reload_weights`` signature
(`v1.worker.gpu_model_runner`); plus the names TorchRL imports when it finds a package called vllm
(`outputs.RequestOutput`, `sampling_params.SamplingParams`). The engine loads its own copy of the model from the
directory it is given and samples with it through `HFSampler`: like a real engine it samples from the weights it holds
until new ones are loaded. Every weight reload is recorded (`LLM.loads`; with ``REDCODA_RECORD_PUSHES=DIR`` also
written to ``DIR/rank<RANK>-push<k>.safetensors``, and each engine's arguments to ``DIR/rank<RANK>-engine.json``, for
runs in other processes).

It stands in for the call-order contract only: tests/test_vllm_real.py runs the same code against the real engine.

Put this folder first on the path (``PYTHONPATH=tests/stubs``) to use it; it is never installed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

from vllm import inputs, outputs  # noqa: F401  (submodules TorchRL imports, as sampling_params below)
from vllm.sampling_params import SamplingParams

ENGINES: list[LLM] = []
"""Every engine built in this process, oldest first."""


class LLM:
    """Stands in for `vllm.LLM`: loads the model at `model`, samples with its own copy, records weight loads."""

    def __init__(self, model: str, seed: int = 0, max_model_len: int | None = None, **kwargs: Any) -> None:
        from agents.models import load_model
        from agents.samplers.hf import HFSampler

        self.kwargs = {"model": model, "seed": seed, "max_model_len": max_model_len, **kwargs}
        self.lm, self.tokenizer = load_model(model, dtype=torch.float32, device="cpu")
        self.sampler = HFSampler(self.lm, self.tokenizer, seed=seed, decode="dynamic")
        self.loads: list[dict[str, torch.Tensor]] = []
        self.prefix_resets = 0
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_model_len or self.lm.config.max_position_embeddings),
        )
        ENGINES.append(self)
        record = os.environ.get("REDCODA_RECORD_PUSHES")
        if record:
            import json

            rank = os.environ.get("RANK", "0")
            with open(os.path.join(record, f"rank{rank}-engine.json"), "w") as f:
                json.dump({k: v for k, v in self.kwargs.items() if k != "model"}, f)

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker method; the stand-in's one worker knows ``reload_weights`` only."""
        if method != "reload_weights":
            raise AttributeError(f"the stand-in's worker has no method {method!r}")
        kwargs = dict(kwargs or {})
        if not kwargs.pop("is_checkpoint_format", True):
            raise ValueError("the stand-in reloads checkpoint-format weights only")
        return [self._load_weights(kwargs.pop("weights_iterator"))]

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _load_weights(self, weights: Any) -> set[str]:
        received = {name: tensor.detach().clone() for name, tensor in weights}
        self.loads.append(received)
        own = dict(self.lm.named_parameters())
        with torch.no_grad():
            for name, tensor in received.items():
                own[name].copy_(tensor)  # a name or shape the engine lacks fails here, as vLLM's loader would
        record = os.environ.get("REDCODA_RECORD_PUSHES")
        if record:
            from safetensors.torch import save_file

            rank = os.environ.get("RANK", "0")
            save_file(received, os.path.join(record, f"rank{rank}-push{len(self.loads)}.safetensors"))
        return set(received)

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1
        self.sampler.clear_cache()

    def generate(self, prompts: list[Any], sampling_params: list[SamplingParams], use_tqdm: bool = False) -> list[Any]:
        from agents.records import SamplingParams as Ours

        results = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ours = Ours(
                max_new_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                stop=tuple(params.stop),
                seed=params.seed,
            )
            [c] = self.sampler.generate([prompt["prompt_token_ids"]], ours)
            logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
            sample = SimpleNamespace(
                token_ids=c.token_ids, logprobs=logprobs, text=c.text, finish_reason=c.finish_reason
            )
            results.append(outputs.RequestOutput(outputs=[sample]))
        return results
