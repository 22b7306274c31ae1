"""Qwen2-architecture policies (Qwen2.5's: the Search-R1 and CoDA papers train Qwen2.5-3B) through the sampler and the
trainer, on a tiny random Qwen2 over the real SmolLM2 tokenizer.

Qwen2's decoder layer is Llama's with biases on the q, k and v projections, and an optional sliding window. The static
decode step (`agents.samplers.static_decode`) computes it; the sampling comparisons of static and dynamic decoding run
on Qwen2 in `tests/test_static_decode.py` (parametrised with Llama). Here: what `supports` accepts and refuses, the
same comparisons for the other layers the step reads biases of (a Llama with `attention_bias` and `mlp_bias`) and for
Mistral, each path's logits against a float64 reference with the tiny Qwen2's real (non-zero) biases, and a real
training run of `python -m algos.red_grpo` on a Qwen2 policy loaded from a local Hugging Face directory.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from agents.models import load_model, tiny_model
from agents.records import SamplingParams
from agents.samplers import HFSampler, encode_chat
from agents.samplers.static_decode import StaticDecoder, supports

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5  # as tests/test_static_decode.py: float32, the attention summing in another order
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "tie_word_embeddings": True,
}
"""`tiny_model`'s shape, for the architectures it does not build."""


@pytest.fixture(scope="module")
def qwen2():
    """(model, tokenizer): a tiny Qwen2 with non-zero q, k and v biases."""
    return tiny_model(seed=0, architecture="qwen2")


def _random(config_cls: type, model_cls: type, tokenizer, **settings) -> torch.nn.Module:
    """A seeded random model of `tiny_model`'s shape over `tokenizer`, every bias drawn like the weights."""
    config = config_cls(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **{**SHAPE, **settings})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.2)
    return model.eval()


def _prompts(tokenizer) -> list[list[int]]:
    questions = ["Who wrote Dune?", "Which river flows through Berlin?", "Hi", "Is Paris in France?", "Name a planet."]
    return [encode_chat(tokenizer, [{"role": "user", "content": f"{q} ({i})"}]) for i, q in enumerate(questions * 2)]


def test_the_tiny_qwen2_has_qwen2s_layer_and_biases_that_matter(qwen2):
    model, tokenizer = qwen2
    assert model.config.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.layer_types == ["full_attention"] * 2 and model.config.tie_word_embeddings
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert linear.bias is not None and linear.bias.abs().min() > 0
    assert attn.o_proj.bias is mlp.gate_proj.bias is mlp.down_proj.bias is None
    llama, _ = tiny_model(seed=0)
    assert all(m.bias is None for m in llama.modules() if isinstance(m, torch.nn.Linear))
    # the biases change the logits: a decode step that dropped them would not sample what the model samples
    ids = torch.tensor([_prompts(tokenizer)[0]])
    with torch.no_grad():
        logits = model(ids).logits
        unbiased = tiny_model(seed=0, architecture="qwen2")[0]
        for layer in unbiased.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.zero_()
        assert (unbiased(ids).logits - logits).abs().max() > 0.1


def test_supports_qwen2_and_refuses_what_the_step_does_not_compute(qwen2):
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    model, tokenizer = qwen2
    assert supports(model)
    assert HFSampler(model, tokenizer, decode="auto").decode == "static"
    # a window on the last layer (Qwen2 slides from layer max_window_layers on): the step attends over everything
    sliding = _random(
        Qwen2Config, Qwen2ForCausalLM, tokenizer, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    assert sliding.config.layer_types == ["full_attention", "sliding_attention"]
    assert not supports(sliding)
    with pytest.raises(ValueError, match=r"layers \[1\] use sliding-window attention \(window 16\)"):
        StaticDecoder(sliding, graphs=False)
    assert HFSampler(sliding, tokenizer, decode="auto").decode == "dynamic"
    # the window switched on but reaching no layer (max_window_layers >= layers, Qwen2's default 28): full attention
    unwindowed = _random(
        Qwen2Config, Qwen2ForCausalLM, tokenizer, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert unwindowed.config.layer_types == ["full_attention"] * 2 and supports(unwindowed)
    # Qwen3's layer normalises queries and keys: refused by name, and by its parameters when a model type hides it
    qwen3 = _random(Qwen3Config, Qwen3ForCausalLM, tokenizer, head_dim=16)
    assert not supports(qwen3)
    with pytest.raises(ValueError, match="Llama-architecture .* not 'qwen3'"):
        StaticDecoder(qwen3, graphs=False)
    normed = _random(Qwen2Config, Qwen2ForCausalLM, tokenizer)
    normed.model.layers[1].self_attn.q_norm = Qwen2RMSNorm(16)
    assert not supports(normed)
    with pytest.raises(ValueError, match=r"parameters the static step does not apply: self_attn\.q_norm\.weight"):
        StaticDecoder(normed, graphs=False)
    # Mistral's layer is Llama's; its default config slides a 4,096-token window over every layer
    assert supports(_random(MistralConfig, MistralForCausalLM, tokenizer, sliding_window=None))
    assert not supports(_random(MistralConfig, MistralForCausalLM, tokenizer))


def _same_samples(model: torch.nn.Module, tokenizer, narrow_rows: int) -> None:
    """Static and dynamic decoding of `model` sample the same tokens, log-probs within `TOLERANCE`, over two turns."""
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop=("k",))
    dynamic = HFSampler(model, tokenizer, narrow_rows=narrow_rows)
    static = HFSampler(model, tokenizer, decode="static", narrow_rows=narrow_rows)
    contexts = _prompts(tokenizer)
    for turn in range(2):  # the second turn reuses the keys and values each sampler kept
        expected = dynamic.generate(contexts, params)
        got = static.generate(contexts, params)
        for a, b in zip(got, expected, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=TOLERANCE, rel=TOLERANCE)
        suffix = tokenizer(f" turn {turn}.")["input_ids"]
        contexts = [c + [*e.token_ids, *suffix] for c, e in zip(contexts, expected, strict=True)]
    assert len({len(c.token_ids) for c in expected}) > 1  # rows ended at different steps
    assert static.reused_tokens == dynamic.reused_tokens > 0


@pytest.mark.parametrize("narrow_rows", [0, 16], ids=["f_linear", "narrow"])
@pytest.mark.parametrize("architecture", ["llama-biases", "mistral"])
def test_other_llama_like_layers_sample_what_the_dynamic_cache_samples(qwen2, architecture, narrow_rows):
    """Biases on every linear layer of a Llama (`attention_bias`, `mlp_bias`: o, gate, up and down as well as q, k
    and v), and Mistral's layer without a window, through the static step; with the CPU's few-row products too."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    _, tokenizer = qwen2
    if architecture == "mistral":
        model = _random(MistralConfig, MistralForCausalLM, tokenizer, sliding_window=None)
    else:
        model = _random(LlamaConfig, LlamaForCausalLM, tokenizer, attention_bias=True, mlp_bias=True)
        assert model.model.layers[0].mlp.up_proj.bias is not None
    assert supports(model)
    _same_samples(model, tokenizer, narrow_rows)


def test_every_decode_path_of_a_qwen2_is_within_rounding_of_a_float64_reference(qwen2):
    """`decode_parity.logit_errors` on the tiny Qwen2's weights (non-zero biases)."""
    from decode_parity import logit_errors

    model, _ = qwen2
    errors = logit_errors(model, rows=3, steps=4, prompt_tokens=40)
    assert {"dynamic", "static", "static, sdpa math"} <= set(errors)
    assert max(errors.values()) < 1e-4


def test_the_trainer_trains_a_qwen2_policy_from_a_local_directory(tmp_path):
    """`python -m algos.red_grpo --preset tiny` on a Qwen2 saved with `save_pretrained`, sampling with static decode
    steps: every parameter moves (the q, k and v biases too), metrics are logged, final/ loads as a Qwen2."""
    from algos import red_grpo

    model, tokenizer = tiny_model(seed=0, architecture="qwen2", max_context=1024)
    source = tmp_path / "qwen2"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    run_dir = tmp_path / "run"
    summary = red_grpo.main(
        ["--preset", "tiny", "--model", str(source), "--steps", "2", "--eval-questions", "0"]
        + ["--sampler-decode", "static", "--run-dir", str(run_dir)]
    )
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["total_loss"]) and row["tokens/sampled"] > 0 for row in rows)
    final, _ = load_model(summary["final_model"], device="cpu")
    assert json.loads((run_dir / "final" / "config.json").read_text())["model_type"] == "qwen2"
    assert type(final).__name__ == "Qwen2ForCausalLM" and supports(final)
    start = dict(model.named_parameters())
    trained = dict(final.named_parameters())
    assert trained.keys() == start.keys()
    # weight decay is 0 in the tiny preset: every change is a gradient step
    assert [name for name in start if torch.equal(start[name], trained[name])] == []
