"""On CUDA, every decode path (dynamic cache, the sampler's cache layers, static steps, CUDA graphs) fed the same
tokens stays within float32 rounding of a float64 copy's logits (`decode_parity.logit_errors`).

    python -m pytest -m gpu tests/test_decode_parity_gpu.py -s     # -s prints each path's table

The tiny models run by default with `-m gpu`; the real SmolLM2-135M-Instruct at 64 rows of 600-1,041 tokens (the
throughput page's parity figure) is also marked `slow`. Without CUDA every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch
from decode_parity import logit_errors

from agents.models import load_model, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PATHS = {"dynamic", "dynamic, reserved room", "static", "graphs", "dynamic, sdpa math", "static, sdpa math"}


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_every_decode_path_of_a_tiny_model_on_cuda_is_within_rounding_of_float64(architecture):
    model, _ = tiny_model(seed=0, architecture=architecture)
    errors = logit_errors(model.cuda(), rows=8, steps=8, prompt_tokens=40)
    assert PATHS <= set(errors)
    assert max(errors.values()) < 1e-4


@pytest.mark.slow
def test_every_decode_path_of_smollm2_on_cuda_is_within_rounding_of_float64():
    model, _ = load_model()
    errors = logit_errors(model.cuda(), rows=64, steps=16, prompt_tokens=600)
    assert PATHS <= set(errors)
    assert max(errors.values()) < 1e-4
