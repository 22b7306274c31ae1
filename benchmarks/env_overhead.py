"""How much of a search step is the env's own work (parsing, formatting, reward) rather than retrieval.

    python -m benchmarks.env_overhead [--steps 300] [--top-k 3]

Runs, side by side in one process, (a) `env.step("<search>q</search>")` with the real BM25 retriever
and (b) the retriever's `search(q, k)` alone, on the same real queries (HotpotQA dev questions), and
prints both medians and their ratio. Target: the env's own share of a search step is at most 5%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym

import envs  # noqa: F401  (registers the ids)
from envs.data import load_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args()

    env = gym.make("RedCoda-HotpotQA-v0", top_k=args.top_k, max_turns=10**6).unwrapped
    retriever = env.retriever
    queries = [ex.question for ex in load_examples("hotpotqa", "dev")]
    queries = (queries * (args.steps // len(queries) + 1))[: args.steps]
    for q in queries[:20]:  # warm the JVM and page cache
        retriever.search(q, args.top_k)

    env.reset(seed=0)
    step_times, search_times = [], []
    for q in queries:  # interleaved, so machine noise hits both alike
        t0 = time.perf_counter()
        retriever.search(q, args.top_k)
        t1 = time.perf_counter()
        env.step(f"<think>look it up</think><search>{q}</search>")
        t2 = time.perf_counter()
        search_times.append(t1 - t0)
        step_times.append(t2 - t1)

    step, search = statistics.median(step_times), statistics.median(search_times)
    overhead = max(step - search, 0.0) / step
    print(
        f"queries: {len(queries)} HotpotQA dev questions, top_k={args.top_k}, BM25 (Pyserini) over the bundled corpus"
    )
    print(f"median env.step(<search>) : {step * 1e3:8.3f} ms")
    print(f"median retriever.search   : {search * 1e3:8.3f} ms")
    print(f"ratio step / search       : {step / search:8.3f}")
    print(f"env's own share of a step : {overhead:8.1%}  (target <= 5%)")


if __name__ == "__main__":
    main()
