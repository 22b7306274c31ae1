"""algos.merge_lora: a trained LoRA adapter merged into a real tiny model gives the adapter model's logits."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from agents.models import load_model, tiny_model
from algos.merge_lora import main

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trained_adapter(tmp_path, targets=TARGETS):
    """A tiny base model saved to disk, and a LoRA adapter over it whose weights moved away from their init."""
    model, tokenizer = tiny_model(seed=0)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # lora_B starts at zero: move it, as training would
                param.normal_(std=0.2)
    peft_model.save_pretrained(adapter_dir)
    return peft_model.eval(), tokenizer, base_dir, adapter_dir


def test_merged_model_reproduces_the_adapter_models_logits(tmp_path):
    peft_model, tokenizer, base_dir, adapter_dir = trained_adapter(tmp_path)
    out = tmp_path / "merged"
    main(["--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)])

    merged, merged_tokenizer = load_model(out, device="cpu")
    ids = torch.tensor([tokenizer("The capital of France is Paris. <search>Ed Wood</search>")["input_ids"]])
    with torch.no_grad():
        want = peft_model(ids).logits
        got = merged(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter changes the model
    # W x + s B (A x) and (W + s B A) x round differently in float32: ~2e-5 on logits of size ~8 here.
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert merged_tokenizer.pad_token == "<|endoftext|>" and len(merged_tokenizer) == len(tokenizer)
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    _, _, base_dir, adapter_dir = trained_adapter(tmp_path)
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)]
    with pytest.raises(FileExistsError, match="--overwrite"):
        main(args)
    assert (out / "keep.txt").read_text() == "mine"
    main([*args, "--overwrite"])
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        main(["--adapter", str(tmp_path), "--out", str(tmp_path / "out")])
    _, _, base_dir, adapter_dir = trained_adapter(tmp_path, targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="tied"):
        main(["--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_merge_into_the_bundled_smollm2(tmp_path):
    model, tokenizer = load_model(device="cpu")
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj"]))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    peft_model.eval().save_pretrained(tmp_path / "adapter")
    main(["--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")])  # --base defaults to SmolLM2
    merged, _ = load_model(tmp_path / "merged", device="cpu")
    ids = torch.tensor([tokenizer("Who directed Ed Wood?")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-3)
