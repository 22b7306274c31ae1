"""The figures `benchmarks.report` draws from the results store, and the page blocks that show them.

A page holds ``<!-- report:figure NAME FILE -->``: the stored run NAME's figure FILE, drawn from its stored metrics
rows into the folder it was ingested from under ``benchmarks/results/`` (else ``benchmarks/results/NAME/``).
``curves.png`` is a trainer run's or main job's, drawn as the run draws its own
(`algos.run.evaluation.plot_curves`: each step's rollouts with their 10-step mean, the held-out scores before and
after, the validation choice); ``reward.png``, ``f1.png``, ``answered.png``, ``sft_weight.png`` and
``red_weights.png`` are a comparison's, drawn as `benchmarks.compare` draws them (the mean over seeds with a band).

The block is the image and a caption built from the store: the run's name, its steps and seeds, and the hash of the
data drawn. The PNG carries the same hash in a text chunk, so ``--check`` compares hashes, not pixels (matplotlib's
bytes differ across versions and fonts): it names a block whose text differs, a figure that is missing and one
drawn from other data than the store holds. `python -m benchmarks.report` draws a figure only when it is missing or
its hash differs (``--redraw``: every one).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import results_store
from benchmarks.results_store import ROOT, StoredRun

CURVES = "curves.png"
"""A single run's learning curves (`algos.run.evaluation.plot_curves`)."""
COMPARISON_FIGURES = {
    "reward.png": "Episode reward",
    "f1.png": "Answer F1",
    "answered.png": "Valid answers",
    "sft_weight.png": "SFT weight",
    "red_weights.png": "RED's entropy weight, accuracy factor and final weight",
}
"""A comparison's figures (`benchmarks.compare_report.plot`) and what each shows of the training rollouts."""
HASH_KEY = b"redcoda:data-sha256"
"""The PNG text chunk's key that holds the hash of the data a figure was drawn from."""


def data_hash(data: Any) -> str:
    """The first 16 hex digits of the SHA-256 of `data` as canonical JSON."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _chunks(png: bytes) -> list[tuple[bytes, bytes, int]]:
    """A PNG's chunks: (type, data, offset of the chunk)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    chunks, at = [], 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        chunks.append((png[at + 4 : at + 8], png[at + 8 : at + 8 + length], at))
        at += 12 + length
    return chunks


def recorded_hash(path: Path) -> str | None:
    """The data hash a figure's PNG carries (None: none, or not a PNG)."""
    try:
        chunks = _chunks(path.read_bytes())
    except (OSError, ValueError, struct.error):
        return None
    for kind, data, _ in chunks:
        if kind == b"tEXt" and data.startswith(HASH_KEY + b"\0"):
            return data[len(HASH_KEY) + 1 :].decode("latin-1")
    return None


def record_hash(path: Path, digest: str) -> None:
    """Write `digest` into the PNG at `path` as a text chunk before its end (the image itself unchanged)."""
    png = path.read_bytes()
    end = next(at for kind, _, at in _chunks(png) if kind == b"IEND")
    body = b"tEXt" + HASH_KEY + b"\0" + digest.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    path.write_bytes(png[:end] + chunk + png[end:])


def _compact(path: Path, colors: int = 128) -> None:
    """Rewrite a drawn PNG with a palette of `colors`: a third of the bytes, and a plot's lines and bands look the
    same (matplotlib writes 8-bit RGBA)."""
    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)


def _rows(run: StoredRun) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "record"} for row in run.metrics]


def _held_out(run: StoredRun) -> dict[str, Any] | None:
    """`before_after`'s shape for `plot_curves`: F1 and valid answers of both models with their intervals, from the
    stored questions (as the run computed them) or, for a run that predates the store, its recorded table."""
    if {q.get("part") for q in run.questions} >= {"before", "after"}:
        from agents.evaluation import metric_intervals

        out: dict[str, Any] = {}
        for part in ("before", "after"):
            questions = [q for q in run.questions if q["part"] == part]
            intervals = metric_intervals(questions, ["f1", "answered"])
            out[part] = {"n": len(questions), "metrics": {k: v.as_dict() for k, v in intervals.items()}}
        return out
    table = {r["model"].split()[0]: r for r in run.rows if r.get("table") == "before_after"}
    if not {"before", "after"} <= set(table):
        return None
    counted = re.search(r"(\d+) dev questions", run.header.get("recorded", ""))
    n = int(counted[1]) if counted else None
    return {
        part: {"n": n, "metrics": {"f1": table[part]["F1"], "answered": table[part]["valid answers"]}}
        for part in ("before", "after")
    }


def _validation(run: StoredRun) -> dict[str, Any] | None:
    """`select_checkpoint`'s shape for `plot_curves`, from a main job's recorded validation (None: none)."""
    summary = run.header.get("summary") or {}
    if not summary.get("validation_f1"):
        return None
    answered = summary.get("validation_answered", {})
    candidates = [
        {"step": int(step), "metrics": {"f1": {"mean": f1}, "answered": {"mean": answered.get(step, float("nan"))}}}
        for step, f1 in summary["validation_f1"].items()
    ]
    return {
        "selected_step": summary["chosen_step"],
        "questions": summary["validation_questions"],
        "candidates": candidates,
    }


def _systems(run: StoredRun) -> list[str]:
    """A comparison's systems in its table's order (those that trained)."""
    rows = run.header.get("rows") or [r for r in run.rows if r.get("table") == "systems"]
    return [r["algorithm"] for r in rows if "start model" not in r["algorithm"]]


@dataclass(frozen=True)
class Figure:
    """One figure of one stored run: what it is drawn from, where it goes, and its caption."""

    run: str
    file: str
    path: Path
    data: dict[str, Any]
    title: str
    """The image's alternative text."""
    caption: str

    @property
    def digest(self) -> str:
        return data_hash({"figure": self.file, **self.data})

    def block(self, page_dir: Path) -> str:
        """The page's block: the image, then its caption with the store record and the data hash."""
        link = Path(os.path.relpath(self.path, page_dir)).as_posix()
        return f"![{self.title}]({link})\n\n*{self.caption} Data sha256 `{self.digest}`.*"

    def problems(self, root: Path = ROOT) -> list[str]:
        """Why the PNG is not this figure: missing, or drawn from other data (empty: it is)."""
        where = self.path.relative_to(root).as_posix() if self.path.is_relative_to(root) else str(self.path)
        if not self.path.exists():
            return [f"{where} is missing"]
        recorded = recorded_hash(self.path)
        if recorded != self.digest:
            return [f"{where} was drawn from data sha256 {recorded or 'unknown'}, the store's is {self.digest}"]
        return []

    def draw(self) -> Path:
        """Draw the PNG from the stored data and record the data's hash in it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as scratch:
            if self.file == CURVES:
                from algos.run.evaluation import plot_curves

                metrics = Path(scratch) / "metrics.jsonl"
                metrics.write_text("".join(json.dumps(r) + "\n" for r in self.data["metrics"]))
                plot_curves(metrics, self.path, evaluation=self.data["held_out"], validation=self.data["validation"])
            else:
                from benchmarks.compare_report import plot

                run_dirs: dict[str, list[Path]] = {}
                for system, seeds in self.data["systems"]:
                    for seed, rows in enumerate(seeds):
                        run_dir = Path(scratch) / f"{results_store.system_slug(system)}-seed{seed}"
                        run_dir.mkdir()
                        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                        run_dirs.setdefault(system, []).append(run_dir)
                plot(run_dirs, Path(scratch), files=[self.file])
                self.path.write_bytes((Path(scratch) / self.file).read_bytes())
        _compact(self.path)
        record_hash(self.path, self.digest)
        return self.path


def _curves(run: StoredRun, path: Path) -> Figure:
    rows = _rows(run)
    data = {"metrics": rows, "held_out": _held_out(run), "validation": _validation(run)}
    seed = (run.header.get("provenance") or {}).get("seed")
    caption = (
        f"`{run.name}` in the results store, seed {seed}, {rows[-1]['step']} steps: reward, answer F1, valid "
        "answers and SFT weight of each step's rollouts with their 10-step mean"
    )
    if any("red/entropy_weight" in r for r in rows):
        caption += "; RED's entropy weight and accuracy factor, and each entropy per step beside RED's average of it"
    if data["held_out"]:
        caption += (
            f"; held-out F1 and valid answers of the start and final model ({data['held_out']['after']['n']} questions)"
        )
    if data["validation"]:
        validation = data["validation"]
        caption += (
            f"; each kept checkpoint on {validation['questions']} validation questions, step "
            f"{validation['selected_step']} chosen"
        )
    title = f"Learning curves of {run.name}, {rows[-1]['step']} steps"
    return Figure(run.name, CURVES, path, data, title, caption + ".")


def _comparison(run: StoredRun, file: str, path: Path) -> Figure:
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in _rows(run):
        by_run.setdefault(row.pop("run"), []).append(row)
    systems = []
    for system in _systems(run):
        slug = results_store.system_slug(system)
        seeds = sorted(
            (r for r in by_run if r.rsplit("-seed", 1)[0] == slug), key=lambda r: int(r.rsplit("-seed", 1)[1])
        )
        if seeds:
            systems.append([system, [by_run[r] for r in seeds]])
    if not systems:
        raise SystemExit(f"{run.name}: no stored metrics rows belong to its systems ({', '.join(_systems(run))})")
    from benchmarks.compare_report import SMOOTH_STEPS

    steps = min(len(rows) for _, seeds in systems for rows in seeds)
    counts = sorted({len(seeds) for _, seeds in systems})
    seeds = " or ".join(map(str, counts)) + (" seed" if counts == [1] else " seeds")
    caption = (
        f"{COMPARISON_FIGURES[file]} of the training rollouts by system, `{run.name}` in the results store, {steps} "
        f"steps, {seeds} a system: the mean over seeds of a {SMOOTH_STEPS}-step mean, with a band from the lowest to "
        "the highest seed."
    )
    title = f"{COMPARISON_FIGURES[file]} by system, {run.name}, {steps} steps"
    return Figure(run.name, file, path, {"systems": systems}, title, caption)


def figure(argument: str, root: Path = ROOT) -> Figure:
    """The figure a block's ``NAME FILE`` names, from the store the report reads (`results_store.STORE`)."""
    name, _, file = argument.partition(" ")
    run = results_store.load(name, results_store.STORE)
    if not run.metrics:
        raise SystemExit(
            f"figure {argument}: the store holds no metrics rows for {name}; ingest them, or move the figure under "
            "the page's 'Not rebuildable from the repository'"
        )
    source = Path(run.header.get("source") or "")
    folder = source if source.parts[:2] == ("benchmarks", "results") and not source.suffix else None
    path = root / (folder or Path("benchmarks", "results", name)) / file
    comparison = "run" in run.metrics[0]
    if file == CURVES and not comparison:
        return _curves(run, path)
    if file in COMPARISON_FIGURES and comparison:
        return _comparison(run, file, path)
    allowed = ", ".join(COMPARISON_FIGURES) if comparison else CURVES
    raise SystemExit(f"figure {argument}: {name} is a {'comparison' if comparison else 'run'}; its figures: {allowed}")
