"""`Sampler` on a vLLM engine (GPU), with weight sync from a trainer in the same process.

vLLM is imported only when a `VLLMSampler` is built. The engine runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set unless the caller set it) so `load_weights` can reach the model
object and copy a trainer's parameters into it, the colocated setup of TRL and veRL. Log-probs are asked
for in vLLM's `processed_logprobs` mode (after temperature and top-p), matching `HFSampler`; vLLM
versions without that option return the model's raw log-probs and a warning says so.

Not exercised by the CPU test suite; the `gpu` marker is for a machine with vLLM and CUDA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from agents.records import Completion, SamplingParams
from agents.samplers import TokenizerContext, cut_at_stop, overflow

logger = logging.getLogger(__name__)


class VLLMSampler(TokenizerContext):
    """`Sampler` backed by `vllm.LLM`.

    Args:
        model: None for the bundled SmolLM2-135M-Instruct (its converted cache), a local directory or a
            Hugging Face hub id.
        max_context: the engine's `max_model_len`; None lets vLLM take the model's.
        seed: the engine's seed (a call's `SamplingParams.seed` seeds each request: row i gets seed + i, or
            `SamplingParams.row_seeds[i]` when given).
        gpu_memory_utilization: share of GPU memory vLLM may take (leave room for a colocated trainer).
        **llm_kwargs: passed to `vllm.LLM` (dtype, enforce_eager, tensor_parallel_size, ...).

    Raises:
        ImportError: vLLM is not installed.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        max_context: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "VLLMSampler needs vLLM and a CUDA GPU: `pip install 'redcoda[vllm]'` (or use HFSampler)"
            ) from err
        from agents.models import ensure_smollm2_cache, fix_pad_token

        if model is None or str(model).lower() in ("smollm2-135m", "smollm2-135m-instruct"):
            model = ensure_smollm2_cache()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = dict(model=str(model), seed=seed, gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)
        if max_context is not None:
            kwargs["max_model_len"] = max_context
        kwargs.setdefault("logprobs_mode", "processed_logprobs")
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError:  # a vLLM older than logprobs_mode
            kwargs.pop("logprobs_mode")
            logger.warning("this vLLM has no logprobs_mode: log-probs are the model's, before temperature/top-p")
            self.llm = vllm.LLM(**kwargs)
        self._tokenizer = self.llm.get_tokenizer()
        fix_pad_token(None, self._tokenizer)
        self._max_context = int(self.llm.llm_engine.model_config.max_model_len)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (same contract as `HFSampler.generate`).

        Args:
            prompts: token-id lists, one per row; over-long ones are left-truncated.
            params: sampling parameters for the whole batch.

        Returns:
            One `Completion` per prompt, in order.
        """
        import vllm
        from vllm.inputs import TokensPrompt

        results: list[Completion | None] = [None] * len(prompts)
        requests: list[tuple[int, Any, Any]] = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                results[i] = Completion("", (), (), "error", "ValueError: empty prompt: nothing to condition on")
                continue
            ids = ids[overflow(len(ids), params.max_new_tokens, self.max_context) :]
            sampling = vllm.SamplingParams(
                n=1,
                max_tokens=max(1, min(params.max_new_tokens, self.max_context - len(ids))),
                temperature=params.temperature,
                top_p=params.top_p,
                stop=list(params.stop),
                include_stop_str_in_output=True,
                logprobs=0,  # the sampled token's log-prob only
                seed=_row_seed(params, i),
            )
            requests.append((i, TokensPrompt(prompt_token_ids=ids), sampling))
        try:
            outputs = self._run(requests)
        except Exception as err:  # one bad row must not fail the others: retry each row alone
            logger.warning("vLLM batch failed (%s); retrying its rows one by one", err)
            outputs = [self._run_alone(request) for request in requests]
        for (i, _, _), output in zip(requests, outputs, strict=True):
            results[i] = output if isinstance(output, Completion) else _completion(output, params)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _run(self, requests: list[tuple[int, Any, Any]]) -> list[Any]:
        if not requests:
            return []
        return self.llm.generate([r[1] for r in requests], sampling_params=[r[2] for r in requests], use_tqdm=False)

    def _run_alone(self, request: tuple[int, Any, Any]) -> Any:
        try:
            return self._run([request])[0]
        except Exception as err:
            return Completion("", (), (), "error", f"{type(err).__name__}: {err}")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy (name, tensor) pairs, e.g. `trainer_model.state_dict().items()`, into the engine's model.

        Names are the Hugging Face ones; vLLM's `load_weights` maps them onto its fused layers. The
        prefix cache is reset afterwards, since cached KV entries came from the old weights.
        """
        model = self._engine_model()
        if model is not None:
            model.load_weights(weights=iter(weights))
        elif hasattr(self.llm, "apply_model"):
            items = list(weights)
            self.llm.apply_model(lambda m: m.load_weights(weights=iter(items)))
        else:
            raise RuntimeError(
                "cannot reach the vLLM model to load weights: keep VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "(the engine must run in this process) or use a vLLM with LLM.apply_model"
            )
        self.llm.reset_prefix_cache()

    def _engine_model(self) -> Any:
        """The engine's torch model when it lives in this process (vLLM V1 first, then V0), else None."""
        worker = getattr(getattr(self.llm.llm_engine, "model_executor", None), "driver_worker", None)
        for runner_owner in (getattr(worker, "worker", None), worker):
            model = getattr(getattr(runner_owner, "model_runner", None), "model", None)
            if model is not None and hasattr(model, "load_weights"):
                return model
        return None


def _completion(output: Any, params: SamplingParams) -> Completion:
    """Turn a `vllm.RequestOutput` into a `Completion`."""
    sample = output.outputs[0]
    token_ids = tuple(int(t) for t in sample.token_ids)
    if sample.logprobs:
        logprobs = tuple(float(step[t].logprob) for t, step in zip(token_ids, sample.logprobs, strict=True))
    else:
        logprobs = (float("nan"),) * len(token_ids)
    reason = {"stop": "stop", "length": "length"}.get(sample.finish_reason or "", "error")
    text, _ = cut_at_stop(sample.text, params.stop)
    error = None if reason != "error" else f"vLLM finish_reason {sample.finish_reason!r}"
    return Completion(text, token_ids, logprobs, reason, error)


def _row_seed(params: SamplingParams, i: int) -> int | None:
    """Request i's seed: its own row seed, else the call's seed + i, else None."""
    if params.row_seeds is not None:
        return int(params.row_seeds[i])
    return None if params.seed is None else params.seed + i
