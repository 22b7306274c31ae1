"""The behaviour check's hashes (`benchmarks.investigations.behaviour`): time-like fields out, everything else in; the
weights hash reads tensors, not the file's bytes; and a difference is located, not only detected."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from benchmarks.investigations.behaviour import dropped, fingerprint, first_difference, key_difference, without_times


def test_time_like_fields_are_dropped_and_nothing_else():
    row = {
        "step": 1,
        "time/step": 0.6,
        "time/checkpoint": 0.1,
        "memory/peak_gib": 2.0,
        "tokens/s": 10.0,
        "tokens/s_generation": 300.0,
        "tokens/sampled": 192,
        "tokens/trained": 0,
        "train/lr": 1e-3,
    }
    assert without_times(row) == {"step": 1, "tokens/sampled": 192, "tokens/trained": 0, "train/lr": 1e-3}
    evaluation = {"before": {"wall_s": 0.2, "predictions": [{"em": 0.0, "wall_s": 1.0}]}}
    assert without_times(evaluation) == {"before": {"predictions": [{"em": 0.0}]}}
    assert not dropped("sft/weight") and not dropped("rl/signal_rows")


def _run_dir(path, tensors, metadata, rows):
    (path / "final").mkdir(parents=True)
    save_file(tensors, str(path / "final" / "model.safetensors"), metadata=metadata)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_weights_hash_reads_tensors_not_file_bytes(tmp_path):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    rows = [{"step": 1, "loss_pg": 0.5, "time/step": 0.1}]
    base = fingerprint(_run_dir(tmp_path / "base", {"a": a, "b": b}, {"format": "pt"}, rows))
    other_metadata = fingerprint(_run_dir(tmp_path / "meta", {"b": b, "a": a}, {"format": "pt", "x": "y"}, rows))
    assert other_metadata["weights"] == base["weights"]
    slower = [{"step": 1, "loss_pg": 0.5, "time/step": 9.9}]
    assert fingerprint(_run_dir(tmp_path / "slow", {"a": a, "b": b}, None, slower))["metrics"] == base["metrics"]
    assert base["dropped"] == ["time/step"]

    changed = b.clone()
    changed[1] = -2.015625  # the next bfloat16 after -2.0: one bit
    moved = fingerprint(_run_dir(tmp_path / "bit", {"a": a, "b": changed}, None, rows))
    assert moved["weights"] != base["weights"]
    assert "['b']" in first_difference(base["detail"]["weights"], moved["detail"]["weights"])
    reshaped = fingerprint(_run_dir(tmp_path / "shape", {"a": a.reshape(3, 2), "b": b}, None, rows))
    assert reshaped["weights"] != base["weights"]
    as_double = fingerprint(_run_dir(tmp_path / "dtype", {"a": a.double(), "b": b}, None, rows))
    assert as_double["weights"] != base["weights"]


def test_a_difference_is_located():
    before = [{"step": 1, "loss_pg": 0.5, "nan": float("nan")}, {"step": 2, "loss_pg": 0.25}]
    after = [{"step": 1, "loss_pg": 0.5, "nan": float("nan")}, {"step": 2, "loss_pg": 0.2500001}]
    assert first_difference(before, before) is None  # NaN equals NaN
    assert first_difference(before, after) == "[1]['loss_pg']: 0.25 -> 0.2500001"
    assert first_difference([{"x": 1}], [{"x": 1.0}]) == "[0]['x']: 1 -> 1.0"
    assert first_difference([1], [1, 2]) == ": 1 items before, 2 after"
    assert key_difference([["a", "b"]], [["a", "c"]]) == "row 0: only before ['b'], only after ['c']"
    assert key_difference([["a", "b"]], [["b", "a"]]) is None
