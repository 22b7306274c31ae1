"""Generation throughput of a batched multi-turn CoDA rollout against plain batched sampling, same model.

    python -m benchmarks.rollout [--model smollm2-135m] [--batch 16] [--max-new-tokens 64] [--turns 3] [--seed 0]
                                 [--narrow-rows N]

All sides sample from `HFSampler`s over one model with the same `SamplingParams` (temperature 1, the tool-call
stop strings, `max_new_tokens`) and count only sampled tokens (`Completion.token_ids`: the loss-masked tokens of
the rollout's `Generation`s), never prompts or observations.

* rollout: `CodaAgent.rollout` over `--batch` CoDA envs (real BM25, HotpotQA dev questions), wall time of the
  whole call (generate calls, env steps, retrieval, context bookkeeping). Its sampler keeps each context's keys
  and values between turns (`HFSampler`'s default), so a later turn prefills only the tokens appended since.
* plain (full re-encode): the rollout's generate calls replayed as bare `generate` calls on a sampler that keeps
  nothing between calls (`cache_tokens=0`): same prompts, params and seeds, so the same tokens are sampled (the
  script fails if one differs: the run also checks that reuse equals a full re-encode). Rollout over this is the
  gain of keeping the cache, net of what the agent and env add around sampling.
* plain (first prompts): as many calls and rows, all on the questions' first planner prompts, on the sampler that
  keeps nothing. Rollout over this is the headline ratio (target >= 0.9): what multi-turn costs per sampled
  token against single-turn generation.

Sides run in the order rollout, replay, first prompts; `--repeats` repeats the same work (same seeds, the cache
cleared first) and keeps the best of each side, timed in wall-clock and in this process's CPU seconds (on a
shared machine the CPU-time ratios are the steadier ones).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Sequence
from typing import Any

from agents.records import Completion, SamplingParams
from agents.samplers import SamplerWrapper

FIRST_PROMPTS_TARGET = 0.9


class CountingSampler(SamplerWrapper):
    """A `Sampler` wrapper that records the rows, prompts, completions and sampled tokens of every generate call."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[int] = []
        self.recorded: list[tuple[list[list[int]], SamplingParams]] = []
        self.completions: list[Completion] = []
        self.sampled = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        completions = self.inner.generate(prompts, params)
        self.calls.append(len(prompts))
        self.recorded.append(([list(p) for p in prompts], params))
        self.completions.extend(completions)
        self.sampled += sum(len(c.token_ids) for c in completions)
        return completions


def sampling_steps(completions: Sequence[Completion], calls: Sequence[int]) -> int:
    """Sampling steps of a run of generate calls: each call samples as many steps as its longest completion."""
    steps, start = 0, 0
    for rows in calls:
        steps += max((len(c.token_ids) for c in completions[start : start + rows]), default=0)
        start += rows
    return steps


def largest_logprob_gap(first: Sequence[Completion], second: Sequence[Completion]) -> float:
    """Largest absolute log-prob difference between two runs that sampled the same tokens (raises if not)."""
    gap = 0.0
    for a, b in zip(first, second, strict=True):
        if a.token_ids != b.token_ids:
            raise RuntimeError("the full re-encode sampled other tokens than the rollout's sampler")
        gap = max([gap, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))])
    return gap


def _setup(
    model: str | None, batch: int, max_new_tokens: int, turns: int, seed: int, narrow_rows: int | None
) -> tuple[CountingSampler, CountingSampler, SamplingParams, list[Any], list[list[int]]]:
    """The rollout's sampler (keeps the cache), the plain one (keeps nothing), the params, the envs and the
    questions' first planner prompts, all warmed up (the JVM, the kernels)."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the ids)
    from agents.models import load_model
    from agents.samplers import HFSampler, encode_chat
    from agents.search_agents import STOP

    lm, tokenizer = load_model(model)
    sampler = CountingSampler(HFSampler(lm, tokenizer, seed=seed, narrow_rows=narrow_rows))
    plain = CountingSampler(HFSampler(lm, tokenizer, seed=seed, cache_tokens=0, narrow_rows=narrow_rows))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop=STOP)
    env_list = [
        gym.make("RedCoda-HotpotQA-CoDA-v0", split="dev", max_planner_turns=turns, max_executor_turns=turns)
        for _ in range(batch)
    ]
    env_list[0].unwrapped.retriever.search("warm up", 3)  # start the JVM outside the timing
    prompts = []
    for index, env in enumerate(env_list):
        _, info = env.reset(options={"index": index})
        messages = [
            {"role": "system", "content": info["system_prompt"]},
            {"role": "user", "content": info["user_message"]},
        ]
        prompts.append(encode_chat(tokenizer, messages))
    sampler.inner.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm up the kernels
    return sampler, plain, params, env_list, prompts


def _rollout_side(agent: Any, sampler: CountingSampler, env_list: list[Any], seed: int) -> dict[str, Any]:
    """One `CodaAgent.rollout` over every env, from an empty cache: its tokens, times, calls and cache use."""
    sampler.calls, sampler.recorded, sampler.completions, sampler.sampled = [], [], [], 0
    sampler.inner.clear_cache()
    reused, prefilled = sampler.inner.reused_tokens, sampler.inner.prefilled_tokens
    indices = list(range(len(env_list)))
    start, cpu = time.perf_counter(), time.process_time()
    trajectories = agent.rollout(env_list, indices, seed=seed)  # every repeat does the same work
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    masked = sum(g.num_sampled for t in trajectories for g in t.generations)
    if masked != sampler.sampled:
        raise RuntimeError(f"{sampler.sampled} tokens sampled but {masked} in the generations' loss masks")
    return {
        "tokens": masked,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "calls": list(sampler.calls),
        "steps": sampling_steps(sampler.completions, sampler.calls),
        "reused_prompt_tokens": sampler.inner.reused_tokens - reused,
        "prefilled_prompt_tokens": sampler.inner.prefilled_tokens - prefilled,
        "cached_tokens_after": sampler.inner.cached_tokens,
    }


def _plain_side(plain: CountingSampler, calls: list[int], work: Iterable[tuple[Any, SamplingParams]]) -> dict:
    """`plain`'s generate calls over `work` (prompts, params), from a fresh count: tokens, times and steps."""
    plain.calls, plain.sampled, plain.completions = [], 0, []
    prefilled = plain.inner.prefilled_tokens
    start, cpu = time.perf_counter(), time.process_time()
    for call_prompts, call_params in work:
        plain.generate(call_prompts, call_params)
    return {
        "tokens": plain.sampled,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
        "calls": calls,
        "steps": sampling_steps(plain.completions, calls),
        "prefilled_prompt_tokens": plain.inner.prefilled_tokens - prefilled,
    }


def run(
    model: str | None = None,
    batch: int = 16,
    max_new_tokens: int = 64,
    turns: int = 3,
    seed: int = 0,
    repeats: int = 1,
    narrow_rows: int | None = None,
) -> dict[str, Any]:
    """Measure every side; return tokens, seconds and tokens/s of each, and the ratios to the rollout.

    `narrow_rows` goes to every side's `HFSampler` (None: its default; 0: every linear layer `F.linear`)."""
    from agents.search_agents import CodaAgent

    sampler, plain, params, env_list, prompts = _setup(model, batch, max_new_tokens, turns, seed, narrow_rows)
    agent = CodaAgent(sampler, params)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        rollout = _rollout_side(agent, sampler, env_list, seed)
        calls, recorded = list(sampler.calls), list(sampler.recorded)
        replay = _plain_side(plain, calls, recorded)
        replay["largest_logprob_gap"] = largest_logprob_gap(sampler.completions, plain.completions)
        firsts = (  # made as the calls run, as the replay's were
            (prompts[:rows], SamplingParams(**{**params.__dict__, "seed": seed + i})) for i, rows in enumerate(calls)
        )
        first = _plain_side(plain, calls, firsts)
        for name, side in (("rollout", rollout), ("plain", replay), ("plain_first_prompts", first)):
            side["tokens_per_s"] = side["tokens"] / side["seconds"]
            side["tokens_per_cpu_s"] = side["tokens"] / side["cpu_seconds"]
            if name not in best or side["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = side
    for env in env_list:
        env.close()
    return {
        **best,
        "ratio": best["rollout"]["tokens_per_s"] / best["plain"]["tokens_per_s"],
        "ratio_first_prompts": best["rollout"]["tokens_per_s"] / best["plain_first_prompts"]["tokens_per_s"],
        "cpu_ratio": best["rollout"]["tokens_per_cpu_s"] / best["plain"]["tokens_per_cpu_s"],
        "cpu_ratio_first_prompts": (
            best["rollout"]["tokens_per_cpu_s"] / best["plain_first_prompts"]["tokens_per_cpu_s"]
        ),
        "batch": batch,
        "max_new_tokens": max_new_tokens,
        "turns": turns,
        "model": model or "smollm2-135m",
        "narrow_rows": sampler.inner.narrow_rows,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="None (bundled SmolLM2-135M-Instruct), a local dir or an HF id")
    parser.add_argument("--batch", type=int, default=16, help="episodes (and plain rows) per call")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3, help="planner turns and executor turns per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="measure each side this many times, keep the best")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--narrow-rows", type=int, default=None, help="HFSampler's narrow_rows (default: its own; 0: F.linear only)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run(args.model, args.batch, args.max_new_tokens, args.turns, args.seed, args.repeats, args.narrow_rows)
    narrow = "default" if args.narrow_rows is None else args.narrow_rows
    print(
        f"model {result['model']} | batch {args.batch} | max_new_tokens {args.max_new_tokens} | turns {args.turns} "
        f"| seed {args.seed} | temperature 1.0 | narrow_rows {narrow}"
    )
    for name in ("rollout", "plain", "plain_first_prompts"):
        side = result[name]
        print(
            f"{name:<19} {side['tokens']:>6} sampled tokens in {side['seconds']:7.1f} s "
            f"= {side['tokens_per_s']:7.1f} tok/s; {side['cpu_seconds']:7.1f} CPU s = {side['tokens_per_cpu_s']:7.1f} "
            f"tok/CPU-s  ({len(side['calls'])} generate calls, rows {side['calls']})"
        )
    rollout = result["rollout"]
    print(
        f"rollout prompt tokens: {rollout['reused_prompt_tokens']} reused from earlier turns, "
        f"{rollout['prefilled_prompt_tokens']} prefilled; {rollout['cached_tokens_after']} still cached after it"
    )
    for name in ("rollout", "plain", "plain_first_prompts"):
        side = result[name]
        print(
            f"{name:<19} prompt tokens prefilled {side['prefilled_prompt_tokens']:>6}; sampling steps "
            f"{side['steps']:>4}, {side['tokens'] / max(side['steps'], 1):.2f} rows sampled per step"
        )
    print(
        f"plain re-encode sampled the rollout's tokens exactly; largest log-prob gap "
        f"{result['plain']['largest_logprob_gap']:.1e}"
    )
    print(
        f"ratio rollout / plain (same prompts, full re-encode): {result['ratio']:.2f} wall, "
        f"{result['cpu_ratio']:.2f} CPU"
    )
    print(
        f"ratio rollout / plain on first prompts: {result['ratio_first_prompts']:.2f} wall, "
        f"{result['cpu_ratio_first_prompts']:.2f} CPU (target >= {FIRST_PROMPTS_TARGET})"
    )
    return result


if __name__ == "__main__":
    main()
