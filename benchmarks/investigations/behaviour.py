"""The trainers' behaviour as hashes: tiny runs' metrics rows, final weights and evaluations, before and after a change.

Runs each named training run (`RUNS`) one at a time as ``python -m algos.<entry> ... --run-dir DIR`` with the
working directory ``--source`` (so an older checkout runs its own code), a fresh ``REDCODA_CACHE`` per run (no BM25
index, oracle demonstrations or start-model evaluation cached by another tree is read back) and deletes the run
directory once hashed. Per run, sha256 of:

- metrics: metrics.jsonl's rows, time-like fields dropped (`dropped`: ``time/*``, ``memory/*``, ``tokens/s``,
  ``tokens/s_generation``), as JSON with sorted keys;
- keys: each row's set of keys, the time-like ones included (a renamed metric shows even when its values do not);
- weights: final/model.safetensors's tensors, name + dtype + shape + bytes in name order (not the file's bytes);
- eval: eval.json (settings, before/after metrics and per-question predictions, tables) without ``wall_s``.

``--record FILE`` writes ``{run: {metrics, keys, weights, eval, ...}}`` (merged into FILE if it exists);
``--check FILE`` runs them again, prints run | metrics | keys | weights | eval and the first difference of each
run that differs, and exits 1 on any difference or failed run. Run from the repository root:

    python -m benchmarks.investigations.behaviour --source /tmp/redcoda-base --record /tmp/behaviour-base.json
    python -m benchmarks.investigations.behaviour --check /tmp/behaviour-base.json
    python -m benchmarks.investigations.behaviour --check /tmp/behaviour-base.json --only grpo-flat,sft-coda
    python -m benchmarks.investigations.behaviour --list
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

TINY = ("--preset", "tiny", "--torch-threads", "1")
"""Every tiny run's settings (the tiny preset keeps its 4-question greedy evaluation: eval.json is hashed too)."""
CODA = ("--protocol", "coda")

RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpo-flat": ("grpo", TINY),
    "grpo-coda": ("grpo", (*TINY, *CODA)),
    "grpo_sft-flat": ("grpo_sft", TINY),
    "grpo_sft-coda": ("grpo_sft", (*TINY, *CODA)),
    "red_grpo-flat": ("red_grpo", TINY),
    "red_grpo-coda": ("red_grpo", (*TINY, *CODA)),
    "red_grpo-tree": (
        "red_grpo",
        (*TINY, "--rollout", "tree", "--group-size", "3", "--tree-roots", "1", "--tree-branches", "2"),
    ),
    "grpo_expert-flat": ("grpo_expert", TINY),
    "grpo_expert-coda": ("grpo_expert", (*TINY, *CODA)),
    "sft-flat": ("sft", TINY),
    "sft-coda": ("sft", (*TINY, *CODA)),
    # PPO's own env, the query rewrite, has the flat protocol only (--protocol coda changes nothing there)
    "ppo-rewrite": ("ppo", TINY),
    "ppo-hotpotqa": ("ppo", (*TINY, "--env-id", "RedCoda-HotpotQA-v0")),
    "archer-flat": ("archer", TINY),
    "archer-coda": ("archer", (*TINY, *CODA)),
    "red_grpo-cpu10": (
        "red_grpo",
        (
            "--preset",
            "cpu",
            "--steps",
            "10",
            "--max-train-minutes",
            "None",
            "--eval-questions",
            "0",
            "--torch-threads",
            "1",
        ),
    ),
}
"""Each run's entry point (``algos.<entry>``) and flags (``--run-dir`` is added). The ``-flat`` runs pass no
``--protocol``: the entry point's default is flat, so a changed default shows too. ``red_grpo-cpu10`` is the main
job's preset (SmolLM2-135M) for 10 steps, without the 100-question evaluation."""

TIME_PREFIXES = ("time/", "memory/")
"""Keys dropped from a metrics row by prefix: wall-clock seconds of the step's parts, GPU peak memory."""
TIME_KEYS = frozenset({"tokens/s", "tokens/s_generation", "wall_s", "provenance"})
"""Keys dropped by name: throughputs (tokens per second of compute), eval.json's seconds per evaluation and its
provenance (the commit and machine differ between the trees compared, by design)."""
PARTS = ("metrics", "keys", "weights", "eval")
"""The hashed parts of a run, each compared on its own."""


def dropped(key: str) -> bool:
    """Whether `key` is a time-like field, left out of the metrics and eval hashes."""
    return key.startswith(TIME_PREFIXES) or key in TIME_KEYS


def without_times(value: Any) -> Any:
    """`value` (parsed JSON) with every time-like key dropped, at any depth."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if not dropped(k)}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def canonical(value: Any) -> bytes:
    """The JSON bytes hashed for `value`: sorted keys, no spaces, floats as Python's shortest exact repr."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def sha256(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def tensor_digests(path: Path) -> dict[str, str]:
    """sha256 of each tensor of a safetensors file (name, dtype, shape, bytes), by name; metadata ignored."""
    import torch
    from safetensors import safe_open

    digests = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in sorted(handle.keys()):
            tensor = handle.get_tensor(name)
            head = canonical([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            digests[name] = sha256(head + b"\0" + data)
    return digests


def fingerprint(run_dir: Path) -> dict[str, Any]:
    """The hashes of a finished run directory, and the data behind them (``detail``) to locate a difference."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    kept = [without_times(row) for row in rows]
    keys = [sorted(row) for row in rows]
    weights_file = run_dir / "final" / "model.safetensors"
    tensors = tensor_digests(weights_file) if weights_file.exists() else None
    eval_file = run_dir / "eval.json"
    evaluation = without_times(json.loads(eval_file.read_text(encoding="utf-8"))) if eval_file.exists() else None
    return {
        "metrics": sha256(canonical(kept)),
        "keys": sha256(canonical(keys)),
        "weights": None if tensors is None else sha256(canonical(sorted(tensors.items()))),
        "eval": None if evaluation is None else sha256(canonical(evaluation)),
        "dropped": sorted({k for row in rows for k in row if dropped(k)}),
        "detail": {"metrics": kept, "keys": keys, "weights": tensors, "eval": evaluation},
    }


def first_difference(before: Any, after: Any, path: str = "") -> str | None:
    """Where two parsed JSON values first differ (``path: before -> after``), or None when they are equal."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            where = f"{path}[{key!r}]"
            if key not in after:
                return f"{where}: only before ({_short(before[key])})"
            if key not in before:
                return f"{where}: only after ({_short(after[key])})"
            found = first_difference(before[key], after[key], where)
            if found:
                return found
        return None
    if isinstance(before, list) and isinstance(after, list):
        for i, (b, a) in enumerate(zip(before, after, strict=False)):
            found = first_difference(b, a, f"{path}[{i}]")
            if found:
                return found
        if len(before) != len(after):
            return f"{path}: {len(before)} items before, {len(after)} after"
        return None
    if canonical(before) != canonical(after):  # NaN equals NaN here, and 1 differs from 1.0
        return f"{path or 'value'}: {_short(before)} -> {_short(after)}"
    return None


def key_difference(before: list[list[str]], after: list[list[str]]) -> str | None:
    """The first row whose set of keys differs (the keys only before, only after), or None when all agree."""
    for i, (b, a) in enumerate(zip(before, after, strict=False)):
        if set(b) != set(a):
            return f"row {i}: only before {sorted(set(b) - set(a))}, only after {sorted(set(a) - set(b))}"
    return None if len(before) == len(after) else f"{len(before)} rows before, {len(after)} after"


def _short(value: Any, limit: int = 160) -> str:
    text = canonical(value).decode()
    return text if len(text) <= limit else text[:limit] + "..."


def source_commit(source: Path) -> str:
    """The source tree's commit, ``+dirty`` when it has uncommitted changes; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
        status = subprocess.run(["git", "-C", str(source), "status", "--porcelain"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def check_imports(source: Path) -> dict[str, str]:
    """Where a process started in `source` imports the packages from; raises if any is not under `source`.

    The venv's editable install points at one checkout, and ``python -m`` puts the working directory first on
    ``sys.path``: the runs import `source`'s code only if the two agree on that.
    """
    code = (
        "import json, agents, algos, envs, retrievers; "
        "print(json.dumps({m.__name__: m.__file__ for m in (agents, algos, envs, retrievers)}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, check=True)
    files = json.loads(out.stdout)
    outside = {name: file for name, file in files.items() if not Path(file).resolve().is_relative_to(source)}
    if outside:
        raise SystemExit(f"a process in {source} imports these from elsewhere: {outside}")
    return files


def run_one(name: str, source: Path, workdir: Path) -> dict[str, Any]:
    """Run `name` in `source`, hash its run directory, delete it; ``{"error": ...}`` when the run fails."""
    entry, flags = RUNS[name]
    run_dir, cache, log = workdir / name, workdir / f"{name}-cache", workdir / f"{name}.log"
    for path in (run_dir, cache):
        shutil.rmtree(path, ignore_errors=True)
    command = [sys.executable, "-m", f"algos.{entry}", *flags]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "REDCODA_CACHE": str(cache)}
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run([*command, "--run-dir", str(run_dir)], cwd=source, env=env, stdout=out, stderr=out)
    seconds = time.perf_counter() - start
    shown = ["python", *command[1:]]
    try:
        if code.returncode:
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            return {
                "error": f"exit {code.returncode}",
                "log_tail": tail,
                "command": shown,
                "seconds": round(seconds, 1),
            }
        return {"command": shown, "seconds": round(seconds, 1), **fingerprint(run_dir)}
    finally:
        for path in (run_dir, cache):
            shutil.rmtree(path, ignore_errors=True)
        log.unlink(missing_ok=True)


def run_all(names: list[str], source: Path, workdir: Path) -> dict[str, dict[str, Any]]:
    """Run `names` one after the other (each uses the cores it is given), printing each one's hashes."""
    commit = source_commit(source)
    results = {}
    for name in names:
        print(f"{name}: running ...", flush=True)
        result = run_one(name, source, workdir)
        result["source_commit"] = commit
        results[name] = result
        if "error" in result:
            print(f"{name}: FAILED ({result['error']}) after {result['seconds']:.0f} s", flush=True)
            print("\n".join(f"    {line}" for line in result["log_tail"]), flush=True)
        else:
            hashes = "  ".join(f"{part} {str(result[part])[:12]}" for part in PARTS)
            print(f"{name}: {hashes}  ({result['seconds']:.0f} s)", flush=True)
    return results


def record(results: dict[str, dict[str, Any]], path: Path) -> int:
    """Write the successful runs into `path` (merged with its runs if it exists); 1 if any run failed."""
    recorded = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    recorded.update({name: result for name, result in results.items() if "error" not in result})
    path.write_text(json.dumps(recorded, indent=1, sort_keys=True, allow_nan=True) + "\n", encoding="utf-8")
    print(f"recorded {sum('error' not in r for r in results.values())} run(s) in {path}")
    return int(any("error" in result for result in results.values()))


def compare(recorded: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]]) -> int:
    """Print run | metrics | keys | weights | eval | seconds, then each difference's first place; 1 on any."""
    header = ["run", *(f"{part} same" for part in PARTS), "seconds before", "seconds now"]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    notes, failed = [], False
    for name, now in results.items():
        before = recorded[name]
        if "error" in now:
            failed = True
            print(f"| {name} | " + " | ".join(["run failed"] * len(PARTS)) + f" | {before.get('seconds')} | - |")
            notes.append(f"{name}: the run failed ({now['error']}):\n    " + "\n    ".join(now["log_tail"]))
            continue
        same = {part: before.get(part) == now[part] for part in PARTS}
        failed |= not all(same.values())
        cells = ["yes" if same[part] else "NO" for part in PARTS]
        print(f"| {name} | " + " | ".join(cells) + f" | {before.get('seconds')} | {now['seconds']} |")
        for part in PARTS:
            if not same[part]:
                was, got = before.get("detail", {}).get(part), now["detail"][part]
                where = key_difference(was or [], got) if part == "keys" else first_difference(was, got)
                notes.append(f"{name}: {part} first differs at {where or '? (no detail recorded)'}")
        if before.get("dropped") != now["dropped"]:
            notes.append(f"{name}: dropped time-like keys {before.get('dropped')} -> {now['dropped']}")
    if notes:
        print("\n" + "\n".join(notes))
    print("\nsame" if not failed else "\nDIFFERENT")
    return int(failed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, metavar="FILE", help="run and write the hashes to FILE")
    mode.add_argument("--check", type=Path, metavar="FILE", help="run and compare with FILE's hashes")
    mode.add_argument("--list", action="store_true", help="print the runs and their commands")
    parser.add_argument("--only", help="comma-separated run names (default: all, or all of FILE's under --check)")
    parser.add_argument("--source", type=Path, default=ROOT, help="the source tree the runs start in")
    parser.add_argument("--workdir", type=Path, help="where run directories go (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Record or check the runs' hashes; the exit status is 1 on a difference or a failed run."""
    args = parse_args(argv)
    if args.list:
        for name, (entry, flags) in RUNS.items():
            print(f"{name}: python -m algos.{entry} {' '.join(flags)} --run-dir DIR")
        return 0
    recorded = json.loads(args.check.read_text(encoding="utf-8")) if args.check else {}
    names = args.only.split(",") if args.only else [name for name in RUNS if not args.check or name in recorded]
    unknown = [name for name in names if name not in RUNS or (args.check and name not in recorded)]
    if unknown:
        raise SystemExit(f"unknown or unrecorded runs: {', '.join(unknown)} (--list shows the runs)")
    source = args.source.resolve()
    files = check_imports(source)
    print(f"source {source} at {source_commit(source)}; algos from {files['algos']}", flush=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="behaviour-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run_all(names, source, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return record(results, args.record) if args.record else compare(recorded, results)


if __name__ == "__main__":
    sys.exit(main())
