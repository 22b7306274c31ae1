"""The transformers sampler's decoding levers side by side, each on and off, at a tiny shape on this machine.

Each lever is a switch of `agents.samplers.HFSampler`, and each pair of samplers samples the same tokens (checked
here, as `tests/test_decode_levers.py` checks it): what differs is the work. Per lever, the best of a few timed calls
with it off and on, their ratio, and what it did:

- finished rows leaving the row bucket (``compact_rows``): static steps over rows that end at different steps (each
  token ends a row with about 2% chance); the rows a step runs, on average;
- prefix sharing (``share_prefixes``): a GRPO-like call, questions under one set of instructions, each question
  ``--group`` times; the prompt tokens prefilled;
- the prefill's attention (``sdpa_prefill``): the same model loaded with eager attention, prefilled through it or
  through torch's SDPA (on a CPU its grouped form).

Rows per batch (the fourth lever) matters where a step's cost hardly grows with its rows, on a GPU; here it prints
what `algos.run.memory.sampler_rows` would choose for the Qwen2.5-3B shape on an H200's 139.8 GiB, free.

    python -m benchmarks.decode_levers                      # hidden 256, 4 layers, 32 rows
    python -m benchmarks.decode_levers --rows 8 --new-tokens 16 --repeats 1

Random weights from a config (no download) over the SmolLM2 tokenizer; float32, one torch thread by default. The
ratios, not the seconds, are the figures to read; on a shared machine even they move.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

GIB = 1 << 30


def tiny_policy(hidden: int, layers: int) -> tuple[Any, Any]:
    """A random-weight Llama of `hidden` width and `layers` layers over the SmolLM2 tokenizer, in eval mode."""
    from agents.models import tiny_model

    return tiny_model(seed=0, hidden_size=hidden, num_layers=layers, max_context=2048, initializer_range=0.02)


def compare(make: Any, prompts: list[list[int]], params: Any, repeats: int) -> tuple[float, float, Any, Any]:
    """Best seconds of a `generate` call with the lever off and on (fresh samplers each time, so nothing is kept
    from an earlier call), and the two samplers of the last calls; raises if they sampled other tokens."""
    from benchmarks.timing import best_seconds

    seconds, samplers, outputs = [], [], []
    for on in (False, True):
        last: dict[str, Any] = {}

        def call(on: bool = on, last: dict[str, Any] = last) -> None:
            last["sampler"] = make(on)
            last["out"] = last["sampler"].generate(prompts, params)

        seconds.append(best_seconds(call, repeats))
        samplers.append(last["sampler"])
        outputs.append([c.token_ids for c in last["out"]])
    if outputs[0] != outputs[1]:
        raise AssertionError("the lever changed the sampled tokens")
    return seconds[0], seconds[1], samplers[0], samplers[1]


def rows_choice() -> list[str]:
    """What `sampler_rows` chooses for the Qwen2.5-3B shape on a free H200 (139.8 GiB), gpu preset, a few steps."""
    from algos.run import memory
    from algos.run.cli import parse_config

    shape = memory.Shape(parameters=3_085_938_688, layers=36, hidden=2048, intermediate=11008, vocab=151936, kv_dim=256)
    flags = ["--preset", "gpu", "--gradient-checkpointing", "--eval-questions", "0", "--validation-questions", "0"]
    base = parse_config(flags, algo="red_grpo")  # as benchmarks.scale_step runs it
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, device="cuda"))
    lines = []
    for questions, group in ((32, 2), (64, 2), (64, 4)):
        config = dataclasses.replace(
            base, rl=dataclasses.replace(base.rl, questions_per_step=questions, group_size=group)
        )
        rows, why = memory.sampler_rows(config, shape, 139.8 * GIB)
        lines.append(f"  {questions} questions x {group}: {rows} rows ({why})")
    return lines


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="rows of each call")
    parser.add_argument("--group", type=int, default=4, help="episodes per question in the prefix-sharing call")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per sampler; the best counts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from agents.records import SamplingParams
    from agents.samplers import HFSampler

    torch.set_num_threads(args.threads)
    model, tokenizer = tiny_policy(args.hidden, args.layers)
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> list[int]:
        return torch.randint(100, min(vocab, 40_000), (n,), generator=generator).tolist()

    lines = [
        f"tiny Llama: hidden {args.hidden}, {args.layers} layers, float32, {args.threads} torch thread(s); "
        f"{args.rows} rows, {args.new_tokens} new tokens; best of {args.repeats}",
        "lever | off s | on s | off/on | what it did",
    ]

    # finished rows leaving the bucket: rows end at random steps (about 1 token in 50 ends a row)
    prompts = [words(64 + 8 * (i % 5)) for i in range(args.rows)]
    ends = range(0, vocab, 50)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)

    def compacting(on: bool) -> HFSampler:
        return HFSampler(model, tokenizer, decode="static", compact_rows=on, stop_token_ids=ends, cache_tokens=0)

    off_s, on_s, off, on = compare(compacting, prompts, params, args.repeats)
    lines.append(
        f"finished rows leave the bucket | {off_s:.3f} | {on_s:.3f} | {off_s / on_s:.2f}x | "
        f"{on.live_row_steps / on.decode_steps:.1f} live rows a step; "
        f"{off.stepped_row_steps / off.decode_steps:.1f} run off, {on.stepped_row_steps / on.decode_steps:.1f} on"
    )

    # prefix sharing: questions under common instructions, `group` episodes each
    instructions = words(256)
    questions = [instructions + words(12 + i % 7) for i in range(max(1, args.rows // args.group))]
    grouped = [q for q in questions for _ in range(args.group)]
    short = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)

    def sharing(on: bool) -> HFSampler:
        return HFSampler(model, tokenizer, decode="static", share_prefixes=on, stop_token_ids=[])

    off_s, on_s, off, on = compare(sharing, grouped, short, args.repeats)
    lines.append(
        f"prefix sharing ({len(questions)} questions x {args.group}) | {off_s:.3f} | {on_s:.3f} | "
        f"{off_s / on_s:.2f}x | prefilled {off.prefilled_tokens} tokens off, {on.prefilled_tokens} on "
        f"({on.shared_saved_tokens} saved)"
    )

    # the prefill's attention: a model loaded with eager attention
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    long_prompts = [words(384 + 16 * (i % 4)) for i in range(args.rows)]
    one = SamplingParams(max_new_tokens=1, temperature=0.0)

    def attention(on: bool) -> HFSampler:
        return HFSampler(eager, tokenizer, decode="static", sdpa_prefill=on, cache_tokens=0)

    off_s, on_s, off, on = compare(attention, long_prompts, one, args.repeats)
    lines.append(
        f"prefill attention ({off.prefill_attention} -> {on.prefill_attention}) | {off_s:.3f} | {on_s:.3f} | "
        f"{off_s / on_s:.2f}x | {sum(len(p) for p in long_prompts)} prompt tokens prefilled, one token sampled"
    )
    lines.append("rows per batch on a GPU (`sampler_rows`, Qwen2.5-3B shape, 139.8 GiB free, bf16):")
    lines += rows_choice()
    for line in lines:
        print(line, flush=True)
    return lines


if __name__ == "__main__":
    main()
