"""How much of a search step is the env's own work (parsing, formatting, reward) rather than retrieval.

    python -m benchmarks.env_overhead [--steps 300] [--top-k 3]

Runs real search steps (`env.step("<think>..</think><search>q</search>")`, BM25 over the bundled corpus,
queries = HotpotQA dev questions, no query cache) and, in the same run, the retriever's `search(q, k)`
alone on the same queries, interleaved so machine noise hits both alike. It prints both medians and
their ratio, and the env's own share of a step measured inside each step (step time minus the time of the
retrieval call it made, over step time), which is immune to noise between calls. Target: at most 5%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym

import envs  # noqa: F401  (registers the ids)
from envs.data import load_examples


class _Timed:
    """Forwards to a retriever and remembers how long its last search took."""

    def __init__(self, inner) -> None:
        self.inner, self.last = inner, 0.0

    def search(self, query, k):
        start = time.perf_counter()
        try:
            return self.inner.search(query, k)
        finally:
            self.last = time.perf_counter() - start

    def batch_search(self, queries, k):
        return self.inner.batch_search(queries, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args()

    # no query cache: every step must really search, or the comparison would flatter the env
    env = gym.make("RedCoda-HotpotQA-v0", top_k=args.top_k, max_turns=10**6, query_cache=0).unwrapped
    retriever = env.retriever
    timed = env.retriever = _Timed(retriever)
    queries = [ex.question for ex in load_examples("hotpotqa", "dev")]
    queries = (queries * (args.steps // len(queries) + 1))[: args.steps]
    for q in queries[:20]:  # warm the JVM and page cache
        retriever.search(q, args.top_k)

    env.reset(seed=0)
    step_times, search_times, shares = [], [], []
    for i, q in enumerate(queries):
        action = f"<think>look it up</think><search>{q}</search>"
        if i % 2:  # alternate the order so neither side always runs on a warmer cache
            t0 = time.perf_counter()
            retriever.search(q, args.top_k)
            t1 = time.perf_counter()
            env.step(action)
            t2 = time.perf_counter()
            search_times.append(t1 - t0)
            step_times.append(t2 - t1)
        else:
            t0 = time.perf_counter()
            env.step(action)
            t1 = time.perf_counter()
            retriever.search(q, args.top_k)
            t2 = time.perf_counter()
            step_times.append(t1 - t0)
            search_times.append(t2 - t1)
        shares.append(max(step_times[-1] - timed.last, 0.0) / step_times[-1])

    step, search = statistics.median(step_times), statistics.median(search_times)
    print(f"queries: {len(queries)} HotpotQA dev questions, top_k={args.top_k}, BM25 (Pyserini), bundled corpus")
    print(f"median env.step(<search>)        : {step * 1e3:8.3f} ms")
    print(f"median retriever.search alone    : {search * 1e3:8.3f} ms")
    print(f"ratio step / search              : {step / search:8.3f}")
    print(f"env's own share, inside each step: {statistics.median(shares):8.1%}  (median; target <= 5%)")


if __name__ == "__main__":
    main()
