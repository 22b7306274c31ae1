"""The run's tail plays exactly what it played before its speed-ups: kept keys and values copied once per row are
the same numbers, and a greedy CoDA evaluation over them predicts the same, field for field (tiny model, real env)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from agents.evaluation import evaluate
from agents.samplers import decode_steps
from agents.samplers.kv_cache import AppendLayer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _stacked_row(self: decode_steps.CacheSteps, j: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier formulation: a gather per layer, then a stack of them (two copies)."""
    layers = self.cache.layers
    keys = torch.stack([layer.keys[j].index_select(1, columns) for layer in layers])
    return keys, torch.stack([layer.values[j].index_select(1, columns) for layer in layers])


def test_a_finished_rows_keys_and_values_are_its_columns(tiny):
    model, _ = tiny
    cache = DynamicCache(config=model.config)
    cache.layers = [AppendLayer(12) for _ in cache.layers]
    generator = torch.Generator().manual_seed(0)
    for index in range(len(cache.layers)):  # (rows, kv_heads, columns, head_dim), then one decode column more
        for width in (9, 1):
            keys, values = torch.randn(3, 2, width, 4, generator=generator), torch.randn(3, 2, width, 4)
            cache.update(keys, values, index)
    steps = decode_steps.CacheSteps(model, cache)
    columns = torch.tensor([2, 3, 4, 7, 8, 9])  # a row's unpadded columns: reused past, fresh prompt, samples
    for j in range(3):
        for got, want in zip(steps.row(j, columns), _stacked_row(steps, j, columns), strict=True):
            assert got.shape == want.shape and torch.equal(got, want)


def test_greedy_coda_predictions_do_not_depend_on_how_kept_rows_are_copied(tiny, bm25, monkeypatch):
    kwargs = {"limit": 4, "batch": 3, "max_new_tokens": 8, "max_turns": 3, "progress": False}
    now = evaluate("coda", tiny, "dev", **kwargs)
    monkeypatch.setattr(decode_steps.CacheSteps, "row", _stacked_row)
    before = evaluate("coda", tiny, "dev", **kwargs)
    assert now["predictions"] == before["predictions"] and now["metrics"] == before["metrics"]
    assert sum(p["sampled_tokens"] for p in now["predictions"]) > 0


def test_a_run_without_the_validation_choice_has_no_validation_parts(tmp_path):
    """A run that ended on its last step has no validation.json: the tail replays the starting and final models
    only; a run with one replays each recorded candidate on the recorded questions, newest first."""
    from benchmarks.investigations.tail import tail_parts

    assert tail_parts(tmp_path, None, None) == ([], [])
    recorded = {
        "settings": {"questions": [7, 8, 9]},
        "candidates": [{"step": 4, "path": "x/checkpoints/step_000004"}, {"step": 2, "path": "step_000002"}],
    }
    (tmp_path / "validation.json").write_text(json.dumps(recorded))
    parts, questions = tail_parts(tmp_path, 2, None)
    assert questions == [7, 8] and [p["step"] for p in parts] == [4, 2]
    assert parts[0]["checkpoint"] == str(tmp_path / "checkpoints" / "step_000004")


def test_an_evaluation_batch_is_one_sampler_batch(tiny):
    """The transformers sampler of an evaluation runs all of a batched rollout's rows in one pass (100 held-out
    episodes: one loop of decode steps a turn, not one for 64 rows and another for 36)."""
    from agents.evaluation import _load

    assert _load(tiny, 0, 2048, batch=100).max_batch_size == 100
    assert _load(tiny, 0, 2048, batch=8).max_batch_size == 64


def test_a_corpus_is_hashed_once_however_many_envs_ask(monkeypatch):
    """Every env made over a corpus asks for its fingerprint (the retrievers' cache key): the rows are hashed once
    per corpus, to what hashing them while streaming the file gives."""
    from retrievers import corpus as corpus_module

    calls = []
    rows = corpus_module.fingerprint_rows
    monkeypatch.setattr(corpus_module, "fingerprint_rows", lambda r: calls.append(1) or rows(r))
    corpus = corpus_module.Corpus.from_passages([("a", "Alpha", "first text"), ("b", "Beta", "second text")])
    first = corpus.fingerprint
    assert [corpus.fingerprint for _ in range(5)] == [first] * 5 and len(calls) == 1
    assert first == rows([("a", "Alpha", "first text"), ("b", "Beta", "second text")])
    other = corpus_module.Corpus.from_passages([("a", "Alpha", "first text"), ("b", "Beta", "other text")])
    assert other.fingerprint != first
