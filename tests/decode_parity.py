"""How far each decode path's logits are from a float64 reference, step by step, with the same tokens fed.

Greedy decoding over random-token prompts compares paths badly: where two tokens nearly tie, any rounding
difference picks another token and the rows part. This feeds every path the same tokens instead (the float64
reference's greedy choice, teacher-forced), so each step's logits can be compared without divergence: the
float32 prefill, then the decode steps through the model's forward over its `DynamicCache` ("dynamic"), the same
over the sampler's cache layers, which write into room reserved for the call ("dynamic, reserved room"), through
`StaticDecoder`'s steps without graphs ("static") and, on a GPU, replayed as CUDA graphs ("graphs"); each also
with attention forced to the math kernel (`sdpa math`), which tells the attention kernels from the rest. A path
whose error is the dynamic path's size is as right as float32 allows; one far larger is a bug in that path.
Used by the decode tests (`logit_errors`); they print a table per path, seen with `pytest -s`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from agents.models import cache_argument
from agents.samplers.kv_cache import AppendLayer
from agents.samplers.static_decode import StaticDecoder, row_bucket


@dataclass(frozen=True)
class Batch:
    """The left-padded prompts every path decodes, and how many steps it decodes after them."""

    ids: torch.Tensor  # (rows, width)
    mask: torch.Tensor  # (rows, width)
    positions: torch.Tensor  # (rows, width)
    steps: int

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


def random_prompts(model: Any, rows: int, prompt_tokens: int, steps: int) -> Batch:
    """Seeded random-token prompts on `model`'s device, row i of `prompt_tokens` + 7 i tokens, left-padded."""
    generator = torch.Generator().manual_seed(0)
    high = min(40_000, model.config.vocab_size)
    prompts = [torch.randint(100, high, (prompt_tokens + 7 * i,), generator=generator) for i in range(rows)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    return Batch(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), steps)


def _prefill(m: Any, batch: Batch, room: int = 0) -> tuple[Any, torch.Tensor]:
    """The prompts through `m` into a fresh `DynamicCache`: the cache and the last position's logits."""
    with torch.inference_mode():
        cache = DynamicCache(config=m.config)
        if room:  # the sampler's layers: keys and values written into reserved room, read as views of it
            cache.layers = [AppendLayer(room) for _ in cache.layers]
        out = m(
            input_ids=batch.ids,
            attention_mask=batch.mask,
            position_ids=batch.positions,
            use_cache=True,
            **{cache_argument(): cache},
        )
        return cache, out.logits[:, -1]


def _dynamic(m: Any, batch: Batch, fed: list[torch.Tensor] | None, room: int = 0) -> tuple[list, list]:
    """Decode through `m`'s forward over its cache, fed `fed` (None: its own greedy tokens); (logits, tokens)."""
    cache, logits = _prefill(m, batch, room)
    got, tokens, attention = [logits], [logits.argmax(-1)], batch.mask
    with torch.inference_mode():
        for step in range(batch.steps):
            attention = torch.cat([attention, attention.new_ones((batch.rows, 1))], dim=1)
            out = m(
                input_ids=(fed or tokens)[step][:, None],
                attention_mask=attention,
                position_ids=batch.positions[:, -1:] + 1 + step,
                use_cache=True,
                **{cache_argument(): cache},
            )
            got.append(out.logits[:, -1])
            tokens.append(out.logits[:, -1].argmax(-1))
    return got, tokens


def _static(model: Any, batch: Batch, fed: list[torch.Tensor], graphs: bool) -> list[torch.Tensor]:
    """Decode through `StaticDecoder`'s steps (replayed as CUDA graphs with `graphs`), fed `fed`; the logits."""
    cache, logits = _prefill(model, batch)
    decoder = StaticDecoder(model, graphs=graphs)
    got = [logits]
    with torch.inference_mode():
        decoder.begin(cache, batch.width + batch.steps)
        decoder.mask[: batch.rows, 0, 0, : batch.width] = batch.mask.bool()
        rows = row_bucket(batch.rows)
        for step in range(batch.steps):
            decoder.tokens[: batch.rows] = fed[step]
            decoder.positions[: batch.rows] = batch.positions[:, -1] + 1 + step
            decoder.column.fill_(batch.width + step)
            decoder.mask[:rows, 0, 0, batch.width + step] = True
            got.append(decoder.step(rows)[: batch.rows].clone())
    return got


def logit_errors(model: Any, rows: int = 64, steps: int = 16, prompt_tokens: int = 600) -> dict[str, float]:
    """Per decode path of the float32 `model` (on its device), the largest |logit - float64 logit| over all steps.

    Prints, per path, that error, the error relative to the largest reference logit, the prefill's error and in
    how many (row, step) pairs the path's greedy token is the reference's.
    """
    model = copy.deepcopy(model).float().eval()  # a copy: the caller's model keeps its dtype and mode
    reference = copy.deepcopy(model).double()
    batch = random_prompts(model, rows, prompt_tokens, steps)
    ref_steps, fed = _dynamic(reference, batch, None)  # the tokens every path is fed: the reference's greedy ones
    paths = {
        "dynamic": lambda: _dynamic(model, batch, fed)[0],
        "dynamic, reserved room": lambda: _dynamic(model, batch, fed, batch.width + steps)[0],
        "static": lambda: _static(model, batch, fed, False),
    }
    device = batch.ids.device
    if device.type == "cuda":
        paths["graphs"] = lambda: _static(model, batch, fed, True)
    scale = max(float(r.abs().max()) for r in ref_steps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {rows} rows, {steps} teacher-forced steps; largest logit {scale:.1f}")
    print(f"{'path':36s} {'max |logit - fp64|':>20s} {'relative':>10s} {'prefill':>10s} {'greedy = fp64':>14s}")
    errors: dict[str, float] = {}
    for math_only in (False, True):
        for label, run in paths.items():
            if math_only and label == "graphs":
                continue  # a graph captured under the math kernel is the same graph code; the eager path tells
            with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
                got = run()
            step_errors = [float((g.double() - r).abs().max()) for g, r in zip(got, ref_steps, strict=True)]
            agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref_steps, strict=True))
            key = f"{label}, sdpa math" if math_only else label
            error = max(step_errors)
            print(
                f"{key:36s} {error:20.3e} {error / scale:10.2e} {step_errors[0]:10.3e} {agree:6d} of {len(got) * rows}"
            )
            errors[key] = error
    return errors
