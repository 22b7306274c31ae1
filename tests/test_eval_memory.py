"""The held-out evaluation's memory: counted by the start-of-run estimate (its rows at the full context, its model, the
samplers' kept keys and values) and bounded on a CPU, where the evaluation runs no more episodes at a time than fit."""

from __future__ import annotations

import logging

import pytest
import torch

from algos.config import preset_config
from algos.run import memory
from algos.run.evaluation import score_held_out


@pytest.fixture(scope="module")
def shape():
    from transformers import AutoConfig

    from agents.models import ensure_smollm2_cache

    return memory.Shape.of(AutoConfig.from_pretrained(str(ensure_smollm2_cache())))


def test_the_estimate_counts_the_evaluation_s_batch_and_the_kept_caches(shape):
    wide = memory.estimate(preset_config("cpu", eval_batch_size=100), shape)
    narrow = memory.estimate(preset_config("cpu", eval_batch_size=4), shape)
    none = memory.estimate(preset_config("cpu", eval_questions=0), shape)
    assert (wide.eval_rows, narrow.eval_rows, none.eval_rows) == (100, 4, None)
    assert wide.total > narrow.total >= none.total and "held-out evaluation" not in none.parts
    rows = memory.evaluation_row_bytes(preset_config("cpu"), shape)
    assert wide.parts["held-out evaluation"] - narrow.parts.get("held-out evaluation", 0.0) >= 90 * rows
    per_token = shape.layers * 2 * shape.kv_dim * 4  # float32 keys and values of one token
    assert none.parts["kept kv cache"] == memory.KEPT_CACHE_TOKENS * per_token
    assert "held-out evaluation 100 episodes at a time" in wide.describe()


def test_the_kept_cache_is_the_sampler_s_own_bound():
    from agents.samplers.hf import DEFAULT_CACHE_TOKENS

    assert memory.KEPT_CACHE_TOKENS == DEFAULT_CACHE_TOKENS


def test_a_row_costs_its_full_context_and_coda_two_contexts(shape):
    flat = memory.evaluation_row_bytes(preset_config("cpu", protocol="flat"), shape)
    longer = preset_config("cpu", protocol="flat", max_context_tokens=4096)
    assert memory.evaluation_row_bytes(longer, shape) > 1.9 * flat
    assert memory.evaluation_row_bytes(preset_config("cpu", protocol="coda"), shape) > 1.9 * flat


def test_on_a_cpu_the_evaluation_runs_as_many_rows_as_fit(shape):
    """With the device's capacity the estimate runs fewer rows at a time where a hundred would not fit, so the whole
    run stays within `MARGIN` of it; on a GPU ``--eval-batch-size`` stands."""
    config = preset_config("cpu", eval_batch_size=100)
    free = memory.estimate(config, shape, capacity=1000 * memory.GIB)
    assert free.eval_rows == 100
    tight = memory.estimate(config, shape, capacity=16 * memory.GIB)
    assert 1 <= tight.eval_rows < 100 and tight.total <= memory.MARGIN * 16 * memory.GIB
    smaller = memory.estimate(config, shape, capacity=12 * memory.GIB)
    assert smaller.eval_rows < tight.eval_rows
    assert memory.estimate(config, shape, capacity=1 * memory.GIB).eval_rows == 1  # then check() refuses the run
    gpu = preset_config("gpu", device="cuda", eval_batch_size=100)
    assert memory.estimate(gpu, shape, capacity=16 * memory.GIB).eval_rows == 100


def test_the_cli_estimate_follows_the_evaluation_flags(capsys):
    wide = memory.main(["--preset", "cpu", "--eval-batch-size", "100", "--top-k", "5", "--max-passage-words", "80"])
    narrow = memory.main(["--preset", "cpu", "--eval-batch-size", "4", "--top-k", "5", "--max-passage-words", "80"])
    assert narrow.eval_rows == 4 and wide.eval_rows >= narrow.eval_rows and wide.total >= narrow.total
    assert "episodes at a time" in capsys.readouterr().out


def test_a_row_s_bound_holds_what_the_sampler_keeps(one_torch_thread):
    """The real sampler's keys and values of rows at (nearly) the full context stay within a row's bound, and make up
    a fair share of it (the bound is not vacuous)."""
    from agents.models import tiny_model
    from agents.records import SamplingParams
    from agents.samplers import HFSampler

    model, tokenizer = tiny_model(seed=0)
    config = preset_config("tiny", max_context_tokens=256)
    shape = memory.Shape.of(model.config, parameters=sum(p.numel() for p in model.parameters()))
    sampler = HFSampler(model, tokenizer, max_context=256)
    prompts = [[1] + [100 + (7 * i + j) % 500 for j in range(230)] for i in range(3)]
    sampler.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    kept = sum(
        t.numel() * t.element_size() for entry in sampler._store.entries.values() for t in (*entry.keys, *entry.values)
    )
    kv_row = config.model.max_context_tokens * shape.layers * 2 * shape.kv_dim * 4
    assert 0.5 * 3 * kv_row <= kept <= 3 * memory.evaluation_row_bytes(config, shape)


def test_the_held_out_evaluation_runs_fewer_rows_where_memory_is_short(monkeypatch, caplog, one_torch_thread):
    """`score_held_out` (the trainer's before/after, the comparison's scores) asks `held_out_batch`: with little memory
    available it plays its questions a row at a time, says so, and scores every question."""
    from agents.models import tiny_model

    config = preset_config("tiny", eval_questions=3, eval_batch_size=3, progress=False)
    pair = tiny_model(seed=0)
    assert memory.held_out_batch(config, pair) == 3
    monkeypatch.setattr(memory, "usable_memory", lambda device: 0.0)
    assert memory.held_out_batch(config, pair) == 1
    assert memory.held_out_batch(config.with_values(device="cuda"), pair) == 3  # a GPU's batch is the flag's
    with caplog.at_level(logging.WARNING, logger="algos.run.evaluation"):
        result = score_held_out(pair, config)
    assert result["n"] == 3 and "1 episodes at a time instead of --eval-batch-size 3" in caplog.text
    assert torch.get_num_threads() == 1
