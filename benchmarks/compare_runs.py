"""The comparison's runs: its budgets and systems, training and scoring each run once across invocations.

`benchmarks.compare` drives these: `train` runs `python -m algos.<algo>` for one (system, seed) in a subprocess
and records its summary, `evaluate_run` scores a model on the held-out questions, and `claimed` keeps two
invocations side by side from training or scoring one run at once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks.compare_checks import jsonable
from envs.provenance import provenance

ALGOS = ("grpo", "grpo_sft", "red_grpo")
"""The algorithms a comparison trains by default. A system may name any registered algorithm (`algos.registry`):
`grpo_expert` is GRPO with oracle episodes inside its groups (`python -m algos.grpo_expert`); `sft` is the SFT-only
arm, `python -m algos.sft` under the same budget; another package's is trained by ``python -m algos.train --algo``."""


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


def run_config(preset: str, protocol: str, extra: Sequence[str], *, model_named: bool = False) -> Any:
    """The trainer config the runs use: the evaluation takes its env settings from it (one source). With
    `model_named` its ``--model`` is left out (`without_model`): the config of the env and the evaluation alone."""
    argv = ["--preset", preset, "--protocol", protocol, *extra]
    if model_named:
        return without_model(argv, algo="grpo")[0]
    from algos.run.cli import parse_config

    return parse_config(argv, algo="grpo")


def without_model(argv: Sequence[str], **kwargs: Any) -> tuple[Any, str | None]:
    """`algos.run.cli.parse_config` of a trainer command line without its ``--model``, and that model as named: it
    is not looked for (the warm start's model is not there before it trains; the comparison checks ``--init-model``
    at start), so a config holding it cannot be built yet."""
    from algos.run.cli import parse_config

    argv, model = list(argv), None
    while "--model" in argv:
        at = argv.index("--model")
        model, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    return parse_config(argv, **kwargs), model


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
    from algos.registry import UnknownAlgorithm, algorithm

    algo, colon, settings = spec.partition(":")
    try:
        entry = algorithm(algo)
    except UnknownAlgorithm as err:
        raise ValueError(f"{err} (in {spec!r})") from None
    types = entry.config_class().flat_types()  # a learner's own settings too: grpo_expert:expert_shaping=0.2
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


def train_command(
    algo: str,
    seed: int,
    budget: Budget,
    protocol: str,
    run_dir: Path,
    threads: int | None = None,
    flags: Sequence[str] = (),
) -> list[str]:
    """The trainer command of one run: the algorithm's entry point (`algos.registry.Algorithm.command`: ``python -m
    algos.<algo>``, or ``python -m algos.train --algo NAME``) with the budget's flags, then the system's own.

    Every system, the SFT-only arm (`sft`) included, gets the same budget flags; each algorithm's own defaults apply
    as they do for any command line (`algos.registry.Algorithm.defaults_for`), so a run trains what the same command
    typed by hand would.
    """
    from algos.registry import algorithm

    return [
        sys.executable,
        *algorithm(algo).command(),
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
    with claimed(run_dir) as claim:
        if done.exists():  # finished by another invocation while this one waited for it
            return json.loads(done.read_text())
        cmd = train_command(algo, seed, budget, protocol, run_dir, threads, flags)
        if (run_dir / "checkpoints" / "latest").exists():  # a checkpoint was committed: continue from it
            cmd.append("--resume")
        start = time.perf_counter()
        print(f"[compare] {shlex.join(cmd)}", flush=True)
        with (run_dir / "code_versions.txt").open("a") as versions:  # the code of each start and resume
            versions.write(f"{code_version()}\n")
        run_holding(claim, cmd)
        rows = run_metrics(run_dir)
        summary = {
            "algo": algo,
            "seed": seed,
            "steps": len(rows),
            "wall_time_s": float(rows[-1].get("time/elapsed", time.perf_counter() - start)),
            "tokens_trained": metric_total(run_dir, "tokens/trained"),
            "tokens_sampled": metric_total(run_dir, "tokens/sampled"),
            "final_model": str(run_dir / "final"),
            "code": _trained_code(run_dir),
            "config": _trained_config(run_dir),
            "provenance": _read_provenance(run_dir),
        }
        done.write_text(json.dumps(summary, indent=2))
        if (run_dir / "final").exists():  # finished: the final model is what is evaluated, nothing left to resume
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1.6 GB per SmolLM2-135M run
        return summary


class ClaimedElsewhere(RuntimeError):
    """Another comparison process is training this run now."""


@contextlib.contextmanager
def claimed(
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
    """Run `cmd` to its end, its process sharing the `claimed` lock `claim`: a trainer whose comparison was killed
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


def warm_start(out: Path, budget: Budget, args: argparse.Namespace) -> Path:
    """Regime 2's shared SFT warm start in `out`/runs/warm-start, trained once (or resumed); its final model.

    Every run starts from it, so a stream beside the one training it waits; with `--report-only` only its log must
    exist (the report reads the runs' files, not the model).
    """
    warm = out / "runs" / "warm-start"
    if args.report_only:
        if not (warm / "metrics.jsonl").exists():
            raise SystemExit(f"no warm start in {warm} yet: nothing of this regime to report")
        return warm / "final"
    with claimed(warm, wait=True) as claim:
        if not (warm / "final").exists():
            _train_warm_start(claim, warm, budget, args)
    shutil.rmtree(warm / "checkpoints", ignore_errors=True)  # finished: every run starts from its final model
    return warm / "final"


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
        "--eval-questions",  # scored once, as the comparison's baseline row, not by its own trainer too
        "0",
        *budget.train_args,
        *(["--torch-threads", str(args.threads)] if args.threads else []),
    ]
    if (warm / "checkpoints" / "latest").exists():
        cmd.append("--resume")
    print(f"[compare] {shlex.join(cmd)}", flush=True)
    run_holding(claim, cmd)


def _read_provenance(run_dir: Path) -> dict[str, Any] | None:
    """The provenance the trainer wrote (`algos.run.outputs.write_provenance`; None for a run that predates it)."""
    path = run_dir / "provenance.json"
    return json.loads(path.read_text()) if path.exists() else None


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


def run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl: one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def metric_total(run_dir: Path, key: str) -> float:
    """The sum over a run's logged steps of one metric (tokens trained, tokens sampled)."""
    return float(sum(r.get(key, 0.0) for r in run_metrics(run_dir)))


def held_out_config(budget: Budget, config: Any) -> Any:
    """The runs' `Config` with the budget's held-out evaluation: its questions and episodes per batch."""
    return config.with_values(eval_questions=budget.eval_limit or 10**9, eval_batch_size=budget.eval_batch)


def evaluation_key(budget: Budget, config: Any, model: str) -> dict[str, Any]:
    """What decides an evaluation's scores: the held-out settings (`algos.run.evaluation.held_out_settings`: env,
    questions, tokens, context) and the model scored (its path or name). A cached evaluation is reused only when its
    key is this one."""
    from algos.run.evaluation import held_out_settings

    return jsonable({"settings": held_out_settings(held_out_config(budget, config)), "model": model})


def expected_run_settings(system: System, seed: int, budget: Budget, protocol: str, run_dir: Path) -> dict[str, Any]:
    """Every setting (`Config.flat`) the trainer of one run parses from its command (`train_command`), without
    loading anything: the start model as named (it may not exist yet, as the warm start's before it trains)."""
    from algos.registry import algorithm

    command = train_command(system.algo, seed, budget, protocol, run_dir, None, system.flags)
    argv = command[1 + len(algorithm(system.algo).command()) :]
    config, model = without_model(argv, algo=system.algo)
    return {**config.flat(), **({"model": model} if model is not None else {})}


def evaluate_run(
    name: str,
    model: Any,
    budget: Budget,
    config: Any,
    out_dir: Path,
    max_error_rate: float | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Evaluate one model on the held-out questions (cached in out_dir/<name>.json), in the runs' training env.

    The env settings, tokens per turn and context length come from the runs' `Config` through
    `algos.run.evaluation.score_held_out`, the function the trainer's own before/after evaluation uses. A cached
    evaluation is reused when its `evaluation_key` (settings and `label`, the model's name; `model` itself when it
    is a path) is this one's, else scored anew. More than `max_error_rate` of the episodes with sampler or retriever
    errors (None: 5%) raise `agents.evaluation.EvaluationFailed`, and nothing is cached.
    """
    from algos.run.evaluation import score_held_out
    from benchmarks.compare_checks import evaluation_current

    target = out_dir / f"{name}.json"
    key = evaluation_key(budget, config, label or str(model)) if budget is not None else None

    def cached() -> dict[str, Any] | None:
        if not target.exists():
            return None
        result = json.loads(target.read_text())
        return result if key is None or not evaluation_current(result, key) else None

    if (found := cached()) is not None:
        return found
    # Claimed like a training: a stream that finds a run trained but not yet scored must not score it too while
    # the stream that trained it does (the same 200 episodes twice); it skips it (`ClaimedElsewhere`) instead.
    with claimed(out_dir, lock=f".{name}.lock", doing=f"evaluated ({name})"):
        if (found := cached()) is not None:  # scored by another invocation just before this one took the claim
            return found
        held_out = held_out_config(budget, config).with_values(progress=True)
        result = {**score_held_out(model, held_out, max_error_rate=max_error_rate), "key": key}
        env_kwargs = result["settings"]["env_kwargs"]
        weights = model if isinstance(model, str) else None
        result["provenance"] = provenance(seed=result["settings"]["seed"], env_kwargs=env_kwargs, model=weights)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, ensure_ascii=False))
        os.replace(tmp, target)
    return result
