"""The transformers sampler against transformers' own `model.generate` on a GPU, side by side in one run.

    python -m benchmarks.sampler_gpu --config .gpu/smollm2-config       # SmolLM2-135M architecture, random weights
    python -m benchmarks.sampler_gpu --model HuggingFaceTB/SmolLM2-135M-Instruct

Same model, same 64 left-padded prompts of random tokens (600 + 7 i tokens for row i), 128 new tokens per
row, temperature 1: `HFSampler.generate` with and without stop strings (stop strings that random tokens
never complete, so every row runs to the limit, as `model.generate` does with `min_new_tokens`), then
`model.generate`. Prints tokens per second of each and a profile of where a sampler step goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampler_gpu", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a model config folder (with tokenizer): random weights of that architecture")
    source.add_argument("--model", help="a model folder or hub id (trained weights)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="also print cProfile and torch.profiler tables")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agents.records import SamplingParams
    from agents.samplers.hf import HFSampler

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    torch.manual_seed(0)
    path = args.config or args.model
    if args.config:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    model = model.cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampler = HFSampler(model, tokenizer, max_batch_size=args.rows)
    prompts = [torch.randint(100, 40_000, (600 + 7 * i,)).tolist() for i in range(args.rows)]
    n_new = args.new_tokens
    sampler.generate(prompts[:4], SamplingParams(max_new_tokens=8))  # warm-up

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    results: dict[str, float] = {}
    for label, params in [
        ("sampler, stop strings", SamplingParams(max_new_tokens=n_new, stop=("</search>", "</answer>"))),
        ("sampler, no stop strings", SamplingParams(max_new_tokens=n_new)),
    ]:
        out: list = []
        seconds = timed(lambda p=params, o=out: o.extend(sampler.generate(prompts, p)))
        results[label] = sum(len(c.token_ids) for c in out) / seconds
    width = max(len(p) for p in prompts)
    ids = torch.full((args.rows, width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    seconds = timed(
        lambda: model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    results["model.generate"] = args.rows * n_new / seconds
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.rows} rows x {n_new} new tokens")
    for label, rate in results.items():
        print(f"{label:28s} {rate:8.0f} tokens/s   {args.rows / rate * 1e3:6.1f} ms per decode step")
    print(f"sampler / model.generate: {results['sampler, no stop strings'] / results['model.generate']:.2f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        sampler.generate(prompts, SamplingParams(max_new_tokens=n_new, stop=("</search>",)))
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            sampler.generate(prompts, SamplingParams(max_new_tokens=16, stop=("</search>",)))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return results


if __name__ == "__main__":
    main()
