"""How much of a search step is the env's own work (parsing, formatting, reward) rather than retrieval.

    python -m benchmarks.env_overhead [--steps 300] [--top-k 3] [--warmup 2000] [--server-envs 16] [--json OUT]

Runs real search steps (`env.step("<think>..</think><search>q</search>")`, BM25 over the bundled corpus,
queries = HotpotQA dev questions, no query cache) after ``--warmup`` searches (Lucene's JIT compiles its search
over the first thousand or so), and, interleaved with them so machine noise hits both alike, the retriever's
`search(q, k)` alone. It prints both medians and the env's own share of a step, measured inside each step (step time
minus the time of the retrieval call it made, over step time). Target: at most 5%.

Two more measurements say where the env's own time goes: the same steps with retrieval a dict lookup (the env's
work with warm caches), and with a retriever that first writes to every cache line of 64 MiB and then looks up
(no JVM: a retriever that touches that much memory, as a search over an index does, leaves the env's Python to run
on cold caches). With ``--server-envs N`` it starts a local retrieval server (``python -m retrievers.server``) and
steps N envs together for ``--server-turns`` turns, each env searching a different dev question per turn, two
ways, interleaved: every env searching on its own (``query_cache=0``: N requests per turn; the env's share of
those steps is reported too), and the batched way of the agents' rollouts (`envs.batching.prefetch_searches`: one
request per turn, the envs' own searches answered from the shared cache). ``--json OUT`` also writes the figures
with their provenance (`envs.provenance`), which `python -m benchmarks.report ingest` stores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence

import gymnasium as gym

import envs  # noqa: F401  (registers the ids)
from envs.data import load_examples
from envs.rag_env import LIMIT_CAPS
from retrievers.base import clean_query

MAX_TURNS = LIMIT_CAPS["max_turns"]
"""Turns per episode: the most the env allows, so that measured steps are searches; an episode that reaches it is
reset (outside the timings) and the measurement goes on."""


EVICT_MIB = 64
"""Memory the cache-evicting retriever writes before it answers: twice the largest last-level cache of the machines
this runs on, so nothing the env touched before the search is still cached after it."""


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


class _Lookup:
    """A retriever that answers from a dict of passages already retrieved; with `evict_bytes`, it first writes to
    every cache line of that much memory (a search's memory traffic without its JVM)."""

    def __init__(self, passages, evict_bytes: int = 0) -> None:
        import numpy as np

        self.passages = passages
        self.memory = np.zeros(evict_bytes, dtype=np.uint8)

    def search(self, query, k):
        self.memory[::64] += 1
        return self.passages[query]

    def batch_search(self, queries, k):
        return [self.search(q, k) for q in queries]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2000, help="searches before measuring (Lucene's JIT)")
    parser.add_argument("--server-envs", type=int, default=0, help="envs per turn against a local server (0: skip)")
    parser.add_argument("--server-turns", type=int, default=12, help="measured turns of the server comparison")
    parser.add_argument("--json", default=None, help="also write the figures and their provenance to this file")
    args = parser.parse_args(argv)
    limits = (("--steps", 1), ("--top-k", 1), ("--warmup", 0), ("--server-envs", 0), ("--server-turns", 1))
    for flag, low in limits:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")

    # no query cache: every step must really search, or the comparison would flatter the env
    env = gym.make("RedCoda-HotpotQA-v0", top_k=args.top_k, max_turns=MAX_TURNS, query_cache=0).unwrapped
    retriever = env.retriever
    timed = env.retriever = _Timed(retriever)
    dev = [ex.question for ex in load_examples("hotpotqa", "dev")]
    queries = (dev * (args.steps // len(dev) + 1))[: args.steps]
    for q in (dev * (args.warmup // len(dev) + 1))[: args.warmup]:
        retriever.search(q, args.top_k)

    step_times, search_times, shares, own = _interleaved(env, timed, queries, args.top_k)

    passages = {clean_query(q): retriever.search(clean_query(q), args.top_k) for q in dict.fromkeys(queries)}
    free = _own_time(env, queries, _Lookup(passages))
    evicted = _own_time(env, queries, _Lookup(passages, EVICT_MIB << 20))
    env.retriever = retriever
    step, search = statistics.median(step_times), statistics.median(search_times)
    print(f"queries: {len(queries)} HotpotQA dev questions, top_k={args.top_k}, BM25 (Pyserini), bundled corpus")
    print(f"searches before measuring        : {args.warmup:8d}")
    print(f"median env.step(<search>)        : {step * 1e3:8.3f} ms")
    print(f"median retriever.search alone    : {search * 1e3:8.3f} ms")
    print(f"ratio step / search              : {step / search:8.3f}")
    print(f"env's own share, inside each step: {statistics.median(shares):8.1%}  (median; target <= 5%)")
    print(f"env's own time, inside each step : {statistics.median(own) * 1e6:8.1f} us (median)")
    print(f"a step, retrieval a dict lookup  : {free * 1e6:8.1f} us (median; the env's work with warm caches)")
    print(f"the same after {EVICT_MIB} MiB written   : {evicted * 1e6:8.1f} us (median; the env's work on cold caches)")
    result = {
        "kind": "env_overhead",
        "steps": len(queries),
        "top_k": args.top_k,
        "warmup": args.warmup,
        "step_ms": step * 1e3,
        "search_ms": search * 1e3,
        "env_share": statistics.median(shares),
        "env_us": statistics.median(own) * 1e6,
        "env_us_lookup": free * 1e6,
        "env_us_evicted": evicted * 1e6,
        "evict_mib": EVICT_MIB,
        "load_average": os.getloadavg()[0],
        "cores_allowed": len(os.sched_getaffinity(0)),  # fewer than the machine's under `taskset`
    }
    if args.server_envs > 0:
        result["server"] = server_comparison(args.server_envs, args.server_turns, args.top_k, args.warmup)
    if args.json:
        from envs.provenance import provenance

        result["provenance"] = provenance(seed=None, env_kwargs={"split": "dev", "top_k": args.top_k})
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)


def _interleaved(env, timed: _Timed, queries: list[str], k: int) -> tuple[list[float], ...]:
    """Search steps over `queries`, each beside the retriever's search alone: step times, search times, the env's
    own shares and own times."""
    retriever = timed.inner
    env.reset(seed=0)
    step_times, search_times, shares, own = [], [], [], []
    for i, q in enumerate(queries):
        if i and i % MAX_TURNS == 0:  # the episode's last turn was taken: a new one, outside the timings
            env.reset()
        action = f"<think>look it up</think><search>{q}</search>"
        if i % 2:  # alternate the order so neither side always runs on a warmer cache
            t0 = time.perf_counter()
            retriever.search(q, k)
            t1 = time.perf_counter()
            env.step(action)
            t2 = time.perf_counter()
            search_times.append(t1 - t0)
            step_times.append(t2 - t1)
        else:
            t0 = time.perf_counter()
            env.step(action)
            t1 = time.perf_counter()
            retriever.search(q, k)
            t2 = time.perf_counter()
            step_times.append(t1 - t0)
            search_times.append(t2 - t1)
        own.append(max(step_times[-1] - timed.last, 0.0))
        shares.append(own[-1] / step_times[-1])
    return step_times, search_times, shares, own


def _own_time(env, queries, retriever) -> float:
    """The env's median own time in `env.step(<search>)` over `queries` with `retriever` (step minus its search)."""
    timed = env.retriever = _Timed(retriever)
    own = []
    env.reset(seed=0)
    for i, q in enumerate(queries):
        if i and i % MAX_TURNS == 0:
            env.reset()
        start = time.perf_counter()
        env.step(f"<think>look it up</think><search>{q}</search>")
        own.append(time.perf_counter() - start - timed.last)
    return statistics.median(own)


def _start_server():
    """A local retrieval server (BM25 over the bundled corpus) that answers: ``(its process, its URL)``."""
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "retrievers.server", "--port", str(port)], stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600  # a first run builds the Lucene index
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the retrieval server did not start (exit status {server.poll()})")
        time.sleep(0.5)


def server_comparison(num_envs: int, turns: int, top_k: int, warmup: int = 0) -> dict[str, float]:
    """Per-env searches vs one batched request per turn, `num_envs` envs against a local retrieval server (sent
    `warmup` searches first); returns the envs, turns, both median turns in ms, and the env's own share and time
    in the per-env steps."""
    from envs.batching import prefetch_searches

    server, url = _start_server()
    try:
        settings = {"top_k": top_k, "max_turns": MAX_TURNS, "retriever": url}
        alone = [gym.make("RedCoda-HotpotQA-v0", query_cache=0, **settings).unwrapped for _ in range(num_envs)]
        for env in alone:
            env.retriever = _Timed(env.retriever)
        batched = [gym.make("RedCoda-HotpotQA-v0", query_cache=1 << 16, **settings) for _ in range(num_envs)]
        for env in alone + batched:
            env.reset(seed=0)
        questions = [ex.question for ex in load_examples("hotpotqa", "dev")]
        turns = min(turns, len(questions) // num_envs - 1)
        if warmup:
            alone[0].retriever.batch_search((questions * (warmup // len(questions) + 1))[:warmup], top_k)
        own: list[float] = []
        shares: list[float] = []

        def each_alone(actions: list[str]) -> None:
            for env, action in zip(alone, actions, strict=True):
                start = time.perf_counter()
                env.step(action)
                step = time.perf_counter() - start
                own.append(max(step - env.retriever.last, 0.0))
                shares.append(own[-1] / step)

        def together(actions: list[str]) -> None:
            prefetch_searches(batched, actions)
            for env, action in zip(batched, actions, strict=True):
                env.step(action)

        times: dict[str, list[float]] = {"alone": [], "together": []}
        for turn in range(turns + 1):  # turn 0 warms both clients and the server
            chunk = questions[turn * num_envs : (turn + 1) * num_envs]
            actions = [f"<think>look it up</think><search>{q}</search>" for q in chunk]
            order = [("alone", each_alone), ("together", together)]
            for name, run in order if turn % 2 else order[::-1]:  # neither side always meets a warmer server
                start = time.perf_counter()
                run(actions)
                if turn:
                    times[name].append(time.perf_counter() - start)
                elif name == "alone":  # the warm-up turn's steps are not measured
                    del own[:], shares[:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    alone_turn, batched_turn = statistics.median(times["alone"]), statistics.median(times["together"])
    print(f"server: {num_envs} envs, {turns} turns, top_k={top_k}, BM25 (Pyserini) at {url}")
    print(f"median turn, each env its own request ({num_envs} requests): {alone_turn * 1e3:8.1f} ms")
    print(f"median turn, one batched request                   : {batched_turn * 1e3:8.1f} ms")
    print(f"ratio own / batched                                : {alone_turn / batched_turn:8.2f}")
    share, env_us = statistics.median(shares), statistics.median(own) * 1e6
    print(f"env's own share of a per-env step (median)        : {share:8.1%}  ({env_us:.1f} us)")
    return {
        "envs": num_envs,
        "turns": turns,
        "alone_ms": alone_turn * 1e3,
        "batched_ms": batched_turn * 1e3,
        "env_share": share,
        "env_us": env_us,
    }


if __name__ == "__main__":
    main()
