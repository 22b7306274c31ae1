"""The retrieval server's memory under a load of large responses: resident memory before, during and after.

Starts ``python -m retrievers.server`` (BM25 over the bundled corpus, its default heap and per-request cap) in a
subprocess on a free loopback port, then sends ``--requests`` requests from ``--clients`` threads, each asking
for as many passages as the server allows (``max_hits`` and ``max_batch`` from /health, e.g. 64 queries x top 128),
and samples the server's resident set size (VmRSS of the process) every 0.2 s.

    python -m benchmarks.server_memory [--requests 200] [--clients 4]

Prints the RSS after start-up (index loaded, JVM up), the peak under load, the RSS at the end, and the heap
bound the server ran with.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from envs.data import load_examples


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MB (Linux /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--topk", type=int, default=128)
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--clients", args.clients), ("--topk", args.topk)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "retrievers.server", "--port", str(port), "--max-topk", str(args.topk)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                health = httpx.get(f"{url}/health", timeout=5).json()
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(1)
        questions = [e.question for e in load_examples("hotpotqa", "train")]
        # as many queries as the server takes in one request (max_batch) with max_hits passages in all
        per_request = max(1, min(int(health.get("max_batch", 1 << 30)), int(health.get("max_hits", 8192)) // args.topk))
        start_rss = rss_mb(server.pid)
        peak, stop = [start_rss], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(rss_mb(server.pid))
                time.sleep(0.2)

        def request(i: int) -> int:
            queries = [questions[(i * per_request + j) % len(questions)] for j in range(per_request)]
            reply = httpx.post(
                f"{url}/retrieve", json={"queries": queries, "topk": args.topk, "return_scores": True}, timeout=120
            )
            reply.raise_for_status()
            return len(reply.content)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            sizes = list(pool.map(request, range(args.requests)))
        wall = time.perf_counter() - started
        stop.set()
        sampler.join()
        result = {
            "requests": args.requests,
            "clients": args.clients,
            "queries_per_request": per_request,
            "topk": args.topk,
            "response_mb_total": sum(sizes) / 1e6,
            "wall_s": wall,
            "rss_after_start_mb": start_rss,
            "rss_peak_mb": max(peak),
            "rss_end_mb": rss_mb(server.pid),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
