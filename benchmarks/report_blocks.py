"""The blocks `benchmarks.report` writes into README.md and docs/results/*.md, each made from the results store.

A block is a function of the store and its argument that returns Markdown; a page holds it between
``<!-- report:NAME ARG -->`` and ``<!-- /report -->``. `BLOCKS` names them all.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks import results_store
from benchmarks.results_store import StoredRun

SYSTEM_LABELS = {
    "red_grpo": "GRPO + RED",
    "grpo_sft": "GRPO + fixed SFT, 0.1",
    "grpo_sft:sft_coef=0.4": "GRPO + fixed SFT, 0.4",
    "grpo": "GRPO alone",
    "sft": "SFT alone",
}
"""How the pages name a comparison's systems."""
MAIN_JOB_SEEDS = ("main-job-validation-seed0", "main-job-validation-seed1", "main-job-validation-seed2",
                  "main-job-validation-seed3")  # fmt: skip
"""The stored main job runs behind the headline: the preset with a validation choice, seeds 0-3, dev 0-99."""
HEADLINE = (("1, flat, 84 steps", "compare-cpu-flat-84"), ("1, CoDA, 66 steps", "compare-cpu-coda-66"),
            ("2, flat, 84 steps from a warm start", "compare-cpu-flat-warm"))  # fmt: skip
"""The comparison headline's rows: regime and stored comparison."""


def load(name: str) -> StoredRun:
    """A stored run from the store the report reads (`results_store.STORE`, looked up at each call)."""
    return results_store.load(name, results_store.STORE)


def p_value(p: float) -> str:
    """A p-value as the pages print it: two significant digits."""
    return f"{p:.2g}"


def _mean(cell: Any) -> float:
    return cell["mean"] if isinstance(cell, dict) else float(cell)


def _interval(cell: Any) -> str:
    if isinstance(cell, dict):
        return f"{cell['mean']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"
    return f"{float(cell):.3f}"


def _diff(cell: Any) -> str:
    return f"{cell['mean']:+.3f} [{cell['low']:+.3f}, {cell['high']:+.3f}]"


def _rows(run: StoredRun, table: str) -> list[dict[str, Any]]:
    return [r for r in run.rows if r["table"] == table]


def _system_side(run: StoredRun, system: str) -> str:
    """One system of a stored comparison as a side of `results_store.paired_stats`: its seeds' parts, comma-joined
    (``start model``: the untrained model's part)."""
    if system == "start model":
        return f"{run.name}:untrained"
    stem = re.escape(results_store.system_slug(system))
    parts = sorted({q["part"] for q in run.questions if re.fullmatch(stem + r"-seed\d+", q["part"])})
    if not parts:
        raise SystemExit(f"{run.name}: the store holds no per-question results for {system}")
    return ",".join(f"{run.name}:{part}" for part in parts)


@functools.lru_cache(maxsize=256)
def _paired(a: str, b: str, metric: str, without_yes_no: bool, store: str) -> dict[str, float | int]:
    """`results_store.paired_stats`, once a process for each pair: the headline, README and a comparison's own rows
    ask for the same pairs, and a report reads a store that does not change while it runs."""
    return results_store.paired_stats(a, b, metric, Path(store), without_yes_no)


def red_minus(run: StoredRun, other: str, metric: str = "f1", without_yes_no: bool = False) -> dict[str, Any]:
    """RED minus `other` in a stored comparison, by question over the seeds (`results_store.paired_stats`: the
    difference with its BCa interval, the paired permutation p, the questions)."""
    a, b = _system_side(run, "red_grpo"), _system_side(run, other)
    return _paired(a, b, metric, without_yes_no, str(results_store.STORE))


def systems(name: str) -> str:
    """A stored comparison's systems: EM, F1 with its interval across seeds and each seed's, valid answers, searches."""
    run = load(name)
    per_seed: dict[str, list[float]] = {}
    for row in _rows(run, "runs"):
        per_seed.setdefault(row["run"].rsplit("-seed", 1)[0], []).append(row["F1"])
    lines = [
        "| system | EM | F1 [95% CI across seeds] (per seed) | valid answers | searches / q |",
        "|---|---|---|---|---|",
    ]
    for row in _rows(run, "systems"):
        algo = row["algorithm"]
        label = SYSTEM_LABELS.get(algo, "the start model, no RL" if "start model" in algo else algo)
        seeds = ", ".join(f"{f:.3f}" for f in per_seed.get(algo, []))
        f1 = _interval(row["F1"]) + (f" ({seeds})" if seeds else "")
        valid = f"{_mean(row['valid answers']):.3f}" if "valid answers" in row else "-"  # not every table had it
        lines.append(f"| {label} | {_mean(row['EM']):.3f} | {f1} | {valid} | {_mean(row['searches/q']):.2f} |")
    return "\n".join(lines)


def comparison_steps(name: str) -> str:
    """A stored comparison's steps from its runs' metrics rows, seed by seed: the RL steps, those where every group
    tied (no advantage: the update is the SFT term alone), and for RED the steps where its SFT weight ``w`` sat at
    5 (the accuracy factor's cap times an entropy weight of 1), above 5, at 1, and where its entropy weight sat at
    its floor 1. "-" where the runs did not log what a column needs."""
    run = load(name)
    by_system: dict[str, list[list[dict[str, Any]]]] = {}
    for part in sorted({r["run"] for r in run.metrics if "-seed" in r["run"]}):
        steps = [r for r in run.metrics if r["run"] == part and "critic/rewards/mean" in r]
        by_system.setdefault(part.rsplit("-seed", 1)[0], []).append(steps)

    def per_seed(seeds: list[list[dict[str, Any]]], key: str, counted: Callable[[float], bool]) -> str:
        if not all(key in r for steps in seeds for r in steps):
            return "-"
        return " / ".join(str(sum(counted(r[key]) for r in steps)) for steps in seeds)

    lines = [
        "| system | steps | steps where every group tied | RED's w at 5 / above 5 / at 1 | RED's entropy weight at 1 |",
        "|---|---|---|---|---|",
    ]
    for system, seeds in by_system.items():
        label = next((v for k, v in SYSTEM_LABELS.items() if results_store.system_slug(k) == system), system)
        tied = per_seed(seeds, "critic/advantages/abs_mean", lambda a: a == 0)
        weight = entropy = "-"
        if system == "red_grpo":
            weight = "; ".join(
                per_seed(seeds, "sft/weight", test)
                for test in (lambda w: abs(w - 5) < 1e-9, lambda w: w > 5 + 1e-9, lambda w: abs(w - 1) < 1e-9)
            )
            entropy = per_seed(seeds, "red/entropy_weight", lambda e: abs(e - 1) < 1e-9)
        steps = " / ".join(str(len(s)) for s in seeds)
        lines.append(f"| {label} | {steps} | {tied} | {weight} | {entropy} |")
    return "\n".join(lines)


def paired(name: str) -> str:
    """RED minus each other system of a stored comparison, the rows its own table printed, each recomputed by
    question from the stored per-question results (`red_minus`)."""
    run = load(name)
    lines = ["| comparison | metric | difference [95% CI] | p | questions |", "|---|---|---|---|---|"]
    for row in _rows(run, "paired"):
        other = row["comparison"].removeprefix("red_grpo - ")
        metric, _, rest = row["metric"].partition(" ")
        got = red_minus(run, other, metric, without_yes_no=rest.startswith("without yes/no"))
        label = f"{metric} without yes/no" if rest else metric
        lines.append(
            f"| {row['comparison']} | {label} | {got['difference']:+.3f} [{got['low']:+.3f}, {got['high']:+.3f}] | "
            f"{p_value(got['p'])} | {got['n']} |"
        )
    return "\n".join(lines)


def comparison_headline(_: str = "") -> str:
    """F1 of each system and RED's paired differences, per regime (recorded comparisons)."""
    lines = [
        "| regime, protocol | RED F1 | GRPO + SFT 0.1 | GRPO + SFT 0.4 | GRPO | RED - SFT 0.1 (paired) "
        "| RED - SFT 0.4 (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for regime, name in HEADLINE:
        run = load(name)
        f1 = {r["algorithm"]: _mean(r["F1"]) for r in _rows(run, "systems")}
        cells = [f"{f1[a]:.3f}" if a in f1 else "-" for a in ("red_grpo", "grpo_sft", "grpo_sft:sft_coef=0.4", "grpo")]
        for other in ("grpo_sft", "grpo_sft:sft_coef=0.4"):
            if other not in f1:
                cells.append("-")
                continue
            got = red_minus(run, other)
            cells.append(f"{got['difference']:+.3f}, p {p_value(got['p'])}")
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _trained(run: StoredRun) -> list[dict[str, Any]]:
    """A stored trainer run's per-question outcomes of the trained model (the ``after`` part)."""
    return [q for q in run.questions if q["part"] == "after"]


def _after(run: StoredRun) -> dict[str, Any]:
    return next(r for r in _rows(run, "before_after") if r["model"].startswith("after"))


def main_job_validation(_: str = "") -> str:
    """The four seeds of the preset with a validation choice: steps, the chosen step, held-out scores."""
    lines = [
        "| seed | steps | validation F1 by step (50 questions) | chosen | EM | F1 [95% CI], dev 0-99 | valid answers "
        "| searches / q |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in MAIN_JOB_SEEDS:
        run = load(name)
        summary, after = run.header["summary"], _after(run)
        by_step = sorted(summary["validation_f1"].items(), key=lambda item: -int(item[0]))
        scores = ", ".join(f"{step}: {f1:.3f}" for step, f1 in by_step)
        lines.append(
            f"| {run.header['provenance']['seed']} | {summary['steps']} | {scores} | {summary['chosen_step']} | "
            f"{_mean(after['EM']):.3f} | {_interval(after['F1'])} | {_mean(after['valid answers']):.3f} | "
            f"{_mean(after['searches / question']):.2f} |"
        )
    return "\n".join(lines)


def held_out(names: str) -> str:
    """Stored trainer runs (comma-joined names), one row each, recomputed from their per-question outcomes: EM, F1
    and valid answers with the evaluation's intervals (`agents.evaluation.interval_method`), searches, and the
    first-search split (questions whose first search showed the answer / did not / yes-no; "not replayed" where the
    stored questions carry no split, as a run restored from before the store)."""
    from agents.evaluation import interval_method
    from envs.stats import mean_ci

    lines = [
        "| run | seed | steps | EM | F1 | valid answers | searches / q | first search: shown / not / yes-no |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names.split(","):
        run = load(name)
        after = _trained(run)
        cells = []
        for field, metric in (("em", "em"), ("f1", "f1"), ("answered", "answered"), ("searches", "num_searches")):
            cells.append(mean_ci([q[field] for q in after], method=interval_method(metric)).format(3))
        split = [sum(q["first_search"] == c for q in after) for c in ("shown", "not shown", "yes/no")]
        split_cell = " / ".join(map(str, split)) if sum(split) == len(after) else "not replayed"
        provenance = run.header.get("provenance") or {}
        steps = (run.header.get("summary") or {}).get("steps", len(run.metrics))
        lines.append(f"| {name} | {provenance.get('seed')} | {steps} | " + " | ".join(cells) + f" | {split_cell} |")
    return "\n".join(lines)


def evaluations(names: str) -> str:
    """Stored `benchmarks.evaluate` results (comma-joined names), one row each: the agent and the means over its
    questions of EM, F1, format, searches and invalid actions, recomputed from the stored per-question outcomes."""
    lines = [
        "| agent | questions | EM | F1 | format | searches / q | invalid actions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names.split(","):
        run = load(name)
        after = _trained(run)
        means = [mean(q[f] for q in after) for f in ("em", "f1", "format", "searches", "invalid_actions")]
        cells = [f"{m:.3f}" for m in means[:3]] + [f"{means[3]:.2f}", f"{means[4]:.3f}"]
        lines.append(f"| {run.header['agent']} | {len(after)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_stats(arguments: str) -> str:
    """``A B [METRIC ...]``: `benchmarks.report stats` between two stored runs or sets of seeds, one row a metric."""
    a, b, *metrics = arguments.split()
    lines = ["| paired by question | metric | difference [95% CI] | p | questions |", "|---|---|---|---|---|"]
    for metric in metrics or ["f1"]:
        got = results_store.paired_stats(a, b, metric, results_store.STORE)
        lines.append(
            f"| {a} - {b} | {metric} | {got['difference']:+.3f} [{got['low']:+.3f}, {got['high']:+.3f}] | "
            f"{p_value(got['p'])} | {got['n']} |"
        )
    return "\n".join(lines)


PRESET_SEEDS = ("main-job-preset-seed0", "main-job-preset-seed1", "main-job-preset-seed2")
"""The current preset's main job on seeds 0-2: README's headline."""


def headline_f1() -> tuple[float, list[int]]:
    """The README's headline: mean held-out F1 of the preset's stored main jobs (per-question outcomes), and their
    seeds."""
    runs = [load(name) for name in PRESET_SEEDS]
    f1 = [mean(q["f1"] for q in _trained(r)) for r in runs]
    return mean(f1), [r.header["provenance"]["seed"] for r in runs]


PRESET_HISTORY = (
    ("demonstrations quote 12 words before answering", ("preset-history-flat-quote-seed0",),
     ("preset-history-coda-quote-seed0",)),
    ("answer-only demonstrations (`--quote-words 0`)", ("preset-history-flat-noquote-seed0",),
     ("preset-history-coda-noquote-seed0", "preset-history-coda-noquote-seed1")),
    ("gradient through the model's own tokens (`--no-context-grad`)",
     ("preset-history-flat-ncg-seed0", "preset-history-flat-ncg-seed1"),
     ("preset-history-coda-ncg-seed0", "preset-history-coda-ncg-seed1")),
    ("faster sampler (few-row products, shared prefixes)", ("preset-history-flat-fast-seed0",),
     ("preset-history-coda-fast-seed0",)),
    ("oracle fix (the top passage counted as shown)", ("preset-history-flat-oracle-seed0",), ()),
    ("CoDA: 2 planner + 6 executor contexts a minibatch; CoDA the default", (),
     ("preset-history-coda-share-seed0", "preset-history-coda-share-seed1", "preset-history-coda-share-seed2",
      "preset-history-coda-check-seed0")),
    ("static decode steps on the CPU", (), ("preset-history-coda-static-seed0", "preset-history-coda-static-seed1")),
    ("validation choice + question after results", (), MAIN_JOB_SEEDS),
)  # fmt: skip
"""The preset's history: each change, with the stored main jobs (flat, CoDA) that ran on the preset after it."""
PRESET_HISTORY_NOTES = {"preset-history-coda-quote-seed0": "one torch thread, under load"}
"""Runs of the history that ran under other conditions than the rest (idle, two torch threads)."""


def _steps_f1(name: str) -> str:
    """``steps, F1`` of a stored main job: F1 the mean of its per-question results, or, where they were never kept,
    the F1 its eval.md table printed, marked ``eval.md``; any note of `PRESET_HISTORY_NOTES` after it."""
    run = load(name)
    after = _trained(run)
    f1 = mean(q["f1"] for q in after) if after else _mean(_after(run)["F1"])
    notes = ([] if after else ["eval.md"]) + ([PRESET_HISTORY_NOTES[name]] if name in PRESET_HISTORY_NOTES else [])
    return f"{run.header['summary']['steps']}, {f1:.3f}" + (f" ({', '.join(notes)})" if notes else "")


def preset_history(_: str = "") -> str:
    """How the preset got here: one row a change of the cpu preset (`PRESET_HISTORY`), with the steps and held-out F1
    (dev 0-99) of each stored main job that ran after it, flat and CoDA, seed by seed."""
    lines = ["| preset change | flat: steps, F1 | CoDA: steps, F1 |", "|---|---|---|"]
    for change, flat, coda in PRESET_HISTORY:
        cells = ["; ".join(_steps_f1(name) for name in names) or "-" for names in (flat, coda)]
        lines.append(f"| {change} | {cells[0]} | {cells[1]} |")
    if any("(eval.md" in line for line in lines):
        lines += ["", "(eval.md): the F1 the run's eval.md table printed; its per-question results were never kept."]
    return "\n".join(lines)


def first_search(names: str) -> str:
    """Stored trainer runs (comma-joined names), one row each: held-out F1 [95% CI] on the questions whose first search
    (the question itself as the query) showed a gold answer, on those where it did not, and on yes/no questions, with
    the searches a question on the second (`envs.first_search`)."""
    from agents.evaluation import interval_method
    from envs.stats import mean_ci

    lines = [
        "| run | shown: n, F1 | not shown: n, F1 | not shown: searches / q | yes/no: n, F1 |",
        "|---|---|---|---|---|",
    ]
    for name in names.split(","):
        after = _trained(load(name))
        cells = []
        for kind in ("shown", "not shown", "yes/no"):
            f1 = [q["f1"] for q in after if q["first_search"] == kind]
            cells.append(f"{len(f1)}, {mean_ci(f1, method=interval_method('f1')).format(3)}" if f1 else "0, -")
        searches = [q["searches"] for q in after if q["first_search"] == "not shown"]
        cells.insert(2, f"{mean(searches):.2f}" if searches else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recorded_scale(name: str) -> str:
    """A stored record of scale steps copied from a measurement's printed output (its run folders not kept): one row
    a shape and setting, with the step's parts, its throughput and its peak memory."""
    run = load(name)

    def cell(value: Any, unit: str = "", digits: int = 2) -> str:
        return "" if value is None else f"{value:,.{digits}f}{unit}"

    lines = [
        "| shape, setting | step | generation | old log-probs | forward/backward | AdamW | sampled tok/s "
        "| trajectories/GPU/s | peak GPU memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in run.header["rows"]:
        step, generation = row["step_s"], row["generation_s"]
        share = f" ({generation / step:.0%})" if step and generation and row["old_logp_s"] is not None else ""
        peak = cell(row["peak_gib"], " GiB", 1)
        if row["estimate_gib"] is not None:
            peak += f" (estimate at start {row['estimate_gib']:.1f})"
        lines.append(
            f"| {row['shape']}, {row['setting']} | {cell(step, ' s', 1)} | {cell(generation, ' s', 1)}{share} | "
            f"{cell(row['old_logp_s'])} | {cell(row['forward_backward_s'])} | {cell(row['adamw_s'])} | "
            f"{cell(row['tokens_per_s'], '', 0)} | {cell(row['trajectories_per_gpu_s'])} | {peak} |"
        )
    return "\n".join(lines)


def step_signal(names: str) -> str:
    """Stored trainer runs (comma-joined names), one row each, from their metrics rows (`benchmarks.step_signal`):
    steps, the share of steps with an RL signal, the longest run of steps whose rollouts all scored F1 0, and for
    RED how often its entropy weight and accuracy factor sat strictly inside their bounds, and its mean weight."""
    from benchmarks.step_signal import summarize

    lines = [
        "| run | steps | steps with a signal | longest F1-0 run | RED entropy weight inside (1, G) "
        "| RED accuracy factor inside (1/G, G) | RED mean w |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names.split(","):
        run = load(name)
        if not run.metrics:
            raise SystemExit(f"{name}: the store holds no metrics rows for it")
        got = summarize(run.metrics, (run.header.get("config") or {}).get("red_max_factor", 5.0))
        red = [f"{got[k]:.2f}" if k in got else "-" for k in ("red_entropy_inside", "red_accuracy_inside")]
        weight = f"{got['red_weight_mean']:.2f}" if "red_weight_mean" in got else "-"
        lines.append(
            f"| {name} | {got['steps']} | {got['signal_steps']:.2f} | {got['longest_f1_zero_run']} | "
            f"{red[0]} | {red[1]} | {weight} |"
        )
    return "\n".join(lines)


def env_overhead(name: str) -> str:
    """A stored env_overhead run: the step, the retrieval alone, the env's share; the server comparison."""
    header = load(name).header
    lines = [
        "| measurement | value |",
        "|---|---|",
        # a record without the field was measured after 20 warm-up searches, the benchmark's count until it had one
        f"| searches before measuring (Lucene's JIT warm-up) | {header.get('warmup', 20)} |",
        f"| median `env.step(<search>)` | {header['step_ms']:.3f} ms |",
        f"| median `retriever.search` alone | {header['search_ms']:.3f} ms |",
        f"| env's own share inside each step (median of {header['steps']}) | {header['env_share']:.1%} "
        "(target <= 5%) |",
        f"| env's own time inside each step (median) | {header['env_us']:.1f} µs |",
        f"| a whole step with retrieval a dict lookup (median) | {header['env_us_lookup']:.1f} µs |",
    ]
    if "env_us_evicted" in header:
        lines.append(
            f"| the same after retrieval wrote {header['evict_mib']} MiB, no JVM (median) | "
            f"{header['env_us_evicted']:.1f} µs |"
        )
    machine = header["provenance"]["machine"]
    pinned = header.get("cores_allowed", machine["cores"]) < machine["cores"]
    lines += [
        f"| load average (1 min) at the end | {header['load_average']:.1f} |",
        f"| CPU | {machine['cpu']}, {machine['cores']} cores"
        + (f" (the process pinned to {header['cores_allowed']})" if pinned else "")
        + " |",
    ]
    server = header.get("server")
    if server:
        share = "env_share" in server
        lines += [
            "",
            "| envs per turn | each env its own request (median turn) | one batched request (median turn) | ratio |"
            + (" env's own share of a per-env step |" if share else ""),
            "|---:|---:|---:|---:|" + ("---:|" if share else ""),
            f"| {server['envs']} | {server['alone_ms']:.1f} ms ({server['envs']} requests) | "
            f"{server['batched_ms']:.1f} ms (1 request) | {server['alone_ms'] / server['batched_ms']:.2f} |"
            + (f" {server['env_share']:.1%} ({server['env_us']:.1f} µs) |" if share else ""),
        ]
    return "\n".join(lines)


def retrieval(name: str = "retrieval") -> str:
    """`benchmarks.retrieval`'s table: recall@1/3/5, queries a second one at a time and batched, build, size."""
    header = load(name or "retrieval").header
    lines = [
        "| retriever | R@1 | R@3 | R@5 | q/s single | q/s batched | build s | index MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, got in header["retrievers"].items():
        lines.append(
            f"| {kind} | {got['recall@1']:.3f} | {got['recall@3']:.3f} | {got['recall@5']:.3f} | "
            f"{got['qps_single']:.0f} | {got['qps_batched']:.0f} | {got['build_s']:.1f} | {got['size_mb']:.1f} |"
        )
    targets = header["targets"]
    lines += [
        "",
        f"Batched BM25 (matrix engine) over Search-R1's one-query server loop: "
        f"**{targets['bm25_batched_over_search_r1_loop (>= 4)']:.1f}x**; with the query cache on GRPO's load (5 "
        f"rollouts a question): {targets['bm25_cached_batch_over_search_r1_loop_grpo_g5 (>= 4)']:.1f}x. "
        f"Machine: {header['machine']}.",
    ]
    return "\n".join(lines)


def readme_results(_: str = "") -> str:
    """README's results table: only figures the store rebuilds, each with its seeds and page."""
    f1, seeds = headline_f1()
    flat, coda = load("compare-cpu-flat-84"), load("compare-cpu-coda-66")
    red_sft, red_sft4 = red_minus(flat, "grpo_sft"), red_minus(coda, "grpo_sft:sft_coef=0.4")
    retrieval = load("retrieval").header["targets"]["bm25_batched_over_search_r1_loop (>= 4)"]
    scale = load("scale-h200-recorded").header
    dynamic, graphs = (next(r for r in scale["rows"] if r["shape"] == "3B" and key in r["setting"]) for key in
                       ("dynamic", "graphs"))  # fmt: skip
    seed_text = f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    rows = [
        "| main job (the preset), untrained SmolLM2-135M -> held-out dev F1 "
        f"**{f1:.3f}** "
        f"(mean of {seed_text}, dev 0-99; 2-core CPU, 25 training minutes) "
        "| [main job](docs/results/main-job.md#seeds-0-2-of-the-preset) |",
        f"| flat, 3 seeds: RED over GRPO + SFT, paired dev F1 **{red_sft['difference']:+.3f}** "
        f"(permutation p {p_value(red_sft['p'])}) | [comparison](docs/results/comparison.md) |",
        f"| CoDA, 3 seeds: a fixed SFT weight of 0.4 over RED, paired dev F1 **{-red_sft4['difference']:+.3f}** "
        f"(permutation p {p_value(red_sft4['p'])}) | [comparison](docs/results/comparison.md) |",
        f"| batched BM25: **{retrieval:.1f}x** the queries/s of Search-R1's one-query server loop "
        "| [retrieval](docs/results/retrieval.md) |",
        f"| 3B shape on one H200, CUDA graphs: **{graphs['trajectories_per_gpu_s']:.2f}** trajectories/GPU/s, "
        f"{dynamic['step_s'] / graphs['step_s']:.1f}x the dynamic cache's step ({scale['date']}, copied from "
        "the printed output) | [scale](docs/results/scale.md#on-a-gpu-one-h200-2026-12-04-recorded-from-the-"
        "measurements-printed-output) |",
    ]
    return "\n".join(["| result | page |", "|---|---|", *rows])


BLOCKS: dict[str, Callable[[str], str]] = {
    "readme-results": readme_results,
    "comparison-headline": comparison_headline,
    "systems": systems,
    "paired": paired,
    "comparison-steps": comparison_steps,
    "main-job-validation": main_job_validation,
    "env-overhead": env_overhead,
    "retrieval": retrieval,
    "held-out": held_out,
    "evaluations": evaluations,
    "stats": paired_stats,
    "step-signal": step_signal,
    "first-search": first_search,
    "recorded-scale": recorded_scale,
    "preset-history": preset_history,
}
"""Every block a page may hold, by name (its argument, where it takes one, names a stored run)."""
