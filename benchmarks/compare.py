"""The algorithm comparison: GRPO, GRPO + fixed SFT, GRPO + RED and SFT alone on the same env, seeds and budget.

    python -m benchmarks.compare --algos grpo grpo_sft red_grpo --seeds 3 --budget cpu --threads 1
    python -m benchmarks.compare --budget gpu --protocol coda --out runs/compare-gpu-coda
    python -m benchmarks.compare --algos red_grpo grpo_sft grpo_sft:sft_coef=0.4 --seeds 3   # a variant as a system
    python -m benchmarks.compare --algos sft red_grpo grpo_sft --warm-start-steps 24         # RL vs more SFT
    python -m benchmarks.compare --algos red_grpo grpo_sft grpo_expert --seeds 3            # experts in the groups

For every (system, seed) it trains with `python -m algos.<algo>` in a subprocess on the same env, data order (the
seed fixes it for every system) and budget, then scores the final model greedily with `algos.run.evaluation` on the
same held-out questions in the runs' env, beside the start model (untrained, `--init-model`, or the shared SFT
warm start of `--warm-start-steps`). A system is an algorithm, or one with trainer settings of its own:
`grpo_sft:sft_coef=0.4` trains with `--sft-coef 0.4` (any `Config` field, `name=value`, comma-separated), its runs
in `runs/grpo_sft-sft_coef0.4-seed<s>/`; `grpo_expert` (oracle episodes inside the GRPO groups) also takes its own
settings, `grpo_expert:expert_shaping=0.2`. `sft` is the SFT-only arm: `python -m algos.sft`, its own defaults, with
the same budget flags as every other system. Paired by question: RED minus every other system; without RED, `sft`
minus every other; else the first system minus the rest.

`--out` receives table.md and table.csv (mean and 95% CI across seeds, paired tests, one line per run), the learning
curves, report.json, `runs/` and `evals/` (docs/results/comparison.md lists every file). An interrupted comparison
resumes: finished runs and evaluations are kept, an unfinished training continues from its checkpoint. An
evaluation whose sampler or retriever errs on more than `--max-error-rate` of its episodes (5%) ends it with one line.
Invocations side by side share the runs (each is trained, then scored, by one of them; another skips it and names it
as left out). Runs go seed by seed, so two invocations side by side train one seed's arms at the same time, sharing
the machine's load. `--report-only` trains and scores nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.evaluation import MAX_ERROR_RATE, EvaluationFailed
from benchmarks.compare_checks import (
    duplicate_problem,
    evaluation_current,
    flag_names,
    owned_problem,
    run_problems,
)
from benchmarks.compare_report import (
    paired_tests,
    pairing_reference,
    plot,
    summary_row,
    write_tables,
)
from benchmarks.compare_runs import (
    ALGOS,
    BUDGETS,
    Budget,
    ClaimedElsewhere,
    System,
    code_version,
    evaluate_run,
    evaluation_key,
    expected_run_settings,
    metric_total,
    parse_system,
    run_config,
    train,
    warm_start,
)
from envs.provenance import provenance

__all__ = [
    "main",
]


def _parser() -> argparse.ArgumentParser:
    from algos.registry import algorithm_names

    parser = argparse.ArgumentParser(
        description="Compare GRPO, GRPO + SFT, GRPO + RED and SFT alone (sft) on the same env."
    )
    parser.add_argument(
        "--algos",
        nargs="+",
        default=list(ALGOS),
        metavar="SYSTEM",
        help=f"systems to compare: registered algorithms ({', '.join(algorithm_names())}; sft: `python -m algos.sft` "
        "alone, the same budget), or one with its own settings, e.g. grpo_sft:sft_coef=0.4, sft:lr=5e-5 or "
        "grpo_expert:expert_shaping=0.2",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every algorithm")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="override the budget's training steps")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train every run for at most this many minutes (with --steps as the bound on steps)",
    )
    parser.add_argument("--eval-limit", type=int, default=None, help="override the budget's held-out questions")
    parser.add_argument("--protocol", choices=("flat", "coda"), default="flat")
    parser.add_argument("--out", default=None, help="results folder (default runs/compare-<budget>-<protocol>)")
    parser.add_argument("--no-baseline", action="store_true", help="skip evaluating the untrained model")
    parser.add_argument(
        "--train-arg",
        action="append",
        default=[],
        help="extra trainer flag (repeatable), not one the comparison sets itself (seed, run directory, steps, ...)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads of every training and evaluation")
    parser.add_argument("--init-model", default=None, help="start every run (and the baseline) from this model")
    parser.add_argument(
        "--max-error-rate",
        type=float,
        default=MAX_ERROR_RATE,
        help="fail (exit 1) when an evaluation's sampler or retriever errs on more than this share of episodes",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train and evaluate nothing: the report over the runs already finished and scored (safe while others run)",
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=0,
        help="first run `python -m algos.sft` for N steps and start every run from its model",
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, systems: list[System]) -> None:
    """Refuse, in one line before anything trains, numbers out of range, a start model that holds no model, and
    trainer settings (``--train-arg``, a system's own) that its trainer would refuse."""
    from algos.run.cli import parse_config

    for flag, value, low in (
        ("--seeds", args.seeds, 1),
        ("--steps", args.steps, 1),
        ("--eval-limit", args.eval_limit, 1),
        ("--threads", args.threads, 1),
        ("--warm-start-steps", args.warm_start_steps, 0),
    ):
        if value is not None and value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if not 0.0 <= args.max_error_rate <= 1.0:
        parser.error(f"--max-error-rate is a share in [0, 1], got {args.max_error_rate}")
    if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
        parser.error(f"--minutes must be a number > 0, got {args.minutes}")
    problems = [owned_problem("--train-arg", flag_names(args.train_arg)), duplicate_problem(systems)]
    problems += [owned_problem(f"--algos {system.name}", flag_names(system.flags)) for system in systems]
    for problem in filter(None, problems):
        parser.error(problem)
    budget = BUDGETS[args.budget]
    common = ["--preset", budget.preset, "--protocol", args.protocol, *budget.train_args, *_minutes(args)]
    common += args.train_arg
    if args.init_model:
        common += ["--model", args.init_model]
    for system in systems:  # each trainer's own parser: its one line, exit 2, for a setting it refuses
        parse_config([*common, *system.flags], algo=system.algo)


@dataclasses.dataclass
class _Results:
    """What the runs left for the report, filled system by system."""

    run_dirs: dict[str, list[Path]] = dataclasses.field(default_factory=dict)
    evals: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)


def _run_systems(
    systems: list[System], args: argparse.Namespace, budget: Budget, config: Any, out: Path, got: _Results
) -> None:
    """Train (or read) and score every (system, seed), adding what finished to `got` system by system.

    Seed by seed, every system of a seed before the next seed: two invocations side by side then train the arms of
    one seed at the same time (the second skips the run the first has claimed and takes the next system), so the
    arms of a seed share whatever load the machine carries."""
    done: dict[str, list[tuple[Path, dict[str, Any], dict[str, Any]]]] = {system.name: [] for system in systems}
    for seed in range(args.seeds):
        for system in systems:
            finished = _run_one(system, seed, args, budget, config, out, got)
            if finished is not None:
                done[system.name].append(finished)
    for system in systems:
        if not done[system.name]:
            continue
        evals = [result for _, _, result in done[system.name]]
        summaries = [summary for _, summary, _ in done[system.name]]
        for run_dir, summary, result in done[system.name]:
            got.run_dirs.setdefault(system.name, []).append(run_dir)
            got.runs.append({**summary, "system": system.name, "eval": result["metrics"]})
        got.rows.append(summary_row(system.name, evals, summaries))
        got.evals[system.name] = evals


def _run_one(
    system: System, seed: int, args: argparse.Namespace, budget: Budget, config: Any, out: Path, got: _Results
) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    """Train (or read) and score one seed of one system: its run folder, training summary and evaluation, or None
    (named in `got.missing`) when it is not finished or another invocation holds it."""
    name = f"{system.slug}-seed{seed}"
    run_dir = out / "runs" / name
    if args.report_only:
        if not (run_dir / "summary.json").exists() or not (out / "evals" / f"{name}.json").exists():
            got.missing.append(name)
            return None
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        try:
            summary = train(system.algo, seed, budget, args.protocol, run_dir, args.threads, system.flags)
        except ClaimedElsewhere as err:  # a stream beside this one trains it: go on with the others
            print(f"[compare] skipped: {err}", flush=True)
            got.missing.append(name)
            return None
    summary.setdefault("tokens_sampled", metric_total(run_dir, "tokens/sampled"))
    try:
        result = evaluate_run(
            name, summary["final_model"], budget, config, out / "evals", args.max_error_rate, str(run_dir / "final")
        )
    except ClaimedElsewhere as err:  # a stream beside this one scores it now
        print(f"[compare] skipped: {err}", flush=True)
        got.missing.append(name)
        return None
    return run_dir, summary, result


def _score_baseline(args: argparse.Namespace, budget: Budget, config: Any, out: Path, got: _Results) -> None:
    """Score the start model once on the same questions (the baseline row), unless `--no-baseline`."""
    if args.report_only and not args.no_baseline and not (out / "evals" / "untrained.json").exists():
        got.missing.append("untrained")
        return
    if args.no_baseline:
        return
    model: Any = args.init_model or config.model.model
    if model == "tiny":  # the trainer's tiny preset builds its model from a config, seeded like the runs
        from agents.models import tiny_model

        model = tiny_model(seed=0)
    try:
        base = evaluate_run(
            "untrained",
            model,
            budget,
            config,
            out / "evals",
            args.max_error_rate,
            _start_label(config, args.init_model),
        )
    except ClaimedElsewhere as err:
        print(f"[compare] skipped: {err}", flush=True)
        got.missing.append("untrained")
    else:
        got.rows.append(summary_row("start model, no RL (baseline)", [base], []))
        got.evals["start model"] = [base]


def _machine() -> str:
    """The machine in words: architecture, CPU cores, system, and the GPU when there is one."""
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    try:
        import torch

        if torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return machine


def _header(args: argparse.Namespace, got: _Results, config: Any, command: str, machine: str, wall: float) -> str:
    """table.md's first paragraph, from what the runs and evaluations in it were: protocol, budget, steps trained,
    start model, seeds, questions scored, command, machine, wall time."""
    steps = sorted({int(run["steps"]) for run in got.runs})
    trained = f"{_span(steps)} steps" if steps else "no runs"
    if args.minutes:
        trained += f", at most {args.minutes:g} minutes"
    seeds = sorted({int(run["seed"]) for run in got.runs})
    results = [result for evals in got.evals.values() for result in evals]
    scored = sorted({int(result["n"]) for result in results})
    # asked for more questions than the split holds: every one was scored
    every = all(int(r.get("settings", {}).get("questions", 0)) > int(r["n"]) for r in results)
    held_out = f"all {_span(scored)}" if every else f"the first {_span(scored)}"
    return (
        f"Protocol: {args.protocol}; budget: {args.budget} ({trained} of preset {BUDGETS[args.budget].preset}); "
        f"start model: {args.init_model or config.model.model or 'SmolLM2-135M-Instruct'}; "
        f"seeds: {_span(seeds) if seeds else 'none'}; held-out: {held_out} HotpotQA dev questions, greedy. "
        f"Mean over seeds [95% t-interval across seeds, clipped to the metric's range ([0, 1]; searches at 0); a "
        f"metric equal in every seed gets the rule-of-three bound instead]. Command: `{command}`. Machine: {machine}. "
        f"Wall time of this invocation: {wall / 60:.1f} min (finished trainings and evaluations are read, not redone)."
    )


def _span(values: Sequence[int]) -> str:
    """Sorted integers as text: 3; 0..2 (consecutive); 2, 5 (else)."""
    if len(values) > 2 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ", ".join(str(v) for v in values)


def _minutes(args: argparse.Namespace) -> list[str]:
    """The trainer flag of `--minutes`, when given."""
    return ["--max-train-minutes", f"{args.minutes:g}"] if args.minutes else []


def _budget(args: argparse.Namespace, out: Path) -> tuple[Budget, Budget]:
    """The budget every run trains with (the named one, the command line's overrides, and the start model), and the
    one the warm start trains with (without a start model). Trains nothing: the warm start's model is its path."""
    budget = BUDGETS[args.budget]
    budget = Budget(
        budget.preset,
        args.steps or budget.steps_for(args.protocol),
        args.eval_limit or budget.eval_limit,
        budget.eval_batch,
        (*budget.train_args, *_minutes(args), *args.train_arg),
    )
    warm = budget
    if args.warm_start_steps > 0:
        args.init_model = str(out / "runs" / "warm-start" / "final")
    if args.init_model:
        budget = dataclasses.replace(budget, train_args=(*budget.train_args, "--model", args.init_model))
    return budget, warm


def _check_cached(
    parser: argparse.ArgumentParser, args: argparse.Namespace, systems: list[System], budget: Budget, out: Path
) -> None:
    """Refuse, before anything trains, a finished run in `out` trained otherwise than this invocation asks (naming
    what differs), and with `--report-only` an evaluation scored otherwise; say which evaluations are scored anew."""
    config = run_config(budget.preset, args.protocol, budget.train_args, model_named=True)
    for system in systems:
        for seed in range(args.seeds):
            name = f"{system.slug}-seed{seed}"
            run_dir = out / "runs" / name
            if (run_dir / "summary.json").exists():
                problem = run_problems(run_dir, expected_run_settings(system, seed, budget, args.protocol, run_dir))
                if problem:
                    parser.error(problem)
            _check_cached_evaluation(
                parser, args, out / "evals" / f"{name}.json", budget, config, str(run_dir / "final")
            )
    if not args.no_baseline:
        start = _start_label(config, args.init_model)
        _check_cached_evaluation(parser, args, out / "evals" / "untrained.json", budget, config, start)


def _check_cached_evaluation(
    parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path, budget: Budget, config: Any, model: str
) -> None:
    if not path.exists():
        return
    found = evaluation_current(json.loads(path.read_text()), evaluation_key(budget, config, model))
    if found and args.report_only:
        parser.error(f"{path} was scored with other settings ({'; '.join(found)}): run without --report-only")
    if found:
        print(f"[compare] {path} was scored with other settings ({'; '.join(found)}): scoring it anew", flush=True)


def _start_label(config: Any, model: str | None = None) -> str:
    """The start model (`model`, else the config's) as the baseline's evaluation key names it."""
    model = model or config.model.model
    return "tiny (seed 0)" if model == "tiny" else str(model or "smollm2-135m")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the comparison and write its report to `--out`; returns report.json's content."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        systems = [parse_system(spec) for spec in args.algos]
    except ValueError as error:
        parser.error(str(error))
    _check_args(parser, args, systems)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out or f"runs/compare-{args.budget}-{args.protocol}")  # raw outputs stay out of the source tree
    budget, warm_budget = _budget(args, out)
    _check_cached(parser, args, systems, budget, out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.warm_start_steps > 0:
        warm_start(out, warm_budget, args)
    # the env and evaluation settings of every run; its start model is args.init_model (with --report-only the
    # models may be gone: nothing is loaded)
    config = run_config(budget.preset, args.protocol, budget.train_args, model_named=True)
    start = time.perf_counter()

    got = _Results()
    try:
        _run_systems(systems, args, budget, config, out, got)
        _score_baseline(args, budget, config, out, got)
    except EvaluationFailed as err:  # one line, exit 1: a dead server's zeros are no scores to report
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    if not got.evals:
        raise SystemExit(f"nothing finished in {out} to report (missing: {', '.join(got.missing)})")
    paired = paired_tests(got.evals, pairing_reference(list(got.evals)))

    wall = time.perf_counter() - start
    command = "python -m benchmarks.compare " + shlex.join(argv if argv is not None else sys.argv[1:])
    machine = _machine()
    header = _header(args, got, config, command, machine, wall)
    if got.missing:
        header += f" Not finished yet, left out of this report: {', '.join(got.missing)}."
        print(f"[compare] not finished, left out: {', '.join(got.missing)}", flush=True)
    write_tables(got.rows, out, header, paired, got.runs)
    plots = plot(got.run_dirs, out)
    report = {
        "command": command,
        "budget": budget.__dict__,
        "protocol": args.protocol,
        "seeds": args.seeds,
        "machine": machine,
        "code": code_version(),
        "provenance": provenance(seed=None, command=command),
        "wall_time_s": wall,
        "rows": got.rows,
        "paired": paired,
        "runs": got.runs,
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print((out / "table.md").read_text())
    return report


def cli() -> None:
    """The `redcoda-compare` console script: `main` with the process's arguments, its summary not returned (a console
    script exits with what its function returns)."""
    main()


if __name__ == "__main__":
    main()
