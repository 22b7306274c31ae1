"""The transformers sampler's keys and values across calls: reuse equals a full re-encode, memory stays bounded.

Every test runs the same calls twice, on a sampler that keeps keys and values between calls and on one that
keeps nothing (`cache_tokens=0`, a full re-encode of every prompt), with the same seeds: the sampled tokens
must be identical and the log-probs within 1e-5 (CPU, float32). A tiny random model (real SmolLM2
tokenizer) does the sampling; the CoDA test acts in the real env over the real BM25 index.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import gymnasium as gym
import pytest
import torch

import envs  # noqa: F401  (registers the ids)
from agents.models import tiny_model
from agents.records import Completion, SamplingParams
from agents.samplers import HFSampler, SamplerWrapper, encode_chat
from agents.samplers.hf import MIN_SHARED_TOKENS
from agents.search_agents import CodaAgent
from envs.protocol import EXECUTOR_INSTRUCTIONS, PLANNER_INSTRUCTIONS

QUESTIONS = ["Who wrote Dune?", "Which river flows through the city that hosted the 1936 Olympics?", "Hi"]
TOLERANCE = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    return [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def observation(tokenizer, turn: int, row: int) -> list[int]:
    """An env-like observation and the next turn's header, different per row and turn."""
    text = f"\n<information>turn {turn}, row {row}: {'Paris ' * (turn + row)}</information>\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_same(cached: Sequence[Completion], full: Sequence[Completion]) -> None:
    for got, expected in zip(cached, full, strict=True):
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text and got.finish_reason == expected.finish_reason
        assert got.logprobs == pytest.approx(expected.logprobs, abs=TOLERANCE, rel=0)


def play_turns(model, tokenizer, prompts, turns: int, params: SamplingParams, **sampler_kwargs):
    """Grow each prompt over `turns` turns (completion + observation) on a cached and an uncached sampler."""
    cached = HFSampler(model, tokenizer, **sampler_kwargs)
    full = HFSampler(model, tokenizer, **{**sampler_kwargs, "cache_tokens": 0})
    contexts = [list(p) for p in prompts]
    for turn in range(turns):
        call = SamplingParams(**{**params.__dict__, "seed": turn, "max_new_tokens": params.max_new_tokens + turn})
        got, expected = cached.generate(contexts, call), full.generate(contexts, call)
        assert_same(got, expected)
        for row, completion in enumerate(expected):
            contexts[row] += list(completion.token_ids) + observation(tokenizer, turn, row)
    return cached, full, contexts


@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")  # the cache goes by its current name
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10, temperature=1.0),
        SamplingParams(max_new_tokens=10, temperature=0.0),
        SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9),
    ],
    ids=["t1", "greedy", "top_p"],
)
def test_later_turns_reuse_the_cache_and_equal_a_full_re_encode(tiny, prompts, params):
    cached, full, contexts = play_turns(*tiny, prompts, turns=4, params=params)
    assert cached.reused_tokens > cached.prefilled_tokens  # later turns prefill only what was appended
    assert cached.reused_tokens + cached.prefilled_tokens == full.prefilled_tokens
    assert full.reused_tokens == 0 and full.cached_tokens == 0 and full.cached_sequences == []
    # one kept sequence per context (the newest turn's replaced the older), each a prefix of its context
    assert len(cached.cached_sequences) == len(contexts)
    assert all(any(list(s) == c[: len(s)] for c in contexts) for s in cached.cached_sequences)


def test_rows_with_and_without_kept_prefixes_share_a_batch(tiny, prompts):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    cached = HFSampler(model, tokenizer)
    full = HFSampler(model, tokenizer, cache_tokens=0)
    first = cached.generate(prompts[:2], params)
    assert_same(first, full.generate(prompts[:2], params))
    other_question = encode_chat(tokenizer, [{"role": "user", "content": "Who directed Ed Wood?"}])
    batch = [
        prompts[0] + list(first[0].token_ids) + observation(tokenizer, 0, 0),  # extends a kept sequence
        prompts[2],  # nothing kept shares more than the chat template's first tokens
        other_question,  # shares the template's opening with kept sequences, then differs
        prompts[1] + list(first[1].token_ids)[:3],  # ends inside a kept sequence (an edited context)
        prompts[1],  # equals the start of a kept sequence: all but its last token reused
    ]
    reused = cached.reused_tokens
    assert_same(cached.generate(batch, params), full.generate(batch, params))
    assert cached.reused_tokens - reused >= len(batch[0]) - len(observation(tokenizer, 0, 0)) - 1


@pytest.mark.parametrize(
    "params", [SamplingParams(max_new_tokens=8, seed=2), SamplingParams(max_new_tokens=8, temperature=0.0)]
)
def test_prefixes_shared_within_a_call_are_prefilled_once(tiny, params):
    """A GRPO group's identical prompts and the instructions under every prompt: prefilled once, same samples."""
    model, tokenizer = tiny
    instructions = tokenizer("Answer the question by searching. " * 8, add_special_tokens=False)["input_ids"]
    assert len(instructions) >= MIN_SHARED_TOKENS
    x, y = (tokenizer(q, add_special_tokens=False)["input_ids"] for q in (" Who wrote Dune?", " Where is Paris?"))
    assert x[0] != y[0]
    prompts = [instructions + x, instructions + x, instructions + y]
    shared = HFSampler(model, tokenizer)
    full = HFSampler(model, tokenizer, cache_tokens=0)
    assert_same(shared.generate(prompts, params), full.generate(prompts, params))
    assert shared.shared_prefilled_tokens == len(prompts[0]) - 1  # the group's prompt but its last token, once
    # the group's rows feed one token each, the other row what follows the instructions
    assert shared.prefilled_tokens == len(prompts[0]) - 1 + 2 + len(prompts[2]) - len(instructions)
    assert shared.reused_tokens == 2 * (len(prompts[0]) - 1) + len(instructions)
    short = HFSampler(model, tokenizer)
    short.generate([instructions[: MIN_SHARED_TOKENS - 1] + x, instructions[: MIN_SHARED_TOKENS - 1] + y], params)
    assert short.shared_prefilled_tokens == 0 and short.reused_tokens == 0  # too short to be worth a pass


def test_left_truncated_contexts_equal_a_full_re_encode(tiny, prompts):
    model, tokenizer = tiny
    # a 64-token window: from the second turn on every context overflows and is cut from the left
    cached, _, contexts = play_turns(
        model, tokenizer, prompts, turns=4, params=SamplingParams(max_new_tokens=8), max_context=64
    )
    assert all(len(c) > 64 for c in contexts)
    assert cached.reused_tokens > 0  # a cut prompt reuses what it still shares with its kept sequence


def test_a_weight_update_drops_every_kept_sequence(prompts):
    model, tokenizer = tiny_model(seed=0)  # its own copy: this test changes the weights
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    cached = HFSampler(model, tokenizer)
    full = HFSampler(model, tokenizer, cache_tokens=0)
    first = cached.generate(prompts, params)
    assert cached.cached_tokens > 0
    nxt = [
        p + list(c.token_ids) + observation(tokenizer, 0, i)
        for i, (p, c) in enumerate(zip(prompts, first, strict=True))
    ]

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompts[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    reused = cached.reused_tokens
    assert_same(cached.generate(nxt, params), full.generate(nxt, params))  # the new weights' results
    assert cached.reused_tokens == reused, "keys and values of the old weights were reused"

    again = [p + list(c.token_ids) for p, c in zip(nxt, full.generate(nxt, params), strict=True)]
    model.load_state_dict(tiny_model(seed=3)[0].state_dict())
    reused = cached.reused_tokens
    assert_same(cached.generate(again, params), full.generate(again, params))
    assert cached.reused_tokens == reused


def test_memory_stays_within_the_token_budget(tiny, prompts):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    budget = len(prompts[1]) + 10  # room for about one context
    sampler = HFSampler(model, tokenizer, cache_tokens=budget)
    full = HFSampler(model, tokenizer, cache_tokens=0)
    for _ in range(3):
        for prompt in prompts:  # one context per call: each call's sequence evicts the older
            assert_same(sampler.generate([prompt], params), full.generate([prompt], params))
            assert sampler.cached_tokens <= budget
            kept = sampler.cached_sequences
            assert len(kept) <= 1 and all(list(s[: len(prompt)]) == prompt for s in kept)
    too_long = prompts[1] * 3
    assert_same(sampler.generate([too_long], params), full.generate([too_long], params))
    assert sampler.cached_tokens <= budget  # a sequence longer than the budget is not kept at all
    assert HFSampler(model, tokenizer, cache_tokens=0).cached_tokens == 0


def test_release_forgets_a_closed_context_and_keeps_others(tiny, prompts):
    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)
    completions = sampler.generate(prompts, params)
    closed = prompts[0] + list(completions[0].token_ids) + observation(tokenizer, 0, 0)
    sampler.release(closed)
    kept = sampler.cached_sequences
    assert len(kept) == 2 and not any(closed[: len(s)] == list(s) for s in kept)  # the others share its opening
    sampler.release([])
    sampler.clear_cache()
    assert sampler.cached_sequences == [] and sampler.cached_tokens == 0


# --- the CoDA agent: executor contexts released when they close, the planner's kept while it waits ---------


class ScriptedSampler(SamplerWrapper):
    """Appends a scripted tool call to the model's own text (as `tests/test_agents.py` does) and records each
    call's prompts, completions and the sequences the sampler kept before the call; `release` passes through."""

    def __init__(self, inner: HFSampler) -> None:
        super().__init__(inner)
        self.calls: list[tuple[list[list[int]], list[Completion], list[tuple[int, ...]]]] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        kept = self.inner.cached_sequences
        completions = [self._scripted(p, c) for p, c in zip(prompts, self.inner.generate(prompts, params), strict=True)]
        self.calls.append(([list(p) for p in prompts], completions, kept))
        return completions

    def _scripted(self, prompt: Sequence[int], completion: Completion) -> Completion:
        text = self.tokenizer.decode(prompt)
        if EXECUTOR_INSTRUCTIONS in text:
            searched = text.count("<information>") - EXECUTOR_INSTRUCTIONS.count("<information>")
            call = "<search>Scott Derrickson</search>" if searched < 1 else "<answer>American</answer>"
        else:
            done = text.count("<result>") - PLANNER_INSTRUCTIONS.count("<result>")
            call = f"<task>sub-question {done + 1}</task>" if done < 2 else "<answer>yes</answer>"
        ids = self.tokenizer(call, add_special_tokens=False)["input_ids"]
        return Completion(
            completion.text + call, completion.token_ids + tuple(ids), completion.logprobs + (0.0,) * len(ids), "stop"
        )


def coda_rollout(tiny, bm25, **sampler_kwargs):
    model, tokenizer = tiny
    sampler = ScriptedSampler(HFSampler(model, tokenizer, max_context=2048, **sampler_kwargs))
    env_list = [
        gym.make("RedCoda-HotpotQA-CoDA-v0", split="dev", max_passage_words=30, retriever=bm25) for _ in range(3)
    ]
    agent = CodaAgent(sampler, SamplingParams(max_new_tokens=10, temperature=1.0))
    return sampler, agent.rollout(env_list, [0, 0, 5], group_ids=[0, 0, 1], seed=11)


def test_coda_rollout_with_kept_contexts_equals_a_full_re_encode(tiny, bm25):
    sampler, trajectories = coda_rollout(tiny, bm25)
    full_sampler, full = coda_rollout(tiny, bm25, cache_tokens=0)
    for got, expected in zip(trajectories, full, strict=True):
        assert got.actions == expected.actions and got.reward == expected.reward
        for g, e in zip(got.generations, expected.generations, strict=True):
            assert g.role == e.role and g.token_ids == e.token_ids and g.loss_mask == e.loss_mask
            assert g.sample_logprobs == pytest.approx(e.sample_logprobs, abs=TOLERANCE, rel=0)
    assert sampler.inner.reused_tokens > 0 and full_sampler.inner.reused_tokens == 0
    # the group's two identical first prompts and every context's instructions are prefilled once for all rows
    assert sampler.inner.shared_prefilled_tokens > 0 and full_sampler.inner.shared_prefilled_tokens == 0
    inner, full_inner = sampler.inner, full_sampler.inner
    assert inner.reused_tokens + inner.prefilled_tokens - inner.shared_prefilled_tokens == full_inner.prefilled_tokens
    assert inner.prefilled_tokens < full_inner.prefilled_tokens
    assert sampler.inner.cached_tokens == 0, "every context was released when its episode ended"

    executors = [g for t in trajectories for g in t.generations if g.role == "executor"]
    planners = [g for t in trajectories for g in t.generations if g.role == "planner"]
    assert len(executors) == 6 and len(planners) == 3
    for executor in executors:
        ids = list(executor.token_ids)
        last = max(  # the call that sampled the executor's answer; its context closed right after it
            k
            for k, (prompts, completions, _) in enumerate(sampler.calls)
            for p, c in zip(prompts, completions, strict=True)
            if p + list(c.token_ids) == ids
        )
        for _, _, kept in sampler.calls[last + 1 :]:
            assert not any(ids[: len(s)] == list(s) for s in kept), "a closed executor's cache was kept"
    resumed = 0
    for planner in planners:
        ids = list(planner.token_ids)
        turns: dict[int, list[int]] = {}  # call -> this planner's prompt in it (the longest prefix of its context)
        for k, (prompts, _, _) in enumerate(sampler.calls):
            for p in prompts:
                if ids[: len(p)] == p and len(p) > len(turns.get(k, [])):
                    turns[k] = p
        turns = sorted(turns.items())
        for (k0, previous), (k1, prompt) in pairwise(turns):
            assert k1 > k0 + 1, "the planner waited while its executor worked"
            kept = sampler.calls[k1][2]
            assert any(prompt[: len(s)] == list(s) and len(s) >= len(previous) for s in kept)
            resumed += 1
    assert resumed == 6


@pytest.mark.slow
def test_smollm2_later_turns_equal_a_full_re_encode():
    """The real SmolLM2-135M-Instruct (30 layers): reuse stays within float32 rounding of a full re-encode.

    Its log-probs move by up to about 1.5e-5 whenever the computation's shapes change at all (the same
    rows re-encoded in another batch composition differ from each other by as much), so this test allows
    1e-5 plus 1e-5 relative, and the tokens must still be identical.
    """
    from agents.models import load_model

    model, tokenizer = load_model()
    questions = [*QUESTIONS, "Name the author of The Left Hand of Darkness and one of her other novels."]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    cached = HFSampler(model, tokenizer)
    full = HFSampler(model, tokenizer, cache_tokens=0)
    contexts = [list(p) for p in prompts]
    for turn in range(3):
        params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=turn)
        got, expected = cached.generate(contexts, params), full.generate(contexts, params)
        for g, e in zip(got, expected, strict=True):
            assert g.token_ids == e.token_ids
            assert g.logprobs == pytest.approx(e.logprobs, abs=TOLERANCE, rel=TOLERANCE)
        for row, completion in enumerate(expected):
            contexts[row] += list(completion.token_ids) + observation(tokenizer, turn, row)
    assert cached.reused_tokens > cached.prefilled_tokens


def grown_contexts(tokenizer, prompts, turn: int) -> list[list[int]]:
    """Rows of very different prefill lengths: each prompt, then a short or a long observation."""
    return [
        [*prompt, *observation(tokenizer, turn, row), *tokenizer(" Berlin" * (40 * (row % 2)))["input_ids"]]
        for row, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_new_tokens=8, temperature=0.0), SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)],
    ids=["greedy", "t1"],
)
def test_a_batch_prefilled_in_groups_samples_what_one_padded_prefill_samples(tiny, prompts, params, monkeypatch):
    """Short and long rows, some over kept pasts and some not: prefilled in groups, each padded to its own widest
    row, they sample what one padded prefill samples (the same tokens, log-probs within rounding)."""
    from agents.samplers import hf, prefill

    model, tokenizer = tiny
    monkeypatch.setattr(prefill, "PREFILL_SPLIT_TOKENS", 0)  # any padded token saved is worth a group
    monkeypatch.setattr(prefill, "PREFILL_SPLIT_ROWS", 2)
    grouped, padded = HFSampler(model, tokenizer), HFSampler(model, tokenizer)
    monkeypatch.setattr(padded, "_prefill_groups", lambda lengths: [list(range(len(lengths)))])
    splits = []
    apart = hf.prefill_apart  # only the grouped sampler calls it: the padded one prefills one group
    monkeypatch.setattr(hf, "prefill_apart", lambda m, groups, *a: splits.append(len(groups)) or apart(m, groups, *a))
    contexts = [list(p) for p in prompts * 2]
    for turn in range(3):
        got, expected = grouped.generate(contexts, params), padded.generate(contexts, params)
        assert_same(got, expected)
        kept = [[*c, *e.token_ids] for c, e in zip(contexts, expected, strict=True)]
        contexts = grown_contexts(tokenizer, kept[:4], turn) + [list(p) for p in prompts]  # two rows start afresh
    assert grouped.reused_tokens == padded.reused_tokens > 0
    assert splits and max(splits) >= 2


def test_a_prefill_group_attends_over_its_own_columns_only(tiny, prompts, monkeypatch):
    """Rows over a long kept past share a batch with rows that reuse nothing: the group of the fresh rows runs its
    forward pass over its own tokens' columns alone, not over the others' past (masked padding for it), and the
    batch samples what one padded prefill samples."""
    from agents.samplers import prefill

    model, tokenizer = tiny
    monkeypatch.setattr(prefill, "PREFILL_SPLIT_TOKENS", 0)
    monkeypatch.setattr(prefill, "PREFILL_SPLIT_ROWS", 2)
    grouped, padded = HFSampler(model, tokenizer), HFSampler(model, tokenizer)
    monkeypatch.setattr(padded, "_prefill_groups", lambda lengths: [list(range(len(lengths)))])
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    kept = [list(p) for p in prompts[:2]]
    for sampler in (grouped, padded):
        sampler.generate(kept, params)
    contexts = [[*kept[0], 5], [*kept[1], 6, 7], [900 + i for i in range(30)], [950 + i for i in range(25)]]
    columns: list[tuple[int, int]] = []  # (tokens fed, mask columns) of each forward pass
    forward = model.forward

    def spy(*args, **kwargs):
        if kwargs.get("input_ids") is not None and kwargs.get("attention_mask") is not None:
            columns.append((kwargs["input_ids"].shape[1], kwargs["attention_mask"].shape[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    got = grouped.generate(contexts, params)
    assert (30, 30) in columns and (25, 25) in columns  # each fresh row: its own columns, none of the past
    assert any(fed <= 2 and width - fed >= min(len(k) for k in kept) for fed, width in columns)  # past and new
    monkeypatch.setattr(model, "forward", forward)
    assert_same(got, padded.generate(contexts, params))
    assert grouped.reused_tokens == padded.reused_tokens > 0


def test_prefill_groups_minimise_the_padded_tokens_plus_a_price_per_group():
    from agents.samplers.prefill import PREFILL_SPLIT_ROWS, PREFILL_SPLIT_TOKENS, prefill_groups

    many = PREFILL_SPLIT_ROWS // 2  # rows of each length
    split = prefill_groups([10, 400] * many)
    assert split == [list(range(1, 2 * many, 2)), list(range(0, 2 * many, 2))]  # saves many x 390 > the price
    assert prefill_groups([10, 12, 11] * many) == [list(range(3 * many))]  # a few tokens: not worth a pass
    price = PREFILL_SPLIT_TOKENS // many
    assert prefill_groups([price, price + 1] * many) == [list(range(2 * many))]  # would save `many` tokens
    few = [10, 400] * (PREFILL_SPLIT_ROWS // 2)
    assert prefill_groups(few[: PREFILL_SPLIT_ROWS - 1]) == [list(range(PREFILL_SPLIT_ROWS - 1))]  # too few rows
    assert prefill_groups([5]) == [[0]]


def test_rows_leaving_a_batch_are_replaced_by_its_last_rows_only_where_order_is_free(tiny):
    from transformers import DynamicCache

    from agents.samplers import decode_steps
    from agents.samplers.kv_cache import AppendLayer

    model, _ = tiny
    for reorder, order in ((True, [0, 4, 2, 5]), (False, [0, 2, 4, 5])):
        cache = DynamicCache(config=model.config)
        cache.layers = [AppendLayer(9) for _ in cache.layers]
        rows = [torch.randn(len(cache.layers), 2, 7, 4) for _ in range(6)]  # (layers, kv_heads, columns, dim)
        keys, values = AppendLayer.allocate_all(cache.layers, rows[0], 6, 7)
        for b, row in enumerate(rows):
            keys[:, b], values[:, b] = row, -row
        got = decode_steps.CacheSteps(model, cache).select([0, 2, 4, 5], 7, reorder)
        assert got == order
        for place, b in enumerate(order):
            for row_keys, layer in zip(rows[b], cache.layers, strict=True):
                assert torch.equal(layer.keys[place], row_keys) and torch.equal(layer.values[place], -row_keys)
        assert all(layer.keys.shape == (4, 2, 7, 4) for layer in cache.layers)


def test_greedy_rows_that_leave_at_different_steps_equal_each_row_alone(tiny, prompts):
    """Greedy rows stop at different steps (stop strings), so later rows move into their places."""
    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, stop=("a", "e"))
    rows = [list(p) for p in prompts * 3]
    batched = sampler.generate(rows, greedy)
    assert len({len(c.token_ids) for c in batched}) >= 2
    for row, completion in zip(rows, batched, strict=True):
        [alone] = HFSampler(model, tokenizer, cache_tokens=0).generate([row], greedy)
        assert completion.token_ids == alone.token_ids
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=TOLERANCE, rel=0)


def test_grouped_attention_is_the_same_numbers_and_is_undone(tiny, prompts):
    """A padded prefill over a kept past: logits with the key/value groups given to SDPA equal those with the
    heads copied, to the bit; the model's attention setting is back afterwards, also after an exception."""
    from transformers import DynamicCache

    from agents.models import cache_argument
    from agents.samplers.kv_cache import GROUPED_SDPA, grouped_attention

    model, _ = tiny
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < 4
    ids = torch.randint(10, 1000, (3, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(3, 20, dtype=torch.long)
    attention[0, :5] = attention[1, 8:11] = 0  # padding in the past and in the fresh part

    def logits() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :8], **{cache_argument(): cache}, use_cache=True)
            positions = torch.arange(8, 20).expand(3, -1)
            return model(
                input_ids=ids, attention_mask=attention, position_ids=positions, **{cache_argument(): cache}
            ).logits

    plain = logits()
    with grouped_attention(model):
        assert model.config._attn_implementation == GROUPED_SDPA
        grouped = logits()
    assert torch.equal(grouped, plain)
    with pytest.raises(RuntimeError), grouped_attention(model):
        raise RuntimeError("a failing call")
    assert model.config._attn_implementation == "sdpa"
