"""Static key/value buffers for the decode steps (`decode="static"`, and "graphs" on a GPU): same samples.

Every comparison runs the same calls on a sampler with the dynamic cache and one with static buffers, with the
same seeds: the sampled tokens must be identical and the log-probs within 1e-5, absolute or relative (CPU,
float32; the attention sums in another order). The sampling comparisons run on a tiny Llama and on a tiny Qwen2
(biases on q, k and v; `tests/test_qwen2.py` has the rest of Qwen2's). Rows end at different steps (the stop
string "k", which about one random token in twenty holds), so finished rows leave their slots and the live ones
are gathered into smaller row buckets; later turns reuse the keys and values the static path kept. Under bfloat16
autocast, where CPU kernels round differently, each path is held to a float64 reference fed the same tokens, within
the bound bfloat16's rounding allows.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from agents.models import tiny_model
from agents.records import SamplingParams
from agents.samplers import HFSampler, encode_chat
from agents.samplers.static_decode import (
    COLUMN_BUCKET,
    StaticDecoder,
    choose_decode,
    column_bucket,
    narrow_linear,
    row_bucket,
    supports,
)

QUESTIONS = [
    "Who wrote Dune?",
    "Which river flows through the city that hosted the 1936 Olympics?",
    "Hi",
    "Is Paris the capital of France?",
    "Name a planet.",
]
TOLERANCE = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tiny):
    """(model, tokenizer): the shared tiny Llama, or a tiny Qwen2 of the same shape with non-zero q, k, v biases."""
    return tiny if request.param == "llama" else tiny_model(seed=0, architecture="qwen2")


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    return [encode_chat(tokenizer, [{"role": "user", "content": f"{q} ({i})"}]) for i, q in enumerate(QUESTIONS * 2)]


def assert_same(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOLERANCE, rel=TOLERANCE)


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]
    assert column_bucket(1) == COLUMN_BUCKET and column_bucket(COLUMN_BUCKET + 1) == 2 * COLUMN_BUCKET


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=32, temperature=1.0, seed=1, stop=("k",)),
        SamplingParams(max_new_tokens=32, temperature=0.0, stop=("k",)),
        SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=2, stop=("k",)),
        SamplingParams(max_new_tokens=32, temperature=1.0, row_seeds=tuple(range(10)), stop=("k",)),
    ],
    ids=["t1", "greedy", "top_p", "row_seeds"],
)
def test_static_steps_sample_what_the_dynamic_cache_samples(policy, prompts, params):
    model, tokenizer = policy
    dynamic = HFSampler(model, tokenizer)
    static = HFSampler(model, tokenizer, decode="static")
    contexts = [list(p) for p in prompts]
    lengths = set()
    for turn in range(3):  # later turns extend the contexts: both samplers reuse what they kept
        call = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + turn})
        expected = dynamic.generate(contexts, call)
        assert_same(static.generate(contexts, call), expected)
        lengths |= {len(c.token_ids) for c in expected}
        for row, completion in enumerate(expected):
            contexts[row] += [*completion.token_ids, *tokenizer(f" turn {turn} row {row}.")["input_ids"]]
    assert len(lengths) >= 4  # rows left the batch at many steps: slots were freed and gathered
    assert static.reused_tokens == dynamic.reused_tokens > 0
    assert static.cached_sequences == dynamic.cached_sequences


def test_prefixes_shared_within_a_call_are_reused_by_static_steps(policy):
    model, tokenizer = policy
    instructions = tokenizer("Answer the question by searching. " * 8, add_special_tokens=False)["input_ids"]
    x, y = (tokenizer(q, add_special_tokens=False)["input_ids"] for q in (" Who wrote Dune?", " Where is Paris?"))
    prompts = [instructions + x, instructions + x, instructions + y]
    params = SamplingParams(max_new_tokens=12, seed=4, stop=("k",))
    dynamic, static = HFSampler(model, tokenizer), HFSampler(model, tokenizer, decode="static")
    assert_same(static.generate(prompts, params), dynamic.generate(prompts, params))
    assert static.shared_prefilled_tokens == dynamic.shared_prefilled_tokens > 0


def test_the_buffers_persist_across_calls_and_grow_only_when_needed(tiny, prompts):
    model, tokenizer = tiny
    sampler = HFSampler(model, tokenizer, decode="static", cache_tokens=0)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    sampler.generate(prompts[:3], params)
    decoder = sampler._static
    first = decoder.keys[0]
    assert first.shape[0] == 4 and first.shape[2] == COLUMN_BUCKET  # 3 rows -> 4 slots; columns in one bucket
    sampler.generate(prompts[:2], params)
    assert decoder.keys[0] is first  # fewer rows: the same buffers
    sampler.generate(prompts[:8], params)
    assert decoder.keys[0].shape[0] == 8 and decoder.keys[0] is not first
    long_prompt = prompts[0] + tokenizer(" word" * COLUMN_BUCKET)["input_ids"]
    sampler.generate([long_prompt], params)
    assert decoder.keys[0].shape[:3:2] == (8, 2 * COLUMN_BUCKET)
    with torch.no_grad():  # an in-place update (an optimizer step) keeps the buffers
        next(model.parameters()).add_(0.0)
    sampler.generate(prompts[:1], params)
    assert decoder.keys[0].shape[0] == 8


def test_static_decoding_refuses_what_it_cannot_do(tiny):
    model, tokenizer = tiny
    assert supports(model)
    with pytest.raises(ValueError, match="CUDA device"):
        HFSampler(model, tokenizer, decode="graphs")
    with pytest.raises(ValueError, match="decode must be"):
        HFSampler(model, tokenizer, decode="compiled")  # type: ignore[arg-type]
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer)))
    assert not supports(other)
    with pytest.raises(ValueError, match="Llama-architecture"):
        StaticDecoder(other, graphs=False)


def test_narrow_linear_is_f_linear():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 16, generator=generator), torch.randn(48, generator=generator)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 16, generator=generator)
        for b in (None, bias):
            assert torch.allclose(narrow_linear(x, weight, b), torch.nn.functional.linear(x, weight, b), atol=1e-5)


@pytest.mark.parametrize("narrow_rows", [0, 16], ids=["f_linear", "narrow"])
def test_few_row_products_on_a_cpu_sample_the_same(policy, prompts, narrow_rows):
    """On a CPU the static steps compute products of at most `narrow_rows` rows as W @ x^T (faster there): the
    samples are the dynamic cache's either way (16 rows covers every bucket here; 0 none)."""
    model, tokenizer = policy
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=("k",))
    expected = HFSampler(model, tokenizer, narrow_rows=0).generate(prompts, params)
    static = HFSampler(model, tokenizer, decode="static", narrow_rows=narrow_rows)
    assert_same(static.generate(prompts, params), expected)
    assert static._static.narrow_rows == narrow_rows


def test_auto_decode_is_static_on_a_cpu_where_the_model_allows():
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny_model(seed=0)
    assert HFSampler(model, tokenizer, decode="auto").decode == "static"
    policy = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
    assert HFSampler(policy, tokenizer, decode="auto").decode == "dynamic"  # LoRA wrappers: the model's forward


def test_auto_decode_chooses_graphs_for_cuda_where_the_model_allows():
    """The function behind ``decode="auto"`` reads the device's type only, so a CPU asks it what a GPU would run:
    CUDA graphs for plain Llama and Qwen2 layers, the dynamic cache for LoRA-wrapped layers or a cache that is not
    plain keys and values, each with a reason."""
    from peft import LoraConfig, get_peft_model

    cuda = torch.device("cuda")
    for architecture in ("llama", "qwen2"):
        model, _ = tiny_model(seed=0, architecture=architecture)
        assert choose_decode(model, cuda)[0] == "graphs"
        assert choose_decode(model, torch.device("cpu"))[0] == "static"
        assert choose_decode(model, cuda, plain=False) == (
            "dynamic",
            "its cache is not plain per-layer keys and values",
        )
    policy = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
    decode, why = choose_decode(policy, cuda)
    assert decode == "dynamic" and "LoRA" in why


def test_auto_decode_says_its_choice_once(caplog):
    model, tokenizer = tiny_model(seed=0)
    with caplog.at_level(logging.INFO, logger="agents.samplers.hf"):
        HFSampler(model, tokenizer, decode="auto")
        HFSampler(model, tokenizer, decode="static")
    said = [r.getMessage() for r in caplog.records if r.name == "agents.samplers.hf"]
    decode = [line for line in said if line.startswith("sampler decode:")]
    assert decode == ["sampler decode: static (static key/value buffers without graphs on cpu)"]


@pytest.mark.gpu
def test_auto_decode_replays_cuda_graphs_on_a_gpu(prompts):
    model, tokenizer = tiny_model(seed=0, architecture="qwen2")
    sampler = HFSampler(model.cuda(), tokenizer, decode="auto")
    assert sampler.decode == "graphs"
    sampler.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert sampler._static.graphs and sampler._static.captured >= 1


def test_static_decoding_refuses_wrapped_linear_layers():
    """The step reads plain weights: with LoRA adapters injected (the trainer's `--lora`) it would sample from the
    base model without them, so it refuses, and says why."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny_model(seed=0)
    policy = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
    assert not supports(policy)
    with pytest.raises(ValueError, match="wrapped .*LoRA"):
        HFSampler(policy, tokenizer, decode="static")


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_cuda_graphs_sample_what_the_dynamic_cache_samples(prompts, architecture):
    model, tokenizer = tiny_model(seed=0, architecture=architecture)
    model = model.cuda()
    params = SamplingParams(max_new_tokens=32, temperature=0.0, stop=("k",))
    graphs = HFSampler(model, tokenizer, decode="graphs")
    expected = HFSampler(model, tokenizer).generate(prompts, params)
    got = graphs.generate(prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4, rel=0)
    assert graphs._static.graphs and graphs._static.captured >= 1
    captured = graphs._static.captured
    assert [c.token_ids for c in graphs.generate(prompts, params)] == [c.token_ids for c in expected]
    assert graphs._static.captured == captured  # the second call replays the graphs it captured


def _perturb(model: torch.nn.Module) -> None:
    """A large in-place change of every matrix and then of every bias (Qwen2's), the same tensors kept (as an optimizer
    step keeps them). Not a sign flip: negating every matrix of a Llama model gives the same logits (the norms and
    products cancel it)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(7)
    parameters = dict(model.named_parameters())
    matrices = [p for p in parameters.values() if p.ndim == 2]
    with torch.no_grad():
        for weight in matrices + [p for name, p in parameters.items() if name.endswith(".bias")]:
            noise = torch.randn(weight.shape, generator=generator, device=weight.device)
            weight.add_(noise * weight.std())


@pytest.mark.gpu
def test_cuda_graphs_follow_weights_updated_in_place_under_autocast(prompts):
    """Captured in one bf16 autocast context, replayed in another after an in-place weight update (as across training
    steps): the graphs read the decoder's bf16 copies of the weights, which each call refreshes, so they sample what
    static steps made after the update sample (the same kernels; the dynamic cache's attention kernel differs, and
    in bfloat16 a near-tie can part the rows). The update is noise, not a sign flip, which changes no logit."""
    model, tokenizer = tiny_model(seed=0)
    model = model.cuda()
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    graphs = HFSampler(model, tokenizer, decode="graphs")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        before = graphs.generate(prompts, params)
    captured = graphs._static.captured
    _perturb(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = HFSampler(model, tokenizer, decode="static").generate(prompts, params)
        got = graphs.generate(prompts, params)
    assert graphs._static.captured == captured  # replayed, not recaptured
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
    assert [c.token_ids for c in got] != [c.token_ids for c in before]  # the update changed what is sampled


BF16_UNIT_ROUNDOFF = 2.0**-8
"""bfloat16 keeps 8 significant bits: rounding to nearest errs by at most this share of the value."""


def _bf16_roundings(model: torch.nn.Module) -> int:
    """The bfloat16 roundings a logit passes through under CPU autocast, counted along the model's longest path.

    Each product rounds its input, its weight and its output (3); a decoder layer chains six products (q/k/v, the
    attention's scores and its weighted values, the output projection, gate/up, down) and the activation (1); the
    LM head adds one product. First order, relative errors along a chain add, so a logit errs by at most this many
    unit roundoffs of the largest logit (a bound with no cancellation assumed: loose, and the same on every CPU).
    """
    return (6 * 3 + 1) * model.config.num_hidden_layers + 3


def _float64_logprobs(model64: torch.nn.Module, prompt: list[int], tokens: tuple[int, ...]) -> tuple[list, list, list]:
    """Teacher-forced float64 scores of `tokens` after `prompt`: each token's log-prob, the best log-prob at its
    position and the largest |logit| there."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # (tokens, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    return picked.tolist(), logp.max(dim=-1).values.tolist(), logits.abs().max(dim=-1).values.tolist()


def _assert_within_bf16_rounding(completions, prompts, model, stale=None) -> None:
    """Greedy bfloat16 completions scored against `model` in float64 with the same tokens fed: each log-prob within
    the bound bfloat16's rounding allows (`_bf16_roundings`; twice a logit's, a log-prob being a logit minus a
    log-sum-exp), and each greedy pick no further than that below the best token (a near-tie may go either way,
    differently on AVX2 and AVX-512 kernels). With `stale` (the weights before an update, in float64), each log-prob
    is nearer the updated model's than the stale one's: the samples come from the weights as they are now.
    """
    model64 = copy.deepcopy(model).double()
    roundings = _bf16_roundings(model)
    for prompt, completion in zip(prompts, completions, strict=True):
        reference, best, scale = _float64_logprobs(model64, prompt, completion.token_ids)
        before = _float64_logprobs(stale, prompt, completion.token_ids)[0] if stale is not None else None
        for i, got in enumerate(completion.logprobs):
            bound = 2 * roundings * BF16_UNIT_ROUNDOFF * scale[i]
            assert abs(got - reference[i]) <= bound, f"token {i}: log-prob {got} vs float64 {reference[i]} (> {bound})"
            assert best[i] - reference[i] <= 2 * bound, f"token {i}: not the greedy pick within bfloat16's rounding"
            if before is not None:
                assert abs(got - reference[i]) < abs(got - before[i]), f"token {i}: nearer the stale weights"


def test_under_autocast_the_buffers_hold_what_the_attention_reads(policy, prompts):
    """Under bfloat16 autocast the attention reads bfloat16 keys and values: the buffers hold them so, half the
    bytes a step reads, and the samples stay the dynamic cache's; kept rows go back as the dynamic cache keeps
    them, so a later call reuses them either way. The log-probs differ in bfloat16's rounding of the attention's
    sums, so both are held to a float64 reference within the bound that rounding allows, on any CPU."""
    model, tokenizer = policy
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop=("k",))
    dynamic, static = HFSampler(model, tokenizer), HFSampler(model, tokenizer, decode="static")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):  # the second call reuses the rows the first kept
            for completions in (dynamic.generate(prompts, params), static.generate(prompts, params)):
                _assert_within_bf16_rounding(completions, prompts, model)
    assert static._static.keys[0].dtype == static._static.values[0].dtype == torch.bfloat16
    kept = next(iter(static._store.entries.values()))
    like = next(iter(dynamic._store.entries.values()))
    assert (kept.keys[0].dtype, kept.values[0].dtype) == (like.keys[0].dtype, like.values[0].dtype)
    assert static.reused_tokens == dynamic.reused_tokens > 0


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_step_weights_follow_in_place_updates(prompts, autocast, architecture):
    """The static step reads its own stacked (and, under autocast, cast) copies of the weights, refreshed at each
    call: after an in-place update (an optimizer step) the next call samples what the updated model samples."""
    model, tokenizer = tiny_model(seed=3, architecture=architecture)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    static, dynamic = HFSampler(model, tokenizer, decode="static"), HFSampler(model, tokenizer)
    stale = copy.deepcopy(model).double()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        before = static.generate(prompts, params)
        _perturb(model)
        expected = dynamic.generate(prompts, params)
        got = static.generate(prompts, params)
    if autocast:  # bfloat16's rounding parts greedy rows at near-ties, differently per CPU: a float64 reference
        _assert_within_bf16_rounding(got, prompts, model, stale=stale)
    else:
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.token_ids for c in got] != [c.token_ids for c in before]
    copies = static._static._weights[0]
    assert copies.qkv.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert (copies.qkv_bias is None) == (architecture == "llama") and copies.gate_up_bias is None
    assert copies.qkv.shape[0] == sum(
        p.weight.shape[0]
        for p in (
            model.model.layers[0].self_attn.q_proj,
            model.model.layers[0].self_attn.k_proj,
            model.model.layers[0].self_attn.v_proj,
        )
    )


def test_every_decode_path_is_within_rounding_of_a_float64_reference(tiny):
    """`decode_parity.logit_errors`: the same tokens fed to every path, each step's logits near float64's."""
    from decode_parity import logit_errors

    model, _ = tiny
    errors = logit_errors(model, rows=3, steps=4, prompt_tokens=40)
    assert {"dynamic", "dynamic, reserved room", "static", "static, sdpa math"} <= set(errors)
    assert max(errors.values()) < 1e-4
