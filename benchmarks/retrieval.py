"""Retrieval benchmark: quality, speed, build cost of BM25, dense (flat and HNSW) and hybrid on HotpotQA dev.

    nice -n 10 python -m benchmarks.retrieval                       # 200 bundled dev questions, k = 5
    python -m benchmarks.retrieval --questions 50 --repeats 1       # a quick look

Queries are the question texts; gold = the titles of the supporting facts. recall@k is the share of a
question's gold titles among the top-k titles, averaged over questions. Speed is queries per second over
all questions, one `search` call at a time and as one `batch_search` call (best of `--repeats` runs: the
machine may be shared). Indexes are built from scratch in a temporary cache so build times are real; the
dense index starts from the fp16 embeddings shipped in `retrievers/data/` (made on a GPU), and the CPU
cost of encoding the corpus is measured on `--encode-sample` paragraphs and extrapolated.

BM25 runs on two engines over the same Lucene index: "lucene" (Pyserini's searcher for every query) and
"matrix" (`retrievers.bm25_matrix`: Lucene's BM25 for a whole batch as one sparse product); the run checks
that both return the same ranked lists.

Side by side, in the same run, it also times the loops our wrappers replace:
- Pyserini's `LuceneSearcher.search`, one query at a time (the loop of Search-R1's BM25 server, with and
  without its per-hit `doc(docid).raw()` fetch), against our batched BM25 (both engines); raw loops read
  each hit's docid and score, the least any caller does;
- FAISS `index.search` one vector at a time against `DenseRetriever.search_vectors`, and the encoder plus
  `index.search` against `DenseRetriever.search`.
Results are printed as markdown and written as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import best_seconds

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "envs" / "data" / "hotpotqa" / "corpus.jsonl.gz"
DEV_FILE = ROOT / "envs" / "data" / "hotpotqa" / "dev.jsonl.gz"


def load_dev(path: Path, n: int) -> tuple[list[str], list[set[str]]]:
    """The first n questions of an official-format HotpotQA file and their supporting-fact titles."""
    questions, golds = [], []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            questions.append(row["question"])
            golds.append({title for title, _ in row["supporting_facts"]})
            if len(questions) == n:
                break
    return questions, golds


def recall_at(results: Sequence[Sequence], golds: Sequence[set[str]], k: int) -> float:
    """Mean share of gold titles among the top-k titles."""
    shares = [len(gold & {p.title for p in hits[:k]}) / len(gold) for hits, gold in zip(results, golds, strict=True)]
    return float(np.mean(shares))


def paired_best(
    fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Best time of each function, the functions interleaved so background load hits all alike.

    With `clock=time.process_time` the time is this process's CPU time (all its threads, the JVM's too):
    what a call costs, whatever other processes on a shared machine do meanwhile.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: JIT, caches
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: min(ts) for name, ts in times.items()}


def size_mb(path: Path) -> float:
    """Size of a file or directory tree in MB."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e6


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=200, help="dev questions (the bundled dev set has 200)")
    parser.add_argument("--k", type=int, default=5, help="passages per query in the speed runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    parser.add_argument(
        "--paired-repeats", type=int, default=15, help="interleaved runs of the cheap raw-vs-ours loops (best kept)"
    )
    parser.add_argument("--threads", type=int, default=2, help="BM25 batch_search threads")
    parser.add_argument(
        "--intra-threads",
        type=int,
        default=1,
        help="torch and FAISS threads per operation; 1 because on a shared, oversubscribed machine OpenMP "
        "spin-waits make one-query operations 20-40x slower with 2 threads (0: leave the libraries' defaults)",
    )
    parser.add_argument("--encode-sample", type=int, default=256, help="paragraphs encoded on CPU to time encoding")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "retrieval.json"))
    return parser


@dataclass(frozen=True)
class _Built:
    """Every retriever benchmarked, built from scratch, with what building each cost."""

    named: dict[str, Any]
    """Retriever by report name: bm25, bm25-matrix, bm25-python, dense-flat, dense-hnsw, hybrid."""
    builds: dict[str, tuple[float, float, str]]
    """Per name: build seconds, index MB, what was built."""
    encoder: Any
    encode_rate: float
    """CPU paragraphs per second of the dense encoder, on the sample."""
    sample: int
    """Paragraphs in that sample."""


def _build(corpus: Any, args: argparse.Namespace) -> _Built:
    """Build every retriever over `corpus` in the fresh cache, timing each build."""
    from retrievers.bm25 import BM25Retriever
    from retrievers.dense import DenseRetriever
    from retrievers.encoders import HFEncoder
    from retrievers.hybrid import HybridRetriever
    from retrievers.inmemory import InMemoryBM25

    start = time.perf_counter()
    bm25 = BM25Retriever(corpus, threads=args.threads)
    bm25_build = time.perf_counter() - start
    bm25_matrix = BM25Retriever(corpus, index_dir=bm25.index_dir, engine="matrix")
    start = time.perf_counter()
    bm25_matrix.matrix  # noqa: B018 -- built from the Lucene index now, so the build is timed
    matrix_build = time.perf_counter() - start
    matrix_file = next((Path(os.environ["REDCODA_CACHE"]) / "bm25_matrix").glob("*.npz"))

    start = time.perf_counter()
    python_bm25 = InMemoryBM25.for_corpus(corpus)
    python_build = time.perf_counter() - start

    encoder = HFEncoder(device="cpu")
    sample = [corpus.contents(i) for i in range(0, len(corpus), max(1, len(corpus) // args.encode_sample))]
    sample = sample[: args.encode_sample]
    encode_rate = len(sample) / best_seconds(lambda: encoder.encode_passages(sample, progress=False), 1)
    flat = DenseRetriever(corpus, encoder, kind="flat")
    hnsw = DenseRetriever(corpus, encoder, kind="hnsw", hnsw_m=32, ef_construction=200, ef_search=128)
    hybrid = HybridRetriever([bm25, flat], weights=[1.0, 1.0], rrf_k=60, depth=50)
    builds = {
        "bm25": (bm25_build, size_mb(bm25.index_dir), "Lucene index"),
        "bm25-matrix": (bm25_build + matrix_build, size_mb(bm25.index_dir) + size_mb(matrix_file), "+ matrix"),
        "bm25-python": (python_build, 0.0, "in memory, no JVM"),
        "dense-flat": (flat.build_seconds, size_mb(flat.index_path), "FAISS add; + embeddings"),
        "dense-hnsw": (hnsw.build_seconds, size_mb(hnsw.index_path), "FAISS add; + embeddings"),
        "hybrid": (bm25_build + flat.build_seconds, size_mb(bm25.index_dir) + size_mb(flat.index_path), "both"),
    }
    named = {
        "bm25": bm25,
        "bm25-matrix": bm25_matrix,
        "bm25-python": python_bm25,
        "dense-flat": flat,
        "dense-hnsw": hnsw,
        "hybrid": hybrid,
    }
    return _Built(named, builds, encoder, encode_rate, len(sample))


def _quality_and_speed(built: _Built, questions: list[str], golds: list[set[str]], k: int, reps: int) -> dict:
    """Per retriever: recall@1/3/5, queries/s one at a time and batched, build seconds and index size."""
    measured = {}
    for name, retriever in built.named.items():
        results = retriever.batch_search(questions, max(k, 5))
        [retriever.search(q, k) for q in questions]  # warm-up of the one-query path (the JVM's JIT above all)
        single = best_seconds(lambda r=retriever: [r.search(q, k) for q in questions], reps)
        batched = best_seconds(lambda r=retriever: r.batch_search(questions, k), reps)
        build, size, what = built.builds[name]
        measured[name] = {
            "recall@1": recall_at(results, golds, 1),
            "recall@3": recall_at(results, golds, 3),
            "recall@5": recall_at(results, golds, 5),
            "qps_single": len(questions) / single,
            "qps_batched": len(questions) / batched,
            "build_s": build,
            "size_mb": size,
            "build_note": what,
        }
    return measured


class _RawLucene:
    """Pyserini's `LuceneSearcher` over our BM25 index, called as raw callers call it."""

    def __init__(self, index_dir: Path, questions: list[str], k: int) -> None:
        from pyserini.search.lucene import LuceneSearcher

        self.raw = LuceneSearcher(str(index_dir))
        self.raw.set_bm25(0.9, 0.4)
        self.questions, self.k = questions, k
        self.qids = [str(i) for i in range(len(questions))]

    def search_loop(self) -> list:  # the least any caller of the one-query API does: docid and score
        return [[(h.docid, h.score) for h in self.raw.search(q, self.k)] for q in self.questions]

    def batch_search(self, threads: int) -> dict:
        hits = self.raw.batch_search(self.questions, self.qids, self.k, threads)
        return {qid: [(h.docid, h.score) for h in found] for qid, found in hits.items()}

    def search_r1_loop(self, queries: Sequence[str]) -> None:  # Search-R1 retrieval_server.py BM25Retriever
        for q in queries:
            for hit in self.raw.search(q, self.k):
                doc = self.raw.doc(hit.docid)  # Search-R1 reads the stored raw JSON; our index stores contents
                json.loads(doc.raw()) if doc.raw() else doc.contents()


def _wall_loops(built: _Built, raw: _RawLucene, args: argparse.Namespace) -> tuple[dict, dict, dict, list]:
    """Raw engines against our wrappers in wall-clock time, interleaved: Lucene, GRPO-shaped Lucene, FAISS.

    Returns the three timing dicts and the query vectors one row at a time (the CPU-time loops reuse them).
    """
    from retrievers.cached import CachedRetriever

    questions, k, reps = raw.questions, args.k, args.repeats
    bm25, bm25_matrix, flat = built.named["bm25"], built.named["bm25-matrix"], built.named["dense-flat"]
    lucene = paired_best(
        {
            "raw_search_loop": raw.search_loop,
            "search_r1_loop": lambda: raw.search_r1_loop(questions),
            "ours_search_loop": lambda: [bm25.search(q, k) for q in questions],
            "raw_batch_search": lambda: raw.batch_search(args.threads),
            "ours_batch_search": lambda: bm25.batch_search(questions, k),
            "ours_matrix_batch_search": lambda: bm25_matrix.batch_search(questions, k),
            "raw_batch_search_1_thread": lambda: raw.batch_search(1),
        },
        args.paired_repeats,
    )
    # A GRPO-shaped load: every question asked by a group of G=5 rollouts in one batch. The LRU cache sends
    # each distinct query to Lucene once; compare with Search-R1's loop over all 5 x n queries.
    group = [q for q in questions for _ in range(5)]
    grpo = paired_best(
        {
            "search_r1_loop_grpo_g5": lambda: raw.search_r1_loop(group),
            "cached_batch_grpo_g5": lambda: CachedRetriever(bm25).batch_search(group, k),
        },
        reps,
    )
    qvecs = built.encoder.encode_queries(questions)
    rows = [qvecs[i : i + 1] for i in range(len(questions))]
    dense_times = paired_best(
        {
            "raw_faiss_loop": lambda: [flat.index.search(v, k) for v in rows],
            "ours_vectors_loop": lambda: [flat.search_vectors(v, k) for v in rows],
        },
        args.paired_repeats,
    )
    dense_times |= paired_best(
        {
            "raw_encode_faiss_loop": lambda: [
                flat.index.search(built.encoder.encode_queries([q]), k) for q in questions
            ],
            "ours_search_loop": lambda: [flat.search(q, k) for q in questions],
        },
        reps,
    )
    return lucene, grpo, dense_times, rows


def _cpu_loops(built: _Built, raw: _RawLucene, args: argparse.Namespace, rows: list) -> dict:
    """Wrapper overheads in CPU time (robust to other processes' load): the same loops, raw engine vs ours."""
    questions, k = raw.questions, args.k
    bm25, bm25_matrix, flat = built.named["bm25"], built.named["bm25-matrix"], built.named["dense-flat"]
    cpu = paired_best(
        {
            "lucene_raw_search_loop": raw.search_loop,
            "lucene_ours_search_loop": lambda: [bm25.search(q, k) for q in questions],
            "lucene_raw_batch_search": lambda: raw.batch_search(args.threads),
            "lucene_ours_batch_search": lambda: bm25.batch_search(questions, k),
            "matrix_ours_batch_search": lambda: bm25_matrix.batch_search(questions, k),
            "faiss_raw_loop": lambda: [flat.index.search(v, k) for v in rows],
            "faiss_ours_vectors_loop": lambda: [flat.search_vectors(v, k) for v in rows],
        },
        args.paired_repeats,
        clock=time.process_time,
    )
    cpu |= paired_best(
        {
            "dense_raw_encode_faiss_loop": lambda: [
                flat.index.search(built.encoder.encode_queries([q]), k) for q in questions
            ],
            "dense_ours_search_loop": lambda: [flat.search(q, k) for q in questions],
        },
        args.repeats,
        clock=time.process_time,
    )
    return cpu


def _targets(report: dict, lucene: dict, grpo: dict, cpu: dict, work: float, per_call: float) -> dict[str, float]:
    """The ratios the retrieval layer is held to, each named with its target."""
    return {
        "bm25_batched_over_raw_single_loop (>= 4)": lucene["raw_search_loop"] / lucene["ours_matrix_batch_search"],
        "bm25_batched_over_search_r1_loop (>= 4)": lucene["search_r1_loop"] / lucene["ours_matrix_batch_search"],
        "bm25_batched_over_raw_single_loop_cpu (>= 4)": cpu["lucene_raw_search_loop"] / cpu["matrix_ours_batch_search"],
        "bm25_lucene_engine_batched_over_raw_single_loop": lucene["raw_search_loop"] / lucene["ours_batch_search"],
        "bm25_lucene_engine_batched_over_search_r1_loop": lucene["search_r1_loop"] / lucene["ours_batch_search"],
        "bm25_cached_batch_over_search_r1_loop_grpo_g5 (>= 4)": grpo["search_r1_loop_grpo_g5"]
        / grpo["cached_batch_grpo_g5"],
        "bm25_lucene_engine_free_cores_needed_for_4x (cpu)": 4 * work / (work + per_call),
        "hnsw_recall@5_over_flat (>= 0.97)": report["retrievers"]["dense-hnsw"]["recall@5"]
        / report["retrievers"]["dense-flat"]["recall@5"],
        "bm25_single_cpu_overhead_vs_raw (<= 0.10)": cpu["lucene_ours_search_loop"] / cpu["lucene_raw_search_loop"] - 1,
        "bm25_batch_cpu_overhead_vs_raw (<= 0.10)": cpu["lucene_ours_batch_search"] / cpu["lucene_raw_batch_search"]
        - 1,
        "faiss_vectors_cpu_overhead_vs_raw (<= 0.10)": cpu["faiss_ours_vectors_loop"] / cpu["faiss_raw_loop"] - 1,
        "dense_search_cpu_overhead_vs_raw (<= 0.10)": cpu["dense_ours_search_loop"] / cpu["dense_raw_encode_faiss_loop"]
        - 1,
        "bm25_single_wall_overhead_vs_raw (noisy)": lucene["ours_search_loop"] / lucene["raw_search_loop"] - 1,
        "bm25_batch_wall_overhead_vs_raw (noisy)": lucene["ours_batch_search"] / lucene["raw_batch_search"] - 1,
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)

    os.environ["REDCODA_CACHE"] = tempfile.mkdtemp(prefix="redcoda-bench-")  # fresh builds, timed
    import faiss
    import torch

    from retrievers.corpus import Corpus

    if args.intra_threads > 0:
        torch.set_num_threads(args.intra_threads)
        faiss.omp_set_num_threads(args.intra_threads)
    corpus = Corpus.from_jsonl(CORPUS_FILE, name="hotpotqa")
    questions, golds = load_dev(DEV_FILE, args.questions)
    report: dict = {
        "command": " ".join(["python -m benchmarks.retrieval", *(sys.argv[1:] if argv is None else argv)]).strip(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, faiss threads {faiss.omp_get_max_threads()}, BM25 batch threads {args.threads}, "
        f"faiss {faiss.__version__}, load average before start {os.getloadavg()[0]:.1f}",
        "questions": len(questions),
        "corpus_paragraphs": len(corpus),
        "retrievers": {},
    }
    built = _build(corpus, args)
    report["retrievers"] = _quality_and_speed(built, questions, golds, args.k, args.repeats)
    report["dense_encoding"] = {
        "cpu_paragraphs_per_s": built.encode_rate,
        "cpu_full_corpus_s_estimate": len(corpus) / built.encode_rate,
        "sample_paragraphs": built.sample,
        "embeddings_mb": size_mb(ROOT / "retrievers" / "data" / "hotpotqa-minilm" / "embeddings.npy"),
        "shipped_from": json.loads((ROOT / "retrievers" / "data" / "hotpotqa-minilm" / "meta.json").read_text()),
    }

    # Raw engines against our wrappers, interleaved in one run.
    bm25, bm25_matrix = built.named["bm25"], built.named["bm25-matrix"]
    raw = _RawLucene(bm25.index_dir, questions, args.k)
    lucene, grpo, dense_times, rows = _wall_loops(built, raw, args)
    n = len(questions)
    report["raw_vs_ours_qps"] = {
        "lucene": {name: n / s for name, s in lucene.items()},
        "faiss_flat": {name: n / s for name, s in dense_times.items()},
        "lucene_grpo_g5": {name: 5 * n / s for name, s in grpo.items()},
    }
    cpu = _cpu_loops(built, raw, args, rows)
    report["cpu_ms_per_query"] = {name: 1e3 * s / n for name, s in cpu.items()}
    # Why batching alone cannot give 4x here: CPU per query of Lucene's own work (the batch call, all threads)
    # against the Python/JNI cost the one-query loop adds per call; T free cores divide only the former by T.
    work = cpu["lucene_raw_batch_search"] / n
    per_call = max(cpu["lucene_raw_search_loop"] / n - work, 0.0)
    report["bm25_cost_per_query_ms"] = {"lucene_work": 1e3 * work, "per_call_overhead": 1e3 * per_call}
    lucene_lists = [[p.doc_id for p in hits] for hits in bm25.batch_search(questions, 20)]
    matrix_lists = [[p.doc_id for p in hits] for hits in bm25_matrix.batch_search(questions, 20)]
    report["bm25_engines_same_top20_share"] = float(
        np.mean([a == b for a, b in zip(lucene_lists, matrix_lists, strict=True)])
    )
    report["targets"] = _targets(report, lucene, grpo, cpu, work, per_call)

    print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return report


def print_report(report: dict) -> None:
    """Print the report as markdown tables."""
    print(f"command: {report['command']}\nmachine: {report['machine']}")
    print(f"{report['questions']} HotpotQA dev questions, corpus {report['corpus_paragraphs']} paragraphs\n")
    print("| retriever | R@1 | R@3 | R@5 | q/s single | q/s batched | build s | index MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in report["retrievers"].items():
        print(
            f"| {name} | {r['recall@1']:.3f} | {r['recall@3']:.3f} | {r['recall@5']:.3f} | {r['qps_single']:.1f} "
            f"| {r['qps_batched']:.1f} | {r['build_s']:.2f} | {r['size_mb']:.1f} |"
        )
    enc = report["dense_encoding"]
    print(
        f"\ndense encoding (all-MiniLM-L6-v2 fp32, CPU): {enc['cpu_paragraphs_per_s']:.1f} paragraphs/s on "
        f"{enc['sample_paragraphs']} sampled paragraphs -> ~{enc['cpu_full_corpus_s_estimate'] / 60:.1f} min for the "
        f"corpus; shipped fp16 embeddings ({enc['embeddings_mb']:.1f} MB) took "
        f"{enc['shipped_from']['encode_seconds']} s on {enc['shipped_from']['encode_device']}"
    )
    print("\n| engine | loop | q/s (wall clock) |\n| --- | --- | --- |")
    for engine, loops in report["raw_vs_ours_qps"].items():
        for loop, qps in loops.items():
            print(f"| {engine} | {loop} | {qps:.1f} |")
    print("\n| loop | CPU ms per query |\n| --- | --- |")
    for loop, ms in report["cpu_ms_per_query"].items():
        print(f"| {loop} | {ms:.3f} |")
    cost = report["bm25_cost_per_query_ms"]
    print(
        f"\nBM25 cost per query: Lucene work {cost['lucene_work']:.3f} ms, per-call Python/JNI overhead of the "
        f"one-query loop {cost['per_call_overhead']:.3f} ms"
    )
    print(f"BM25 engines: same top-20 lists on {100 * report['bm25_engines_same_top20_share']:.1f}% of the questions")
    print("\n| target | value |\n| --- | --- |")
    for target, value in report["targets"].items():
        print(f"| {target} | {value:.3f} |")


if __name__ == "__main__":
    main()
