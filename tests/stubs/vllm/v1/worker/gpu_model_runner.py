"""`vllm.v1.worker.gpu_model_runner` of the recording stand-in: the model runner's ``reload_weights`` signature, which
`agents.samplers.vllm_engine` checks before it builds an engine (vLLM >= 0.16 takes a weights iterator)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class GPUModelRunner:
    """Only the method whose signature the sampler checks."""

    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, Any]] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        raise NotImplementedError("the stand-in's engine reloads through LLM.collective_rpc")
