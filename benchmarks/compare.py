"""The algorithm comparison: GRPO vs GRPO + fixed SFT vs GRPO + RED on the same env, seeds and budget.

    python -m benchmarks.compare --algos grpo grpo_sft red_grpo --seeds 3 --budget cpu --threads 1
    python -m benchmarks.compare --budget gpu --protocol coda --out runs/compare-gpu-coda
    python -m benchmarks.compare --algos red_grpo grpo_sft grpo_sft:sft_coef=0.4 --seeds 3   # a variant as a system

For every (algorithm, seed) it trains with `python -m algos.<algo>` (a subprocess, so one run's memory
never leaks into the next) on the same env, data order (the seed fixes it identically for every
algorithm) and compute budget, then evaluates the final model with `agents.evaluation.evaluate` on the same
held-out questions (greedy). The start model (the untrained one, or `--init-model` / the
`--warm-start-steps` model) is evaluated once on the same questions as the baseline.

Written to `--out`:
- `table.md`, `table.csv`: per algorithm, mean and 95% CI across seeds of EM, F1, valid answers, searches
  per question, invalid actions and format score, with tokens trained and wall time (plus the start model);
  in table.md also RED minus every other system paired by question (difference, 95% CI, permutation p-value)
  and one line per run (steps, tokens trained and sampled, wall time, its scores);
- `reward.png`, `f1.png`, `answered.png`, `sft_weight.png`: learning curves, mean over seeds with a band
  from the lowest to the highest seed; `red_weights.png`: RED's entropy weight, accuracy factor and product;
- `report.json`: the exact command, budget, protocol, machine, seeds, the paired tests and every run's numbers;
- `runs/<algo>-seed<s>/`: each trainer run (metrics.jsonl, final model, and `summary.json` with its steps, tokens,
  wall time, the commit that trained it (recorded at each start and resume, in `code_versions.txt`) and trainer
  config; its one checkpoint is kept only until the run finishes);
- `evals/<name>.json`: each evaluation (metrics and per-question predictions).

A system is an algorithm, or an algorithm with trainer settings of its own: `grpo_sft:sft_coef=0.4` is GRPO + SFT
trained with `--sft-coef 0.4` (settings `name=value`, comma-separated, any `Config` field), reported, paired and
drawn as a system of its own, its runs in `runs/grpo_sft-sft_coef0.4-seed<s>/`.

An interrupted comparison resumes: finished trainings (`runs/*/summary.json`) and evaluations
(`evals/*.json`) are kept, an unfinished training continues from its newest checkpoint (`--resume`). Invocations side
by side (one per core) share the runs: one run is trained, and then scored, by one invocation at a time, and another
that reaches it meanwhile skips it and goes on with the rest, naming it as left out of its report (so two identical
commands side by side split the work; when both are done, the same command once more reports everything, training
nothing).
`--report-only` trains and scores nothing: it
re-makes the report from the runs already finished and scored, naming the ones left out (safe beside running
streams).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import fcntl
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from envs.stats import mean_ci, paired_difference, paired_permutation_p

ALGOS = ("grpo", "grpo_sft", "red_grpo")
TABLE_METRICS = ("em", "f1", "answered", "num_searches", "invalid_actions", "format")


@dataclass(frozen=True)
class Budget:
    """How much each run may train and how it is evaluated."""

    preset: str
    """Trainer preset (algos.config.PRESETS) the runs start from."""
    steps: int
    """Training steps per run."""
    eval_limit: int | None
    """Held-out questions evaluated (the first N of the split; None: all)."""
    eval_batch: int = 32
    """Episodes per batched evaluation rollout."""
    train_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra trainer flags shared by every run."""
    coda_steps: int | None = None
    """Training steps per run under the coda protocol; None: `steps`."""

    def steps_for(self, protocol: str) -> int:
        """Training steps per run under `protocol`."""
        return self.coda_steps if protocol == "coda" and self.coda_steps is not None else self.steps


BUDGETS = {
    # The main job's budget as a step count: what `python -m algos.red_grpo` reaches in its 25 training minutes on
    # the idle 2-core machine, 84-85 steps flat (--protocol flat) and 60, 62 and 75 under CoDA (seeds 0-2, mean 66;
    # benchmarks/README.md). Steps, not minutes, so that runs side by side (or beside other work) train on exactly
    # what an idle run would; all 200 dev questions.
    "cpu": Budget(
        "cpu", steps=84, eval_limit=None, eval_batch=50, train_args=("--max-train-minutes", "None"), coda_steps=66
    ),
    # A quick look (minutes): 3 steps per run, 10 held-out dev questions.
    "cpu-quick": Budget("cpu", steps=3, eval_limit=10, eval_batch=10),
    # The seed's configuration (32 prompts per step, group size 2, 480 steps) on the 200 dev questions.
    "gpu": Budget("gpu", steps=480, eval_limit=None, eval_batch=64),
    # Seconds: the test suite runs the whole comparison with it.
    "tiny": Budget("tiny", steps=2, eval_limit=4, eval_batch=4),
}


def _run_config(preset: str, protocol: str, extra: Sequence[str]) -> Any:
    """The trainer config the runs use: the evaluation takes its env settings from it (one source)."""
    from algos.config import parse_config

    return parse_config(["--preset", preset, "--protocol", protocol, *extra], algo="grpo")


@dataclass(frozen=True)
class System:
    """What one row of the comparison trains: an algorithm and its own trainer flags (see the module docstring)."""

    name: str
    algo: str
    flags: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        """The name as a folder name: grpo_sft:sft_coef=0.4 -> grpo_sft-sft_coef0.4."""
        return self.name.replace(":", "-").replace(",", "-").replace("=", "")


def parse_system(spec: str) -> System:
    """`algo` or `algo:name=value[,name=value]` -> System; ValueError names what is wrong."""
    from algos.config import Config

    algo, colon, settings = spec.partition(":")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r} in {spec!r} (one of {', '.join(ALGOS)})")
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    flags: list[str] = []
    for setting in filter(None, settings.split(",")):
        key, sep, value = setting.partition("=")
        if not sep or key not in types or not value:
            raise ValueError(f"{setting!r} in {spec!r} is not name=value with a trainer setting's name")
        flag = key.replace("_", "-")
        if types[key] in ("bool", bool):  # a switch on the command line: --name / --no-name
            if value.lower() not in ("true", "false"):
                raise ValueError(f"{setting!r} in {spec!r}: {key} is true or false")
            flags.append(f"--{flag}" if value.lower() == "true" else f"--no-{flag}")
        else:
            flags += [f"--{flag}", value]
    if colon and not flags:
        raise ValueError(f"{spec!r} names no setting after ':'")
    return System(spec, algo, tuple(flags))


def train(
    algo: str,
    seed: int,
    budget: Budget,
    protocol: str,
    run_dir: Path,
    threads: int | None = None,
    flags: Sequence[str] = (),
) -> dict[str, Any]:
    """Train one run to the end (or resume it), and return its summary (cached in run_dir/summary.json).

    `flags` are the system's own trainer flags (after the budget's, so they decide).
    """
    done = run_dir / "summary.json"
    if done.exists():
        return json.loads(done.read_text())
    with _claimed(run_dir) as claim:
        if done.exists():  # finished by another invocation while this one waited for it
            return json.loads(done.read_text())
        cmd = [
            sys.executable,
            "-m",
            f"algos.{algo}",
            "--preset",
            budget.preset,
            "--seed",
            str(seed),
            "--steps",
            str(budget.steps_for(protocol)),
            "--protocol",
            protocol,
            "--run-dir",
            str(run_dir),
            "--eval-questions",
            "0",  # every final model is scored below, on the same questions, with the same settings
            # one checkpoint per run is enough to resume (each is written atomically): SmolLM2-135M's weights and
            # AdamW state are 1.6 GB, so the preset's 3 per run would take ~90 GB over the 18 runs of both regimes
            "--keep-checkpoints",
            "1",
            *budget.train_args,
            *flags,
            *(["--torch-threads", str(threads)] if threads else []),
        ]
        if (run_dir / "checkpoints" / "latest").exists():  # a checkpoint was committed: continue from it
            cmd.append("--resume")
        start = time.perf_counter()
        print(f"[compare] {shlex.join(cmd)}", flush=True)
        with (run_dir / "code_versions.txt").open("a") as versions:  # the code of each start and resume
            versions.write(f"{code_version()}\n")
        run_holding(claim, cmd)
        rows = _metrics(run_dir)
        summary = {
            "algo": algo,
            "seed": seed,
            "steps": len(rows),
            "wall_time_s": float(rows[-1].get("time/elapsed", time.perf_counter() - start)),
            "tokens_trained": _metric_total(run_dir, "tokens/trained"),
            "tokens_sampled": _metric_total(run_dir, "tokens/sampled"),
            "final_model": str(run_dir / "final"),
            "code": _trained_code(run_dir),
            "config": _trained_config(run_dir),
        }
        done.write_text(json.dumps(summary, indent=2))
        if (run_dir / "final").exists():  # finished: the final model is what is evaluated, nothing left to resume
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1.6 GB per SmolLM2-135M run
        return summary


class ClaimedElsewhere(RuntimeError):
    """Another comparison process is training this run now."""


@contextlib.contextmanager
def _claimed(
    run_dir: Path, *, wait: bool = False, lock: str = ".compare.lock", doing: str = "trained"
) -> Iterator[IO[str]]:
    """Hold `run_dir` for this process while it trains there; `ClaimedElsewhere` if another process holds it.

    Two invocations side by side (the README's two streams, or a report command started while they run) must
    never train one run at once: both would resume from the same checkpoint and write the same files. The claim
    is an advisory lock on ``run_dir/<lock>``, released by the system when the last process holding it
    ends, however it ends; `run_holding` hands it to the trainer's process too. With `wait`, it waits for the
    holder instead (the warm start, which every run needs). `lock` and `doing` name other work held the same
    way: one evaluation of a finished run (`evaluate_run`).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = f"{run_dir} is being {doing} by another comparison ({handle.read().strip() or 'process unknown'})"
            if not wait:
                raise ClaimedElsewhere(f"{holder}; run the report when it is done") from None
            print(f"[compare] {holder}: waiting for it", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.truncate(0)
        handle.write(f"comparison process {os.getpid()}\n")
        handle.flush()
        yield handle


def run_holding(claim: IO[str], cmd: Sequence[str]) -> None:
    """Run `cmd` to its end, its process sharing the `_claimed` lock `claim`: a trainer whose comparison was killed
    (it goes on as an orphan) keeps its run claimed until it ends, so no other invocation resumes the run under it.
    """
    with subprocess.Popen(cmd, pass_fds=(claim.fileno(),)) as process:
        claim.truncate(0)
        # who holds it now, for the message a stream beside it prints
        claim.write(f"comparison process {os.getpid()}, trainer process {process.pid}\n")
        claim.flush()
        try:
            process.wait()
        except BaseException:  # interrupted here: the trainer stops with us, as under subprocess.run
            process.kill()
            raise
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, cmd)


def _train_warm_start(claim: IO[str], warm: Path, budget: Budget, args: argparse.Namespace) -> None:
    """Train regime 2's shared SFT warm start into `warm` (or resume it), holding its claim."""
    cmd = [
        sys.executable,
        "-m",
        "algos.sft",
        "--preset",
        budget.preset,
        "--steps",
        str(args.warm_start_steps),
        "--protocol",
        args.protocol,
        "--run-dir",
        str(warm),
        *budget.train_args,
        *(["--torch-threads", str(args.threads)] if args.threads else []),
    ]
    if (warm / "checkpoints" / "latest").exists():
        cmd.append("--resume")
    print(f"[compare] {shlex.join(cmd)}", flush=True)
    run_holding(claim, cmd)


def _trained_config(run_dir: Path) -> dict[str, Any] | None:
    """The trainer config a run recorded in its newest checkpoint (None without one)."""
    states = sorted((run_dir / "checkpoints").glob("step_*/state.json"))
    return json.loads(states[-1].read_text()).get("config") if states else None


def code_version() -> str | None:
    """The git commit of the code that runs (with "+changes" when the work tree differs); None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def _trained_code(run_dir: Path) -> str | None:
    """The code that trained a run: its commit, or its commits in order ("A then B") when it was resumed under
    another. Recorded as each training starts, so checking out another commit afterwards changes nothing."""
    path = run_dir / "code_versions.txt"
    versions = list(dict.fromkeys(path.read_text().split())) if path.exists() else []
    return " then ".join(versions) if versions else code_version()  # runs that predate the record: the code now


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl: one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _metric_total(run_dir: Path, key: str) -> float:
    """The sum over a run's logged steps of one metric (tokens trained, tokens sampled)."""
    return float(sum(r.get(key, 0.0) for r in _metrics(run_dir)))


def evaluate_run(name: str, model: Any, budget: Budget, config: Any, out_dir: Path) -> dict[str, Any]:
    """Evaluate one model on the held-out questions (cached in out_dir/<name>.json), in the runs' training env.

    The env settings, tokens per turn and context length come from the runs' `Config` through
    `algos.evaluation.score_held_out`, the function the trainer's own before/after evaluation uses.
    """
    from algos.evaluation import score_held_out

    target = out_dir / f"{name}.json"
    if target.exists():
        return json.loads(target.read_text())
    # Claimed like a training: a stream that finds a run trained but not yet scored must not score it too while
    # the stream that trained it does (the same 200 episodes twice); it skips it (`ClaimedElsewhere`) instead.
    with _claimed(out_dir, lock=f".{name}.lock", doing=f"evaluated ({name})"):
        if target.exists():  # scored by another invocation just before this one took the claim
            return json.loads(target.read_text())
        held_out = dataclasses.replace(
            config, eval_questions=budget.eval_limit or 10**9, eval_batch_size=budget.eval_batch, progress=True
        )
        result = score_held_out(model, held_out)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, ensure_ascii=False))
        os.replace(tmp, target)
    return result


CURVES = {
    "reward.png": ("critic/rewards/mean", "episode reward"),
    "f1.png": ("answer_f1/mean", "answer F1"),
    "answered.png": ("env/answered", "valid answers"),
    "sft_weight.png": ("sft/weight", "SFT weight"),
}
"""The learning curves drawn per algorithm with a band across seeds (file: metric logged per step, title)."""
SMOOTH_STEPS = 5
"""Training-rollout metrics average a handful of episodes per step: curves show a trailing mean over this many."""


def _seed_curves(run_dirs: Sequence[Path], key: str) -> np.ndarray:
    """One row per seed: the metric at every step, NaN where unlogged (cut to the shortest run)."""
    series = [[float(r.get(key, np.nan)) for r in _metrics(d)] for d in run_dirs]
    n = min(len(s) for s in series)
    return np.array([s[:n] for s in series], dtype=np.float64)  # (seeds, steps)


def plot(run_dirs: dict[str, list[Path]], out: Path) -> list[str]:
    """Learning curves with seed bands (`CURVES`) and RED's weight factors (red_weights.png).

    Each curve is the mean over seeds of a trailing `SMOOTH_STEPS`-step mean of the training rollouts'
    metric; the band spans the seeds' lowest to highest value at each step.
    """
    import matplotlib

    from algos.evaluation import moving_average

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {name: [entry] for name, entry in CURVES.items()}
    panels["red_weights.png"] = [
        ("red/entropy_weight", "entropy weight"),
        ("red/accuracy_factor", "accuracy factor"),
        ("red/final_weight", "final weight"),
    ]
    written = []
    for filename, keys in panels.items():
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
        for ax, (key, label) in zip(axes[0], keys, strict=True):
            for algo, dirs in run_dirs.items():
                values = np.array([moving_average(seed, SMOOTH_STEPS) for seed in _seed_curves(dirs, key)])
                seen = np.isfinite(values).all(axis=0)
                if not seen.any():
                    continue
                steps = np.arange(1, values.shape[1] + 1)[seen]
                seeds = f"{len(dirs)} seed{'s' if len(dirs) > 1 else ''}"
                line = ax.plot(steps, values[:, seen].mean(axis=0), label=f"{algo} ({seeds})")[0]
                if len(dirs) > 1:
                    low, high = values[:, seen].min(axis=0), values[:, seen].max(axis=0)
                    ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_xlabel("step")
            ax.set_title(f"{label} ({SMOOTH_STEPS}-step mean, band: seeds)", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # red_weights.png of a comparison without RED has no curve
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(filename)
    return written


def _row(name: str, evals: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"algorithm": name, "seeds": len(evals)}
    for metric in TABLE_METRICS:
        per_seed = [e["metrics"][metric]["mean"] for e in evals]
        interval = mean_ci(per_seed) if len(per_seed) > 1 else None
        row[metric] = float(np.mean(per_seed))
        row[f"{metric}_low"] = interval.low if interval else float("nan")
        row[f"{metric}_high"] = interval.high if interval else float("nan")
    row["tokens_trained"] = float(np.mean([s["tokens_trained"] for s in summaries])) if summaries else 0.0
    row["train_wall_s"] = float(np.mean([s["wall_time_s"] for s in summaries])) if summaries else 0.0
    row["eval_wall_s"] = float(np.mean([e["wall_s"] for e in evals]))
    return row


def per_question(evals: list[dict[str, Any]], metric: str) -> dict[str, float]:
    """A system's score on each question (by id): the mean over its seeds' evaluations."""
    scores: dict[str, list[float]] = {}
    for result in evals:
        for p in result["predictions"]:
            scores.setdefault(str(p["id"]), []).append(float(p[metric]))
    return {qid: float(np.mean(values)) for qid, values in scores.items()}


F1_WITHOUT_YES_NO = "f1 without yes/no"
"""F1 over the questions whose answer is not yes or no. A small model answers every yes/no question alike (all "yes"
or all "no", whichever its last steps leaned to), so on the 24 of the 200 dev questions (15 "no") two runs of equal
skill differ by up to 0.03 F1; this row shows the difference without that lean."""


def paired_tests(
    evals: dict[str, list[dict[str, Any]]],
    reference: str,
    metrics: Sequence[str] = ("f1", F1_WITHOUT_YES_NO, "em", "answered"),
) -> list[dict[str, Any]]:
    """`reference` minus every other system, paired by question, per metric: mean difference, 95% CI, p-value.

    Each system's per-question score averages its seeds, so the test asks whether the algorithm (not one
    run) does better on these questions. Raises ValueError when the systems were scored on different questions.
    """
    from envs.rewards import is_yes_no

    yes_no = {str(p["id"]) for p in evals[reference][0]["predictions"] if is_yes_no(p["gold_answers"][0])}
    rows = []
    for other, other_evals in evals.items():
        if other == reference:
            continue
        for metric in metrics:
            scored = "f1" if metric == F1_WITHOUT_YES_NO else metric
            ours, theirs = per_question(evals[reference], scored), per_question(other_evals, scored)
            if set(ours) != set(theirs):
                raise ValueError(f"{reference} and {other} were scored on different questions")
            ids = sorted(i for i in ours if metric != F1_WITHOUT_YES_NO or i not in yes_no)
            if not ids:  # only yes/no questions: nothing left to compare without them
                continue
            a, b = [ours[i] for i in ids], [theirs[i] for i in ids]
            diff = paired_difference(a, b)
            rows.append(
                {
                    "reference": reference,
                    "other": other,
                    "metric": metric,
                    "difference": diff.mean,
                    "low": diff.low,
                    "high": diff.high,
                    "p": paired_permutation_p(a, b),
                    "questions": diff.n,
                }
            )
    return rows


def write_tables(
    rows: list[dict[str, Any]],
    out: Path,
    header: str,
    paired: Sequence[dict[str, Any]] = (),
    runs: Sequence[dict[str, Any]] = (),
) -> None:
    """table.csv (every number) and table.md: mean [95% CI across seeds], the paired tests, every run."""
    with open(out / "table.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def cell(row: dict[str, Any], metric: str) -> str:
        low, high = row[f"{metric}_low"], row[f"{metric}_high"]
        ci = f" [{low:.3f}, {high:.3f}]" if np.isfinite(low) else ""
        return f"{row[metric]:.3f}{ci}"

    lines = [
        header,
        "",
        "| algorithm | seeds | EM | F1 | valid answers | searches/q | invalid actions/q | format "
        "| tokens trained | train wall min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['algorithm']} | {row['seeds']} | "
            + " | ".join(cell(row, m) for m in TABLE_METRICS)
            + f" | {row['tokens_trained']:.0f} | {row['train_wall_s'] / 60:.1f} |"
        )
    if paired:
        lines += [
            "",
            f"Paired by question ({paired[0]['questions']} questions; each system's score on a question is the "
            "mean over its seeds): difference, its 95% t-interval, and the two-sided sign-flip permutation p-value.",
            "",
            "| comparison | metric | difference [95% CI] | p |",
            "|---|---|---|---|",
        ]
        for t in paired:
            metric = t["metric"] + (
                f" ({t['questions']} questions)" if t["questions"] != paired[0]["questions"] else ""
            )
            lines.append(
                f"| {t['reference']} - {t['other']} | {metric} | "
                f"{t['difference']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] | {t['p']:.3g} |"
            )
    if runs:
        lines += [
            "",
            "Every run:",
            "",
            "| run | steps | tokens trained | tokens sampled | train wall min | EM | F1 | valid answers |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in runs:
            lines.append(
                f"| {r.get('system', r['algo'])}-seed{r['seed']} | {r['steps']} | {r['tokens_trained']:.0f} | "
                f"{r.get('tokens_sampled', float('nan')):.0f} | {r['wall_time_s'] / 60:.1f} | "
                f"{r['eval']['em']['mean']:.3f} | {r['eval']['f1']['mean']:.3f} | {r['eval']['answered']['mean']:.3f} |"
            )
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Compare GRPO, GRPO + SFT and GRPO + RED on the same env.")
    parser.add_argument(
        "--algos",
        nargs="+",
        default=list(ALGOS),
        metavar="SYSTEM",
        help=f"systems to compare: {', '.join(ALGOS)}, or one with its own settings, e.g. grpo_sft:sft_coef=0.4",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every algorithm")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="override the budget's training steps")
    parser.add_argument("--eval-limit", type=int, default=None, help="override the budget's held-out questions")
    parser.add_argument("--protocol", choices=("flat", "coda"), default="flat")
    parser.add_argument("--out", default=None, help="results folder (default runs/compare-<budget>-<protocol>)")
    parser.add_argument("--no-baseline", action="store_true", help="skip evaluating the untrained model")
    parser.add_argument("--train-arg", action="append", default=[], help="extra trainer flag (repeatable)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads of every training and evaluation")
    parser.add_argument("--init-model", default=None, help="start every run (and the baseline) from this model")
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
    args = parser.parse_args(argv)
    try:
        systems = [parse_system(spec) for spec in args.algos]
    except ValueError as error:
        parser.error(str(error))

    budget = BUDGETS[args.budget]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    budget = Budget(
        budget.preset,
        args.steps or budget.steps_for(args.protocol),
        args.eval_limit or budget.eval_limit,
        budget.eval_batch,
        (*budget.train_args, *args.train_arg),
    )
    out = Path(args.out or f"runs/compare-{args.budget}-{args.protocol}")  # raw outputs stay out of the source tree
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.warm_start_steps > 0:
        warm = out / "runs" / "warm-start"
        if args.report_only:  # its log is enough: the report reads the runs' files, not the model (0.5 GB)
            if not (warm / "metrics.jsonl").exists():
                raise SystemExit(f"no warm start in {warm} yet: nothing of this regime to report")
        else:
            with _claimed(warm, wait=True) as claim:  # every run starts from it: a stream beside this one waits
                if not (warm / "final").exists():
                    _train_warm_start(claim, warm, budget, args)
            shutil.rmtree(warm / "checkpoints", ignore_errors=True)  # finished: every run starts from its final model
        args.init_model = str(warm / "final")
    if args.init_model:
        budget = dataclasses.replace(budget, train_args=(*budget.train_args, "--model", args.init_model))
    config = _run_config(budget.preset, args.protocol, budget.train_args)
    start = time.perf_counter()

    run_dirs: dict[str, list[Path]] = {}
    evals_by_system: dict[str, list[dict[str, Any]]] = {}
    rows = []
    report_runs = []
    missing = []
    for system in systems:
        evals, summaries = [], []
        for seed in range(args.seeds):
            name = f"{system.slug}-seed{seed}"
            run_dir = out / "runs" / name
            if args.report_only:
                if not (run_dir / "summary.json").exists() or not (out / "evals" / f"{name}.json").exists():
                    missing.append(name)
                    continue
                summary = json.loads((run_dir / "summary.json").read_text())
            else:
                try:
                    summary = train(system.algo, seed, budget, args.protocol, run_dir, args.threads, system.flags)
                except ClaimedElsewhere as err:  # a stream beside this one trains it: go on with the others
                    print(f"[compare] skipped: {err}", flush=True)
                    missing.append(name)
                    continue
            summary.setdefault("tokens_sampled", _metric_total(run_dir, "tokens/sampled"))
            try:
                result = evaluate_run(name, summary["final_model"], budget, config, out / "evals")
            except ClaimedElsewhere as err:  # a stream beside this one scores it now
                print(f"[compare] skipped: {err}", flush=True)
                missing.append(name)
                continue
            run_dirs.setdefault(system.name, []).append(run_dir)
            evals.append(result)
            summaries.append(summary)
            report_runs.append({**summary, "system": system.name, "eval": result["metrics"]})
        if evals:
            rows.append(_row(system.name, evals, summaries))
            evals_by_system[system.name] = evals
    if args.report_only and not args.no_baseline and not (out / "evals" / "untrained.json").exists():
        missing.append("untrained")
    elif not args.no_baseline:
        model: Any = config.model
        if model == "tiny":  # the trainer's tiny preset builds its model from a config, seeded like the runs
            from agents.models import tiny_model

            model = tiny_model(seed=0)
        try:
            base = evaluate_run("untrained", model, budget, config, out / "evals")
        except ClaimedElsewhere as err:
            print(f"[compare] skipped: {err}", flush=True)
            missing.append("untrained")
        else:
            rows.append(_row("start model, no RL (baseline)", [base], []))
            evals_by_system["start model"] = [base]
    if not evals_by_system:
        raise SystemExit(f"nothing finished in {out} to report (missing: {', '.join(missing)})")
    reference = "red_grpo" if "red_grpo" in evals_by_system else next(iter(evals_by_system))
    paired = paired_tests(evals_by_system, reference)

    wall = time.perf_counter() - start
    command = "python -m benchmarks.compare " + shlex.join(argv if argv is not None else sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    try:
        import torch

        if torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    held_out = f"the first {budget.eval_limit}" if budget.eval_limit else "all"
    header = (
        f"Protocol: {args.protocol}; budget: {args.budget} "
        f"({budget.steps_for(args.protocol)} steps of preset {budget.preset}); "
        f"start model: {config.model or 'SmolLM2-135M-Instruct'}; "
        f"seeds: 0..{args.seeds - 1}; held-out: {held_out} HotpotQA dev questions, greedy. "
        f"Mean over seeds [95% t-interval across seeds]. Command: `{command}`. Machine: {machine}. "
        f"Wall time of this invocation: {wall / 60:.1f} min (finished trainings and evaluations are read, not redone)."
    )
    if missing:
        header += f" Not finished yet, left out of this report: {', '.join(missing)}."
        print(f"[compare] not finished, left out: {', '.join(missing)}", flush=True)
    write_tables(rows, out, header, paired, report_runs)
    plots = plot(run_dirs, out)
    report = {
        "command": command,
        "budget": budget.__dict__,
        "protocol": args.protocol,
        "seeds": args.seeds,
        "machine": machine,
        "code": code_version(),
        "wall_time_s": wall,
        "rows": rows,
        "paired": paired,
        "runs": report_runs,
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print((out / "table.md").read_text())
    return report


if __name__ == "__main__":
    main()
