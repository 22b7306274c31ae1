"""The GPU check for a short window on a machine without network: the gpu tests, one GRPO + RED step at the 135M,
1.5B and 3B shapes with the sampler's default decode (CUDA graphs), and a few steps of the seed's method at the
seed's batch shape, each stage within a time limit, everything written to one folder.

    python -m benchmarks.gpu_check --out gpu-check              # one GPU: about 10 minutes on an H200
    python -m benchmarks.gpu_check --rehearse --out /tmp/check  # a CPU: the same stages at tiny shapes

Stages (limits in seconds on a GPU, model builds and start-up included): the gpu tests (``pytest -m "gpu and not
slow"``; a rehearsal only collects them), `benchmarks.scale_step` at each shape (3B with
``--gradient-checkpointing``), and `python -m algos.red_grpo --preset gpu` for a few steps on the bundled model
(32 questions x 2 episodes). A stage that fails or runs out of time is recorded as such and the next one starts.

The folder gets summary.md (the machine, then one line per stage: its status, seconds and figures or the end of
its output), summary.json (the same with each stage's last metrics row), and a folder per stage with its log and
metrics.jsonl. Every model is random-weight or bundled: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPE_STAGES = {  # stage: (shape, flags after --, limit on a GPU)
    "135m": ("smollm2-135m", [], 80),
    "1.5b": ("qwen2.5-1.5b", [], 130),
    "3b": ("qwen2.5-3b", ["--gradient-checkpointing"], 190),
}
TESTS_LIMIT = 70
SEED_LIMIT = 120
SEED_STEPS = 3
REHEARSAL_LIMIT = 600


def machine() -> dict[str, str]:
    """The machine's accelerator and the versions that decide its figures."""
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["device"] = f"{props.name} ({props.total_memory / 2**30:.1f} GiB), CUDA {torch.version.cuda}"
        found["devices"] = str(torch.cuda.device_count())
    else:
        found["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return found


def tests_stage(folder: Path, rehearse: bool, limit: float) -> dict[str, Any]:
    """The gpu tests (a rehearsal collects them only: they need CUDA)."""
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "-m", "gpu and not slow", "tests"]
    if rehearse:
        command.append("--collect-only")
    log = folder / "pytest.log"
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=limit)
    last = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
    return {"status": "passed" if done.returncode == 0 else f"failed (exit {done.returncode})", "line": last}


def shape_stage(folder: Path, work: Path, shape: str, preset: str, extra: list[str], limit: float) -> dict[str, Any]:
    """One `benchmarks.scale_step` run of `shape`; its log and metrics copied into `folder`."""
    from benchmarks import scale_step  # imported when run: `python -m benchmarks.scale_step` may follow in a process

    try:
        row = scale_step.run(shape, work, preset, extra, timeout=limit)
        result = {"status": "passed", "line": scale_step.report(shape, row, ranks=1), "metrics": row}
    finally:
        for name in ("trainer.log", "metrics.jsonl"):
            if (work / f"{shape}-run" / name).is_file():
                shutil.copy(work / f"{shape}-run" / name, folder / name)
    return result


def seed_stage(folder: Path, rehearse: bool, limit: float) -> dict[str, Any]:
    """The seed's method (GRPO + RED) at the seed's batch shape, a few steps on the bundled model."""
    run_dir = folder / "run"
    preset, steps = ("tiny", 1) if rehearse else ("gpu", SEED_STEPS)
    command = [sys.executable, "-m", "algos.red_grpo", "--preset", preset, "--steps", str(steps), "--save-every", "0"]
    command += ["--eval-questions", "0", "--validation-questions", "0", "--no-wandb", "--run-dir", str(run_dir)]
    log = folder / "trainer.log"
    with log.open("w") as out:
        env = {**os.environ, "WANDB_MODE": "disabled"}
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=limit)
    if done.returncode != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        return {"status": f"failed (exit {done.returncode})", "line": tail}
    shutil.copy(run_dir / "metrics.jsonl", folder / "metrics.jsonl")
    shutil.rmtree(run_dir / "final", ignore_errors=True)  # the bundled model again: not worth the folder's room
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    from benchmarks.scale_step import report

    return {"status": "passed", "line": report("seed shape", rows[-1], ranks=1), "metrics": rows[-1]}


def _timed(name: str, stage: Any, *args: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        result = stage(*args)
    except subprocess.TimeoutExpired as err:
        result = {"status": "timed out", "line": f"stopped after {err.timeout:.0f} s"}
    except RuntimeError as err:  # scale_step's: a failed build, trainer or time limit, with the log's tail
        text = str(err)
        status = "timed out" if "inside" in text or "more than" in text else "failed"
        result = {"status": status, "line": " | ".join(text.splitlines()[-3:])}
    result["seconds"] = round(time.monotonic() - start, 1)
    print(f"{name:<6} {result['status']} in {result['seconds']:.0f} s: {result['line']}", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder for the summary and each stage's log and metrics")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes and the tiny preset (a CPU rehearsal)")
    parser.add_argument("--stages", nargs="+", default=["tests", *SHAPE_STAGES, "seed"])
    options = parser.parse_args(argv)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"command": " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])])}
    summary["machine"] = machine()
    print(f"{summary['command']}\nmachine: {', '.join(f'{k} {v}' for k, v in summary['machine'].items())}", flush=True)
    stages: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:  # the models: large, rebuilt at will
        for name in options.stages:
            folder = out / name
            folder.mkdir(exist_ok=True)
            if name == "tests":
                stages[name] = _timed(name, tests_stage, folder, options.rehearse, _limit(TESTS_LIMIT, options))
            elif name == "seed":
                stages[name] = _timed(name, seed_stage, folder, options.rehearse, _limit(SEED_LIMIT, options))
            else:
                shape, extra, limit = SHAPE_STAGES[name]
                shape, preset = ("tiny", "tiny") if options.rehearse else (shape, "gpu")
                work = Path(tmp) / name  # a run directory of its own: a rehearsal runs the tiny shape thrice
                work.mkdir()
                args = (folder, work, shape, preset, extra, _limit(limit, options))
                stages[name] = _timed(name, shape_stage, *args)
    summary["stages"] = stages
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    lines = [f"# GPU check\n\n`{summary['command']}`\n", *(f"- {k}: {v}" for k, v in summary["machine"].items()), ""]
    lines += [f"- **{k}** {v['status']} in {v['seconds']:.0f} s: {v['line']}" for k, v in stages.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def _limit(limit: float, options: argparse.Namespace) -> float:
    return REHEARSAL_LIMIT if options.rehearse else limit


if __name__ == "__main__":
    main()
