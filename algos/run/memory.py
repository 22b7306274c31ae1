"""How much memory a training run needs on each device, estimated before it starts.

`estimate` adds up, per device, what a step holds at its peak: the policy's weights, their gradients and AdamW's two
moments (divided over the ranks under ``--fsdp``, whose sampling also holds the whole weights gathered), a frozen
reference model when the KL term is on, the activations the backward pass keeps for one micro-batch
(``micro_batch_tokens`` tokens; one layer's plus each layer's input under ``--gradient-checkpointing``), the logits
of that micro-batch, and the sampler: the transformers sampler's key/value cache for its widest batch of rows
(`sampler_rows`) at the full context and the keys and values it keeps between calls (`KEPT_CACHE_TOKENS`), or the
share of the GPU a vLLM engine is given; on a CPU, the copy of the weights and AdamW state a checkpoint is written
from beside the next steps. After the last step the held-out evaluation (`evaluation_bytes`) scores a second copy of
the start model with a sampler of its own, its batch of rows at the full context; where that exceeds what the step's
activations, logits and rollouts freed, the excess is a part of its own. On a CPU the evaluation's rows are bounded
by memory (`evaluation_rows`: the trainer's evaluation runs at most that many at a time). `check` compares the sum
with the device's memory (a GPU's total, or the host's available memory shared by the ranks on it) and raises
`DoesNotFit` in one line.

The activation count per token and layer follows the usual accounting for a pre-norm decoder layer with fused
attention (no (sequence x sequence) score matrix kept): the inputs of the norms, of the q/k/v, output, gate, up
and down projections and of the activation function. It is an estimate: allocator fragmentation, temporary
buffers and CUDA's own context (about 0.5 GiB) come on top, hence the margin `check` leaves.

    python -m algos.run.memory --model Qwen/Qwen2.5-3B-Instruct --preset gpu --gradient-checkpointing
    python -m algos.run.memory --preset cpu --top-k 5 --max-passage-words 80 --eval-batch-size 100
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MARGIN = 0.9
"""Share of a device's memory the estimate may fill (the rest: allocator fragmentation, temporaries, CUDA context)."""


class DoesNotFit(RuntimeError):
    """A run whose memory estimate exceeds its device's memory; the message says what would make it fit."""


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only causal LM that its memory depends on."""

    parameters: int
    """Distinct parameters (tied embeddings counted once)."""
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int
    """Keys' width per token and layer: key/value heads x head size."""

    @classmethod
    def of(cls, model_config: Any, parameters: int | None = None) -> Shape:
        """The shape of a Hugging Face model config; `parameters` counted on a meta-device copy when not given."""
        hidden = int(model_config.hidden_size)
        heads = int(model_config.num_attention_heads)
        head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
        if parameters is None:
            parameters = count_parameters(model_config)
        return cls(
            parameters=parameters,
            layers=int(model_config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(getattr(model_config, "intermediate_size", 4 * hidden)),
            vocab=int(model_config.vocab_size),
            kv_dim=kv_heads * head_dim,
        )


def count_parameters(model_config: Any) -> int:
    """Distinct parameters of the model `model_config` builds, counted on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


@dataclass(frozen=True)
class Estimate:
    """Bytes per device, by component."""

    parts: dict[str, float]
    device: str
    eval_rows: int | None = None
    """Episodes the held-out evaluation runs at a time (None: it has none)."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        """One line: the total and each part, in GiB."""
        parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.parts.items() if value)
        rows = f"; held-out evaluation {self.eval_rows} episodes at a time" if self.eval_rows else ""
        return f"{self.total / GIB:.2f} GiB per {self.device} ({parts}{rows})"


ROLLOUT_BYTES_PER_TOKEN = 64
"""Host bytes a step's rollouts hold per context token, at most: the collated batch's ids, attention and loss masks,
old log-probs and weights (about 25), TorchRL's keys where a batch is handed to TorchRL (about 10 more:
`agents.torchrl_layout`; the training step no longer writes them, so this is a bound with room) and the trajectory
records they come from (tuples of Python ints and floats)."""


EPISODE_BYTES = 32 * 1024
"""Host bytes of one episode's env beside its tokens (measured: 500 ``gym.make`` HotpotQA envs took 31 KB each)."""

KEPT_CACHE_TOKENS = 1 << 16
"""Tokens whose keys and values a transformers sampler keeps between calls (`agents.samplers.hf.DEFAULT_CACHE_TOKENS`,
the trainer's and the evaluation's samplers alike)."""


def _compute_bytes(config: Any) -> int:
    return 2 if (config.model.use_bf16 or config.model.param_dtype == "bfloat16") else 4


def _kv_bytes_per_token(config: Any, shape: Shape) -> int:
    """Keys and values of one token over every layer."""
    return shape.layers * 2 * shape.kv_dim * _compute_bytes(config)


def _evaluation_episodes(config: Any) -> int:
    """Questions the run scores at the end (held-out or validation), one per episode."""
    return max(int(config.run.eval_questions or 0), int(config.run.validation_questions or 0))


SAMPLER_ROWS = (64, 128, 256)
"""Rows per transformers-sampler batch that `sampler_rows` chooses among on a GPU; the first is a CPU's."""


def sampler_rows(
    config: Any, shape: Shape, capacity: float | None, *, ranks: int = 1, trainable: int | None = None
) -> tuple[int, str]:
    """Rows per transformers-sampler batch for a run of `config` (``--sampler-batch-size``; None chooses), and why.

    A GPU decode step reads every weight once for all the rows it runs (CUDA graphs replay one per row bucket up to
    this size), so a step's tokens grow with its rows at about the same cost until the keys and values it also
    reads catch up: more rows a batch, closer to the memory-bandwidth bound. None takes, on a GPU, the most of
    `SAMPLER_ROWS` that this rank's episodes can fill (a bucket above its episodes would stay half empty) and whose
    run still fits: the whole `estimate` with that many rows at the full context within `MARGIN` of `capacity`
    (the free memory, `usable_memory`). Without a `capacity` (a plan made elsewhere) the most its episodes fill, an
    upper bound. On a CPU `SAMPLER_ROWS[0]`: a CPU's step cost grows with its rows, and its runs keep their numbers.
    """
    if config.model.sampler_batch_size is not None:
        return int(config.model.sampler_batch_size), "--sampler-batch-size"
    if not config.model.torch_device.startswith("cuda"):
        return SAMPLER_ROWS[0], "a CPU's"
    episodes = max(1, config.rl.questions_per_step * config.rl.group_size // ranks)
    fill = 1 << max(episodes - 1, 0).bit_length()  # the row bucket of this rank's episodes
    candidates = [rows for rows in SAMPLER_ROWS if rows == SAMPLER_ROWS[0] or rows <= fill]
    if capacity is None:
        return candidates[-1], f"the most {episodes} episodes fill (no memory reading: an upper bound)"
    usable = MARGIN * capacity
    for rows in reversed(candidates):
        need = estimate(with_sampler_rows(config, rows), shape, ranks=ranks, trainable=trainable).total
        if need <= usable:
            left = "" if rows == candidates[-1] else f"; {candidates[-1]} would not fit"
            return rows, (
                f"{episodes} episodes a step; the run's estimate with {rows} rows {need / GIB:.1f} of "
                f"{usable / GIB:.1f} GiB usable{left}"
            )
    return SAMPLER_ROWS[0], f"none larger fits in {usable / GIB:.1f} GiB usable (the memory check says if this does)"


def with_sampler_rows(config: Any, rows: int) -> Any:
    """`config` with ``--sampler-batch-size`` set to `rows`."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, sampler_batch_size=rows))


def evaluation_row_bytes(config: Any, shape: Shape) -> float:
    """Bytes one episode of the held-out evaluation holds at most: each of its contexts (CoDA: the planner's and one
    executor's) at the full context length, as keys and values, the prefill's widest layer activations (the inputs
    of the norms, projections and activation; no gradient) and the token lists around them, its last logits, and
    its env."""
    contexts = 2 if config.env.protocol == "coda" else 1
    per_token = (
        _kv_bytes_per_token(config, shape)
        + (4 * shape.hidden + 3 * shape.intermediate) * _compute_bytes(config)
        + ROLLOUT_BYTES_PER_TOKEN
    )
    return contexts * (config.model.max_context_tokens * per_token + shape.vocab * 4) + EPISODE_BYTES


def evaluation_bytes(config: Any, shape: Shape, rows: int, *, model_loaded: bool = False) -> dict[str, float]:
    """What the held-out evaluation holds besides the training state, `rows` episodes at a time: the model it scores
    (the start model is a second copy; none when `model_loaded`), its sampler's kept keys and values, the rows."""
    parts = {
        "model": 0.0 if model_loaded else shape.parameters * (2 if config.model.param_dtype == "bfloat16" else 4),
        "kept kv cache": KEPT_CACHE_TOKENS * _kv_bytes_per_token(config, shape),
        "rows": rows * evaluation_row_bytes(config, shape),
    }
    return parts


def evaluation_rows(
    config: Any, shape: Shape, room: float, *, model_loaded: bool = False, wanted: int | None = None
) -> int:
    """The most episodes the held-out evaluation may run at a time in `room` bytes: `wanted` (default
    ``--eval-batch-size``, or the questions when fewer), fewer where their contexts would not fit, 1 at least."""
    if wanted is None:
        wanted = max(1, min(int(config.run.eval_batch_size), _evaluation_episodes(config) or 1))
    fixed = sum(evaluation_bytes(config, shape, 0, model_loaded=model_loaded).values())
    fit = int((room - fixed) // evaluation_row_bytes(config, shape))
    return max(1, min(wanted, fit))


def estimate(
    config: Any, shape: Shape, *, ranks: int = 1, trainable: int | None = None, capacity: float | None = None
) -> Estimate:
    """The memory one device needs for a run of `config` (an `algos.config.Config`) on a model of `shape`.

    Args:
        config: the run's settings (param_dtype, bf16, fsdp, gradient_checkpointing, micro_batch_tokens, sampler,
            sampler_batch_size, questions_per_step, group_size, protocol, max_planner_turns, max_context_tokens,
            kl_coef). The rollout batch (every context of this rank's episodes at the full context length) is
            counted on the device too: an upper bound where it lives in host memory.
        shape: the model's sizes.
        ranks: data-parallel ranks (the ``--fsdp`` shards and each rank's share of the rollouts).
        trainable: parameters that train (LoRA: the adapter's); None: all of them.
        capacity: the device's bytes: on a CPU the held-out evaluation then runs as many episodes at a time as fit
            in `MARGIN` of it beside what the run holds (`evaluation_rows`); None: ``--eval-batch-size`` of them.
    """
    param_bytes = 2 if config.model.param_dtype == "bfloat16" else 4
    compute_bytes = 2 if (config.model.use_bf16 or config.model.param_dtype == "bfloat16") else 4
    trainable = shape.parameters if trainable is None else trainable
    shards = ranks if (config.run.fsdp and ranks > 1) else 1
    parts: dict[str, float] = {
        "weights": shape.parameters * param_bytes / shards,
        "gradients": trainable * param_bytes / shards,
        "optimizer": 2 * trainable * param_bytes / shards,  # AdamW's two moments, in the weights' dtype
    }
    if _copies_rl_gradient(config):  # --term-grad-norms: the RL term's gradient, kept while the SFT term's adds up
        parts["term gradient copy"] = trainable * param_bytes / shards
    if shards > 1:  # sampling and no-grad scoring hold the whole weights on every rank
        parts["gathered weights"] = shape.parameters * param_bytes * (1 - 1 / shards)
    if config.rl.kl_coef > 0:
        parts["reference model"] = shape.parameters * param_bytes
    tokens = config.optim.micro_batch_tokens
    per_layer = 6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate  # elements kept per token and layer
    if config.optim.gradient_checkpointing:
        kept = shape.layers * shape.hidden + per_layer  # each layer's input, and one layer recomputed at a time
    else:
        kept = shape.layers * per_layer
    parts["activations"] = tokens * kept * compute_bytes
    parts["logits"] = tokens * shape.vocab * 4 * 2  # float32 logits and their log-softmax (or its gradient)
    episodes = max(1, config.rl.questions_per_step * config.rl.group_size // ranks)  # this rank's share of the step
    contexts = episodes * (
        1 + config.env.max_planner_turns if config.env.protocol == "coda" else 1
    )  # CoDA: + executors
    parts["rollout batch"] = (
        contexts * config.model.max_context_tokens * ROLLOUT_BYTES_PER_TOKEN + episodes * EPISODE_BYTES
    )
    if config.model.sampler == "vllm" and config.model.vllm_kv_cache_gib is not None:
        # its own copy of the weights (float32 on a CPU, the build's dtype on a GPU) and the cache it was given
        parts["vllm engine"] = shape.parameters * (4 if config.model.torch_device == "cpu" else compute_bytes)
        parts["vllm engine"] += config.model.vllm_kv_cache_gib * GIB
    elif config.model.sampler == "vllm":
        parts["vllm engine"] = config.model.vllm_gpu_memory_utilization * device_memory(config.model.torch_device)
    else:
        batch, _ = sampler_rows(config, shape, capacity, ranks=ranks, trainable=trainable)
        rows = min(batch, max(1, config.rl.questions_per_step * config.rl.group_size // ranks))
        kv = rows * config.model.max_context_tokens * shape.layers * 2 * shape.kv_dim * compute_bytes
        parts["kv cache"] = kv + rows * shape.vocab * 4
        parts["kept kv cache"] = KEPT_CACHE_TOKENS * _kv_bytes_per_token(config, shape)
    if config.run.save_every and not config.model.torch_device.startswith("cuda"):
        # a checkpoint's copy of the weights and AdamW state (under --fsdp each rank's shards of them), held while
        # it is written beside the next steps (`algos.checkpoints.background`); on a GPU it is in host memory, not
        # the device's
        copies = 3 + (1 if config.optim.weight_average is not None else 0)
        parts["checkpoint copy"] = trainable * param_bytes * copies / shards
    eval_rows = None
    if _evaluation_episodes(config):  # after the last step: the step's activations, logits and rollouts are freed
        freed = parts["activations"] + parts["logits"] + parts["rollout batch"]
        eval_rows = max(1, min(int(config.run.eval_batch_size), _evaluation_episodes(config)))
        if capacity is not None and not config.model.torch_device.startswith("cuda"):
            held = sum(parts.values()) - freed
            eval_rows = evaluation_rows(config, shape, MARGIN * capacity - held)
        evaluating = sum(evaluation_bytes(config, shape, eval_rows).values())
        parts["held-out evaluation"] = max(0.0, evaluating - freed)
    return Estimate(parts, device=_device_name(config.model.torch_device), eval_rows=eval_rows)


def held_out_batch(config: Any, model: Any) -> int:
    """Episodes the held-out evaluation of `model` (a loaded ``(model, tokenizer)`` pair, a directory, None or
    "tiny") runs at a time: ``--eval-batch-size``, on a CPU no more than fit in `MARGIN` of the memory available now
    (`evaluation_rows`); the model's shape read from its config (the bundled model's for None)."""
    batch = int(config.run.eval_batch_size)
    if config.model.torch_device.startswith("cuda"):
        return batch
    loaded = isinstance(model, tuple)
    if loaded:
        lm = model[0]
        shape = Shape.of(lm.config, parameters=sum(p.numel() for p in lm.parameters()))
    else:
        from transformers import AutoConfig

        from agents.models import ensure_smollm2_cache

        source = str(ensure_smollm2_cache()) if model in (None, "None", "none", "smollm2-135m", "tiny") else model
        try:
            shape = Shape.of(AutoConfig.from_pretrained(str(source)))
        except (OSError, ValueError):  # no config to read here: the loader says why when it loads the model
            return batch
    return evaluation_rows(config, shape, MARGIN * usable_memory("cpu"), model_loaded=loaded, wanted=batch)


def device_memory(device: str) -> float:
    """Bytes the device offers one rank: a GPU's total memory, or the host's available memory over its local ranks."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return _available_host_memory() / max(1, local_ranks)


def usable_memory(device: str) -> float:
    """Bytes this rank can still use: on a GPU, its free memory plus what PyTorch already holds in this process
    (the loaded model among it); on a CPU, `device_memory`.

    Memory held by other processes, or by another library in this one, is not usable: JAX, for one, takes 75% of a
    GPU when its backend starts (a run once failed so with 25 of 132 GiB in PyTorch's hands).
    """
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free + torch.cuda.memory_reserved(torch.device(device)))
    return device_memory(device)


def _available_host_memory() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_name(device: str) -> str:
    return "GPU" if device.startswith("cuda") else "CPU rank"


def _copies_rl_gradient(config: Any) -> bool:
    """Whether a step keeps a copy of the RL gradient: with ``--term-grad-norms`` beside an SFT term."""
    from algos.registry import algorithm

    algo = algorithm(config.run.algo)
    return config.optim.term_grad_norms and algo.step == "rl" and algo.sft_weighting != "none"


def check(found: Estimate, capacity: float) -> None:
    """Raise `DoesNotFit` when `found` exceeds `MARGIN` of `capacity` bytes, naming what would help."""
    if found.total <= MARGIN * capacity:
        return
    hints = ["--gradient-checkpointing", "--fsdp over more GPUs", "--param-dtype bfloat16", "--lora"]
    hints += ["a smaller --micro-batch-tokens", "a smaller --sampler-batch-size or --max-context-tokens"]
    if "term gradient copy" in found.parts and found.total - found.parts["term gradient copy"] <= MARGIN * capacity:
        hints = ["--no-term-grad-norms (the copy of the RL gradient that each term's norm needs)", *hints]
    if max(found.parts, key=found.parts.get) == "held-out evaluation":
        hints = ["a smaller --eval-batch-size or --max-context-tokens", *hints]
    if max(found.parts, key=found.parts.get) == "rollout batch":  # the step's episodes: fewer of them, first
        hints = ["a smaller --group-size or --questions-per-step", "a smaller --max-context-tokens", "more ranks"]
    raise DoesNotFit(
        f"the memory estimate, {found.describe()}, exceeds {MARGIN:.0%} of the {capacity / GIB:.1f} GiB this "
        f"{found.device} can give the run: try {', '.join(hints)} (or --no-memory-check to start anyway)"
    )


def main(argv: Sequence[str] | None = None) -> Estimate:
    """Print the estimate for a model and settings without loading weights (`--model` and the trainer's flags)."""
    import argparse

    from transformers import AutoConfig

    from algos.run.cli import parse_config

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (shards under --fsdp)")
    known, rest = pre.parse_known_args(argv)
    config = parse_config(rest, algo="red_grpo", description="The memory estimate of a run, per device.")
    source = config.model.model
    if source is None or source == "tiny":
        from agents.models import ensure_smollm2_cache

        source = str(ensure_smollm2_cache())
    shape = Shape.of(AutoConfig.from_pretrained(source))
    capacity = device_memory(config.model.torch_device) if not config.model.torch_device.startswith("cuda") else None
    found = estimate(config, shape, ranks=known.ranks, capacity=capacity)
    print(f"{source}: {shape.parameters / 1e9:.2f}B parameters; {found.describe()}")
    return found


if __name__ == "__main__":
    main()
