"""The main job's tail, before and after a code change, side by side: seconds per part and identical predictions.

The tail of ``python -m algos.red_grpo`` scores models greedily after training: with ``--validation-questions``
each kept checkpoint on the validation questions (`algos.run.evaluation.select_checkpoint`), then the starting model
and the final model (the chosen checkpoint, else the last step's) on the held-out dev questions
(`algos.run.evaluation.before_after`). This script replays those parts for a finished run, each in its own process,
once with the code of a git revision (the baseline, exported read-only into a temporary folder) and once with the
working tree, alternating which goes first, and prints per part the seconds of each, their ratio and whether the
per-question predictions are identical (every field but timing). The CPU may be shared: the load average is
printed, and only ratios from one run are comparable.

    python -m benchmarks.investigations.tail --run runs/main-seed0                      # the whole tail, baseline HEAD
    python -m benchmarks.investigations.tail --run runs/main-seed0 --validation 5 --dev 5  # fewer questions: quick
    python -m benchmarks.investigations.tail --run runs/main-last-seed1 --batch 50 100     # a new evaluation batch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("agents", "algos", "envs", "retrievers")
"""The packages a part runs; the baseline's come from the git revision, everything else is shared."""


def export_tree(revision: str, into: Path) -> Path:
    """Write `revision`'s `SOURCES` into `into` (``git archive``: the index and work tree stay untouched)."""
    archive = subprocess.run(["git", "archive", revision, *SOURCES], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_part(tree: Path, part: dict[str, Any], run: Path, threads: int, out: Path) -> dict[str, Any]:
    """One part in a fresh process whose `agents`, `algos`, `envs` and `retrievers` are `tree`'s."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(part), "--run", str(run)]
    command += ["--threads", str(threads), "--out", str(out)]
    subprocess.run(command, env=env, check=True, cwd=tree)
    return json.loads(out.read_text())


def worker(part: dict[str, Any], run: Path, threads: int, out: Path) -> None:
    """Score one model as the tail does (`algos.run.evaluation.score_held_out`), writes its seconds and predictions."""

    import torch

    import agents

    if not Path(agents.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise RuntimeError(f"imported agents from {agents.__file__}, not from {Path.cwd()}")
    torch.set_num_threads(threads)
    from agents.models import load_model
    from algos.config import Config
    from algos.run.evaluation import score_held_out

    saved = json.loads((run / "redcoda_config.json").read_text())
    names = Config.flat_types()
    config = Config().with_values(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names})
    config = config.with_values(progress=False, eval_questions=part.get("dev", config.run.eval_questions))
    if part.get("batch"):
        config = config.with_values(eval_batch_size=part["batch"])
    model, tokenizer = load_model(part.get("model"))
    if part.get("checkpoint"):
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(Path(part["checkpoint"]) / "weights.safetensors"), False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # the LM head is tied to the embeddings
            raise ValueError(f"{part['checkpoint']}: missing {missing}, unexpected {unexpected}")
    start = time.perf_counter()
    result = score_held_out((model, tokenizer), config, validation=part.get("validation"))
    wall = time.perf_counter() - start
    out.write_text(json.dumps({"wall_s": wall, "metrics": result["metrics"], "predictions": result["predictions"]}))


def tail_parts(run: Path, validation: int | None, dev: int | None) -> tuple[list[dict[str, Any]], list[int]]:
    """The validation parts, newest checkpoint first, and the validation question indices (none for a run that
    ended on its last step, without the validation choice)."""
    if not (run / "validation.json").is_file():
        return [], []
    recorded = json.loads((run / "validation.json").read_text())
    questions = recorded["settings"]["questions"][:validation]
    parts = [
        {
            "name": f"validation, step {c['step']}",
            "model": str(run / "final"),  # its architecture and tokenizer; the checkpoint's weights replace its own
            "checkpoint": str(run / "checkpoints" / Path(c["path"]).name),
            "step": c["step"],
            "validation": questions,
        }
        for c in recorded["candidates"]
    ]
    return parts, questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("runs/main-seed0"), help="a finished run directory")
    parser.add_argument("--baseline", default="HEAD", help="git revision of the code to compare against")
    parser.add_argument("--validation", type=int, default=None, help="first N validation questions (all)")
    parser.add_argument("--dev", type=int, default=None, help="first N dev questions (the run's eval_questions)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per part")
    parser.add_argument(
        "--batch",
        type=int,
        nargs=2,
        metavar=("BASELINE", "CURRENT"),
        help="episodes per evaluation batch for the baseline and the current code (the run's own for both)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    run = args.run.resolve()
    if args.worker:
        worker(json.loads(args.worker), run, args.threads, args.out)
        return
    parts, _ = tail_parts(run, args.validation, args.dev)
    dev = {} if args.dev is None else {"dev": args.dev}
    rows, results = [], {}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": export_tree(args.baseline, Path(tmp)), "current": ROOT}
        queue = parts + [{"name": "starting model, dev", "model": None} | dev, None]
        batch = dict(zip(("baseline", "current"), args.batch or (None, None), strict=True))
        for k, part in enumerate(queue):
            if part is None and not parts:  # the trained model: the run's final model (its last step)
                part = {"name": "trained (final), dev", "model": str(run / "final"), "validation": None} | dev
            elif part is None:  # the trained model: the checkpoint the validation chose (newest on a tie)
                scores = [results[p["name"]]["current"]["metrics"]["f1"]["mean"] for p in parts]
                chosen = parts[max(range(len(parts)), key=lambda i: (scores[i], -i))]
                part = {"name": f"trained (step {chosen['step']}), dev", **chosen, "validation": None} | dev
            order = ("baseline", "current") if k % 2 == 0 else ("current", "baseline")
            results[part["name"]] = {
                side: run_part(
                    trees[side], part | {"batch": batch[side]}, run, args.threads, Path(tmp) / f"{side}-{k}.json"
                )
                for side in order
            }
            old, new = results[part["name"]]["baseline"], results[part["name"]]["current"]
            same = old["predictions"] == new["predictions"] and old["metrics"] == new["metrics"]
            rows.append((part["name"], len(new["predictions"]), old["wall_s"], new["wall_s"], same))
            print(f"{part['name']}: {old['wall_s']:.1f} s -> {new['wall_s']:.1f} s, identical: {same}", flush=True)
    print(f"\nload average at end: {os.getloadavg()}\n")
    print("| part | questions | baseline (s) | current (s) | baseline / current | identical predictions |")
    print("|---|---|---|---|---|---|")
    for name, n, old, new, same in rows:
        print(f"| {name} | {n} | {old:.1f} | {new:.1f} | {old / new:.2f}x | {'yes' if same else 'NO'} |")
    total_old, total_new = sum(r[2] for r in rows), sum(r[3] for r in rows)
    identical = all(r[4] for r in rows)
    print(f"| **tail** | | {total_old:.1f} | {total_new:.1f} | {total_old / total_new:.2f}x | {identical} |")
    if not identical:
        raise SystemExit("the predictions differ: the change altered what the tail reports")


if __name__ == "__main__":
    main()
