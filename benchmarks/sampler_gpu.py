"""The transformers sampler against transformers' own `model.generate` on a GPU, side by side in one run.

    python -m benchmarks.sampler_gpu --config CONFIG_DIR            # a model config folder: random weights
    python -m benchmarks.sampler_gpu --model HuggingFaceTB/SmolLM2-135M-Instruct
    python -m benchmarks.sampler_gpu --model <folder> --bf16       # as the gpu preset samples

Same model, same 64 left-padded prompts of random tokens (600 + 7 i tokens for row i), 128 new tokens per
row, temperature 1: `HFSampler.generate` with and without stop strings (stop strings that random tokens
never complete, so every row runs to the limit, as `model.generate` does with `min_new_tokens`), the same
with `decode="graphs"` (each decode step one CUDA graph replay over static key/value buffers; its first
call, which captures the graphs, is left out of the timing), then `model.generate`. Prints tokens per second
of each, ms per decode step, whether the graph sampler's greedy tokens equal the dynamic sampler's and how far
apart their log-probs are, and with `--profile` where a sampler step goes. `--bf16` runs everything under
bfloat16 autocast, as the trainer's gpu preset samples.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable, Sequence
from typing import Any


def _agreement(expected: list, got: list) -> tuple[int, float, list[tuple[int, int]]]:
    """Rows with the same tokens, the largest log-prob gap over the tokens both chose (up to a first difference),
    and (row, first differing token) of the rows that differ."""
    equal, gap, differ = 0, 0.0, []
    for row, (a, b) in enumerate(zip(expected, got, strict=True)):
        equal += a.token_ids == b.token_ids
        for k, (x, y, tx, ty) in enumerate(zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids, strict=False)):
            if tx != ty:
                differ.append((row, k))
                break
            gap = max(gap, abs(x - y))
        else:
            if a.token_ids != b.token_ids:  # one is a prefix of the other
                differ.append((row, min(len(a.token_ids), len(b.token_ids))))
    return equal, gap, differ


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampler_gpu", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a model config folder (with tokenizer): random weights of that architecture")
    source.add_argument("--model", help="a model folder or hub id (trained weights)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="also print cProfile and torch.profiler tables")
    parser.add_argument("--bf16", action="store_true", help="sample under bfloat16 autocast (the gpu preset's)")
    return parser


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model on the GPU in float32 (random weights with `--config`) and its tokenizer, with a pad token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    torch.manual_seed(0)
    path = args.config or args.model
    if args.config:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        # float32 whatever the folder holds (`from_pretrained` keeps a saved bfloat16): `--bf16` is autocast
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of `fn()` on the GPU, synchronized before and after."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _generate_rate(model: Any, tokenizer: Any, prompts: list[list[int]], n_new: int) -> float:
    """Tokens per second of `model.generate` on the same prompts, left-padded, every row to `n_new` tokens."""
    import torch

    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    seconds = _timed(
        lambda: model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    return rows * n_new / seconds


def _profile(samplers: dict[str, Any], prompts: list[list[int]], n_new: int) -> None:
    """Where each sampler's step goes: host (cProfile) and kernels (torch.profiler)."""
    import torch

    from agents.records import SamplingParams

    for label, backend in samplers.items():
        print(f"--- profile: {label}")
        profiler = cProfile.Profile()
        profiler.enable()
        backend.generate(prompts, SamplingParams(max_new_tokens=n_new, stop=("</search>",)))
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            backend.generate(prompts, SamplingParams(max_new_tokens=16, stop=("</search>",)))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = _parser().parse_args(argv)

    import torch

    from agents.records import SamplingParams
    from agents.samplers.hf import HFSampler

    model, tokenizer = _load(args)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
        sampler = HFSampler(model, tokenizer, max_batch_size=args.rows)
        graphs = HFSampler(model, tokenizer, max_batch_size=args.rows, decode="graphs")
        prompts = [torch.randint(100, 40_000, (600 + 7 * i,)).tolist() for i in range(args.rows)]
        n_new = args.new_tokens
        # warm-up on a sampler of its own: one that kept these prompts would prefill the greedy call below in
        # another batch layout (reused columns first) than the fresh static samplers, and the comparison would
        # measure that layout's rounding instead of the decode steps
        HFSampler(model, tokenizer, cache_tokens=0).generate(prompts[:4], SamplingParams(max_new_tokens=8))
        greedy = SamplingParams(max_new_tokens=n_new, temperature=0.0)
        dynamic = sampler.generate(prompts, greedy)
        same = [dynamic, graphs.generate(prompts, greedy)]  # also captures every graph
        captured = graphs._static.captured
        # the same static steps without graphs: tells a difference of the graphs from one of the step's kernels
        eager = HFSampler(model, tokenizer, max_batch_size=args.rows, decode="static").generate(prompts, greedy)

        results: dict[str, float] = {}
        stops = SamplingParams(max_new_tokens=n_new, stop=("</search>", "</answer>"))
        plain = SamplingParams(max_new_tokens=n_new)
        for label, backend, params in [
            ("sampler, stop strings", sampler, stops),
            ("sampler, no stop strings", sampler, plain),
            ("graphs, stop strings", graphs, stops),
            ("graphs, no stop strings", graphs, plain),
        ]:
            out: list = []
            seconds = _timed(lambda b=backend, p=params, o=out: o.extend(b.generate(prompts, p)))
            results[label] = sum(len(c.token_ids) for c in out) / seconds
        results["model.generate"] = _generate_rate(model, tokenizer, prompts, n_new)
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.rows} rows x {n_new} new tokens")
        for label, rate in results.items():
            print(f"{label:28s} {rate:8.0f} tokens/s   {args.rows / rate * 1e3:6.1f} ms per decode step")
        print(f"sampler / model.generate: {results['sampler, no stop strings'] / results['model.generate']:.2f}")
        print(f"graphs / model.generate: {results['graphs, no stop strings'] / results['model.generate']:.2f}")
        print(f"graphs / sampler: {results['graphs, no stop strings'] / results['sampler, no stop strings']:.2f}")
        for label, got in [("graphs", same[1]), ("static steps without graphs", eager)]:
            equal, gap, differ = _agreement(dynamic, got)
            print(
                f"greedy, {label} against the dynamic cache: {equal} of {args.rows} rows the same tokens, log-probs "
                f"within {gap:.2e} (while the tokens agree); rows that differ (prompt length: first differing "
                f"token): {', '.join(f'{len(prompts[r])}:{k}' for r, k in differ) or 'none'}"
            )
            results[f"greedy rows equal, {label}"] = equal
        print(f"graphs captured {captured}, after the timed calls {graphs._static.captured}")
        if args.profile:
            _profile({"dynamic cache": sampler, "graphs": graphs}, prompts, n_new)
    return results


if __name__ == "__main__":
    main()
