"""How far each decode path's logits are from a float64 reference, step by step, with the same tokens fed.

    python -m benchmarks.decode_parity --model <SmolLM2 folder> --device cuda     # dynamic, static, graphs
    python -m benchmarks.decode_parity --config <config folder> --rows 4          # random weights, any device

Greedy decoding over random-token prompts compares paths badly: where two tokens nearly tie, any rounding
difference picks another token and the rows part. This feeds every path the same tokens instead (the float64
reference's greedy choice, teacher-forced), so each step's logits can be compared without divergence: the
float32 prefill, then `--steps` decode steps through the model's forward over its `DynamicCache` ("dynamic"),
the same over the sampler's cache layers, which write into room reserved for the call ("dynamic, reserved
room"), through `StaticDecoder`'s steps without graphs ("static") and, on a GPU, replayed as CUDA graphs ("graphs");
each also with attention forced to the math kernel (`sdpa math`), which tells the attention kernels from the
rest. Prints, per path, the largest absolute logit difference from the reference over all steps, that
difference relative to the largest reference logit, and in how many (row, step) pairs the path's greedy token
is the reference's. A path whose error is the dynamic path's size is as right as float32 allows; one far larger
is a bug in that path.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_parity", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a model config folder: random weights of that architecture")
    source.add_argument("--model", help="a model folder or hub id (trained weights)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
    parser.add_argument("--prompt-tokens", type=int, default=600, help="row i's prompt has this + 7 i tokens")
    return parser


@dataclass(frozen=True)
class _Batch:
    """The left-padded prompts every path decodes, and how many steps it decodes after them."""

    ids: Any  # (rows, width)
    mask: Any  # (rows, width)
    positions: Any  # (rows, width)
    steps: int

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


def _models(args: argparse.Namespace) -> tuple[Any, Any, _Batch]:
    """The float32 model, its float64 copy (the reference) and random-token prompts, all on `--device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    path = args.config or args.model
    if args.config:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    device = torch.device(args.device)
    model = model.to(device).eval()
    reference = copy.deepcopy(model).double()
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, min(40_000, vocab), (args.prompt_tokens + 7 * i,)) for i in range(args.rows)]
    width = max(len(p) for p in prompts)
    ids = torch.full((args.rows, width), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model, reference, _Batch(ids, mask, positions, args.steps)


def _prefill(m: Any, batch: _Batch, room: int = 0) -> tuple[Any, Any]:
    """The prompts through `m` into a fresh `DynamicCache`: the cache and the last position's logits."""
    import torch
    from transformers import DynamicCache

    from agents.models import cache_argument
    from agents.samplers.hf import _AppendLayer

    with torch.inference_mode():
        cache = DynamicCache(config=m.config)
        if room:  # the sampler's layers: keys and values written into reserved room, read as views of it
            cache.layers = [_AppendLayer(room) for _ in cache.layers]
        out = m(
            input_ids=batch.ids,
            attention_mask=batch.mask,
            position_ids=batch.positions,
            use_cache=True,
            **{cache_argument(): cache},
        )
        return cache, out.logits[:, -1]


def _dynamic(m: Any, batch: _Batch, fed: list[Any] | None, room: int = 0) -> tuple[list[Any], list[Any]]:
    """Decode through `m`'s forward over its cache, fed `fed` (None: its own greedy tokens); (logits, tokens)."""
    import torch

    from agents.models import cache_argument

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


def _static(model: Any, batch: _Batch, fed: list[Any], graphs: bool) -> list[Any]:
    """Decode through `StaticDecoder`'s steps (replayed as CUDA graphs with `graphs`), fed `fed`; the logits."""
    import torch

    from agents.samplers.static_decode import StaticDecoder, row_bucket

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


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = _parser().parse_args(argv)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, reference, batch = _models(args)
    ref_steps, fed = _dynamic(reference, batch, None)  # the tokens every path is fed: the reference's greedy ones
    width = batch.width
    paths = {
        "dynamic": lambda: _dynamic(model, batch, fed)[0],
        "dynamic, reserved room": lambda: _dynamic(model, batch, fed, width + args.steps)[0],
        "static": lambda: _static(model, batch, fed, False),
    }
    device = torch.device(args.device)
    if device.type == "cuda":
        paths["graphs"] = lambda: _static(model, batch, fed, True)
    results: dict[str, float] = {}
    scale = max(float(r.abs().max()) for r in ref_steps)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, {args.rows} rows, prompts of {args.prompt_tokens}-{width} tokens, "
        f"{args.steps} teacher-forced decode steps; largest reference logit {scale:.1f}"
    )
    print(f"{'path':36s} {'max |logit - fp64|':>20s} {'relative':>10s} {'prefill':>10s} {'greedy = fp64':>14s}")
    for math_only in (False, True):
        for label, run in paths.items():
            if math_only and label == "graphs":
                continue  # a graph captured under the math kernel is the same graph code; the eager path tells
            context = sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext()
            with context:
                got = run()
            errors = [float((g.double() - r).abs().max()) for g, r in zip(got, ref_steps, strict=True)]
            agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref_steps, strict=True))
            key = f"{label}, sdpa math" if math_only else label
            print(
                f"{key:36s} {max(errors):20.3e} {max(errors) / scale:10.2e} {errors[0]:10.3e} "
                f"{agree:6d} of {len(got) * args.rows}"
            )
            results[key] = max(errors)
    return results


if __name__ == "__main__":
    main()
