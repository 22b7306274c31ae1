"""The sampler's decoding levers each sample what they sample when turned off, and do what they say.

- rows per batch (`algos.run.memory.sampler_rows`): chosen from a fixed memory reading;
- finished rows leaving the stepped row bucket (`HFSampler(compact_rows=...)`, `StaticDecoder.compact`);
- a call's shared prefixes prefilled once (`HFSampler(share_prefixes=...)`), against every row prefilled apart;
- the prefill's attention (`HFSampler(sdpa_prefill=...)`, `kv_cache.choose_prefill_attention`), against a model
  loaded with eager attention.

Each comparison runs the same calls, with the same seeds, on a sampler with the lever on and one with it off: the
sampled tokens must be identical and the log-probs within 1e-5 (float32 on a CPU; the levers change the order of
some sums, never what is summed). GPU throughput is measured by `benchmarks.scale_step`; the CPU side by side is
`benchmarks.decode_levers`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from agents.records import SamplingParams
from agents.samplers import HFSampler, encode_chat
from agents.samplers.kv_cache import choose_prefill_attention, sampling_attention
from algos.run import memory

TOLERANCE = 1e-5
PARAMS = [
    SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=("k",)),
    SamplingParams(max_new_tokens=24, temperature=0.0, stop=("k",)),
]
IDS = ["t1", "greedy"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_same(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOLERANCE, rel=TOLERANCE)


@pytest.fixture(scope="module")
def group_prompts(tiny):
    """Four questions under one set of instructions, each twice (a GRPO group of 2), in the order a collector
    sends them."""
    _, tokenizer = tiny
    instructions = tokenizer("Answer the question by searching. " * 8, add_special_tokens=False)["input_ids"]
    questions = [" Who wrote Dune?", " Where is Paris?", " Name a planet.", " Hi"]
    asked = [instructions + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [prompt for prompt in asked for _ in range(2)]


@pytest.fixture(scope="module")
def chat_prompts(tiny):
    _, tokenizer = tiny
    questions = ["Who wrote Dune?", "Which river flows through Berlin?", "Hi", "Is Paris in France?", "Name a planet."]
    return [encode_chat(tokenizer, [{"role": "user", "content": f"{q} ({i})"}]) for i, q in enumerate(questions * 2)]


# --- rows per batch ---------------------------------------------------------------------------------------------


def _gpu_config(questions: int, group: int, **model):
    from algos.run.cli import parse_config

    config = parse_config(["--preset", "gpu"], algo="red_grpo")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cuda", **model))
    rl = dataclasses.replace(config.rl, questions_per_step=questions, group_size=group)
    return dataclasses.replace(config, rl=rl)


SHAPE_3B = memory.Shape(parameters=3_085_938_688, layers=36, hidden=2048, intermediate=11008, vocab=151936, kv_dim=256)


def test_rows_per_batch_are_chosen_from_a_fixed_memory_reading():
    config = _gpu_config(64, 4)  # 256 episodes a step
    estimate = {
        rows: memory.estimate(memory.with_sampler_rows(config, rows), SHAPE_3B).total for rows in memory.SAMPLER_ROWS
    }
    assert estimate[64] < estimate[128] < estimate[256]  # more rows: more keys and values at the full context
    for rows in (64, 128, 256):  # a reading that just holds each one's run takes it
        capacity = estimate[rows] / memory.MARGIN + 1
        assert memory.sampler_rows(config, SHAPE_3B, capacity)[0] == rows
    assert memory.sampler_rows(config, SHAPE_3B, estimate[64] / 2)[0] == 64  # nothing fits: the check will say so
    assert memory.sampler_rows(config, SHAPE_3B, None)[0] == 256  # no reading: the upper bound
    plenty = 100 * estimate[256]
    assert memory.sampler_rows(_gpu_config(32, 2), SHAPE_3B, plenty)[0] == 64  # 64 episodes fill 64 rows
    assert memory.sampler_rows(_gpu_config(50, 2), SHAPE_3B, plenty)[0] == 128  # 100 episodes fill 128
    assert memory.sampler_rows(_gpu_config(64, 4), SHAPE_3B, plenty, ranks=4)[0] == 64  # a rank's share
    assert memory.sampler_rows(_gpu_config(64, 4, sampler_batch_size=32), SHAPE_3B, plenty) == (
        32,
        "--sampler-batch-size",
    )
    cpu = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cpu"))
    assert memory.sampler_rows(cpu, SHAPE_3B, plenty)[0] == 64  # a CPU's runs keep their batches
    # the run's estimate counts the rows the reading gives
    capacity = estimate[128] / memory.MARGIN + 1
    assert memory.estimate(config, SHAPE_3B, capacity=capacity).total == pytest.approx(estimate[128])


# --- finished rows leave the stepped bucket ----------------------------------------------------------------------


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_finished_rows_leaving_the_bucket_sample_the_same(tiny, chat_prompts, params):
    model, tokenizer = tiny
    compact = HFSampler(model, tokenizer, decode="static")
    whole = HFSampler(model, tokenizer, decode="static", compact_rows=False)
    assert_same(compact.generate(chat_prompts, params), whole.generate(chat_prompts, params))
    assert compact.decode_steps == whole.decode_steps > 0
    assert compact.live_row_steps == whole.live_row_steps
    # 10 rows run in a bucket of 16 until they fit 8, 4, 2, 1; without compaction every step runs 16
    assert whole.stepped_row_steps == 16 * whole.decode_steps
    assert compact.live_row_steps <= compact.stepped_row_steps < whole.stepped_row_steps


# --- a call's shared prefixes prefilled once ---------------------------------------------------------------------


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_shared_prefixes_prefilled_once_sample_what_separate_prefills_sample(tiny, group_prompts, params, decode):
    model, tokenizer = tiny
    shared = HFSampler(model, tokenizer, decode=decode)
    apart = HFSampler(model, tokenizer, decode=decode, share_prefixes=False)
    assert_same(shared.generate(group_prompts, params), apart.generate(group_prompts, params))
    assert apart.prefilled_tokens == sum(len(p) for p in group_prompts) and apart.shared_saved_tokens == 0
    # each group's second row and every question's instructions beyond the first were not prefilled again
    assert shared.shared_saved_tokens == apart.prefilled_tokens - shared.prefilled_tokens > len(group_prompts[0])
    counts = shared.lever_counts()
    assert counts["prefill_tokens_saved"] == shared.shared_saved_tokens
    assert counts["prefilled_tokens"] == shared.prefilled_tokens


def test_a_later_turn_saves_nothing_it_reused_from_an_earlier_call(tiny, group_prompts):
    """What a call reuses from kept sequences is not prefix sharing's: only the call's own repeats count."""
    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    sampler.generate(group_prompts[:1], params)
    assert sampler.shared_saved_tokens == 0
    saved = sampler.shared_saved_tokens
    sampler.generate(group_prompts[:1], params)  # all but its last token kept from the first call
    assert sampler.shared_saved_tokens == saved


# --- the prefill's attention -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager(tiny):
    model, tokenizer = tiny
    loaded = copy.deepcopy(model)
    loaded.set_attn_implementation("eager")
    return loaded, tokenizer


def test_the_prefill_attention_is_chosen_and_said_once(tiny, eager, caplog):
    model, tokenizer = tiny
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_prefill_attention(model, cpu)[0] == "sdpa-grouped"
    assert choose_prefill_attention(model, cuda)[0] == "sdpa"  # a choice by the device's type: no GPU needed
    kind, why = choose_prefill_attention(eager[0], cuda)
    assert kind == "sdpa" and "eager" in why
    unsupported = copy.copy(eager[0])
    unsupported._supports_sdpa = False
    assert choose_prefill_attention(unsupported, cpu)[0] == "eager"
    with caplog.at_level(logging.INFO, logger="agents.samplers.hf"):
        HFSampler(eager[0], tokenizer)
        HFSampler(eager[0], tokenizer, sdpa_prefill=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sampler prefill attention:")]
    assert len(said) == 1 and said[0].startswith("sampler prefill attention: sdpa-grouped (")


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_sdpa_prefill_samples_what_eager_attention_samples(eager, chat_prompts, params, decode):
    model, tokenizer = eager
    sdpa = HFSampler(model, tokenizer, decode=decode)
    own = HFSampler(model, tokenizer, decode=decode, sdpa_prefill=False)
    assert (sdpa.prefill_attention, own.prefill_attention) == ("sdpa-grouped", "eager")
    assert_same(sdpa.generate(chat_prompts, params), own.generate(chat_prompts, params))
    assert model.config._attn_implementation == "eager"  # the switch lasted for the call only


def test_the_attention_switch_is_undone_after_an_exception(eager):
    model, _ = eager
    with pytest.raises(RuntimeError), sampling_attention(model, "sdpa-grouped"):
        assert model.config._attn_implementation != "eager"
        raise RuntimeError("a failing call")
    assert model.config._attn_implementation == "eager"
