"""`--sampler vllm`: the trainer pushes the trained weights to the engine, and the engine samples from them.

Most tests here are contract tests of this project's code, not of vLLM: vLLM needs a CUDA GPU, so a recording
stand-in (tests/stubs/vllm) takes the place of `vllm.LLM` with exactly the surface `VLLMSampler` uses. It holds its
own copy of the model, loaded from the directory the trainer names, and samples with it: like a real engine it keeps
sampling from the weights it was given until the trainer pushes new ones, and it records every tensor that reaches
its `load_weights`. The test marked `vllm` runs the real engine where vLLM and CUDA exist and skips elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents.records import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


STUBS = Path(__file__).resolve().parent / "stubs"


@pytest.fixture
def recording_vllm(monkeypatch):
    """Makes `import vllm` give the recording stand-in (tests/stubs/vllm); yields the list of engines it builds."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(STUBS))
    import vllm

    assert Path(vllm.__file__).parent == STUBS / "vllm"
    vllm.ENGINES.clear()
    yield vllm.ENGINES
    vllm.ENGINES.clear()
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]  # the stand-in must not outlive the test (monkeypatch then restores a real one)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    """The tiny model as a local Hugging Face directory (what `--model` and the engine both load)."""
    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _trainer(tmp_path, model_dir, **overrides):
    from algos.config import preset_config
    from algos.trainer import Trainer

    config = preset_config("tiny", model=model_dir, sampler="vllm", run_dir=str(tmp_path / "run"), **overrides)
    return Trainer(config)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}


def test_the_engine_receives_the_trained_weights_after_each_step(tmp_path, model_dir, recording_vllm):
    trainer = _trainer(tmp_path, model_dir, algo="grpo_sft", steps=2)
    try:
        [engine] = recording_vllm
        start = _weights(trainer)
        assert len(engine.loads) == 1  # at start: the engine samples from the trainer's weights, resumed or not
        assert engine.loads[0].keys() == start.keys()
        trainer.train_step()
        trained = _weights(trainer)
    finally:
        trainer.close()
    assert len(engine.loads) == 2 and engine.prefix_resets == 2
    pushed = engine.loads[-1]
    assert pushed.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(pushed[name], tensor), name
        assert not torch.equal(tensor, start[name]), f"{name} did not train: the test would prove nothing"
    for name, tensor in engine.lm.named_parameters():  # the engine now samples from the trained model
        assert torch.equal(tensor.detach(), trained[name]), name
    assert trainer.config.recompute_old_logp  # the engine's log-probs are never the ratio's denominator


def test_pushes_every_n_updates_and_samples_from_the_pushed_weights(tmp_path, model_dir, recording_vllm):
    trainer = _trainer(tmp_path, model_dir, algo="grpo_sft", steps=3, sync_weights_every=2)
    try:
        [engine] = recording_vllm
        trainer.train_step()
        assert len(engine.loads) == 1  # step 1: still the starting weights
        stale = {name: t.detach().clone() for name, t in engine.lm.named_parameters()}
        trainer.train_step()
        assert len(engine.loads) == 2  # step 2: pushed
        after_two = _weights(trainer)
    finally:
        trainer.close()
    assert all(torch.equal(engine.loads[-1][name], t) for name, t in after_two.items())
    assert any(not torch.equal(stale[name], t) for name, t in after_two.items())


def test_a_lora_policy_pushes_merged_weights_under_plain_names(tmp_path, model_dir, recording_vllm):
    trainer = _trainer(tmp_path, model_dir, algo="grpo_sft", steps=1, lora=True, lora_rank=4)
    try:
        [engine] = recording_vllm
        trainer.train_step()
        merged = {n: p.detach().clone() for n, p in trainer.peft_model.merge_and_unload().named_parameters()}
    finally:
        trainer.close()
    pushed = engine.loads[-1]
    assert pushed.keys() == merged.keys() and not any("lora" in name for name in pushed)
    changed = [name for name in merged if not torch.equal(pushed[name], engine.loads[0][name])]
    assert changed, "the adapter's update must reach the engine"
    for name, tensor in merged.items():
        torch.testing.assert_close(pushed[name], tensor, atol=1e-6, rtol=1e-5)


def test_sampler_flags_that_cannot_work_are_refused():
    from algos.config import preset_config

    with pytest.raises(ValueError, match="--sampler openai cannot receive the trained weights"):
        preset_config("tiny", sampler="openai")
    with pytest.raises(ValueError, match="--old-logp sampler with --sampler vllm"):
        preset_config("tiny", model="x", sampler="vllm", old_logp="sampler")
    with pytest.raises(ValueError, match="--sync-weights-every must be >= 1"):
        preset_config("tiny", sync_weights_every=0)


@pytest.mark.vllm
def test_real_engine_samples_change_after_a_weight_push():
    """The real engine end to end: sample, push perturbed weights, sample again; the samples change."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'redcoda[vllm]' on a CUDA machine)")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    from agents.models import load_model
    from agents.samplers.vllm_engine import VLLMSampler

    sampler = VLLMSampler(None, max_context=1024, gpu_memory_utilization=0.3, enforce_eager=True)
    prompt = sampler.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    [before] = sampler.generate([prompt], params)
    model, _ = load_model(None, dtype=torch.float32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        (n, p.detach() + 0.05 * torch.randn(p.shape, device="cuda", generator=generator))
        for n, p in model.named_parameters()
    ]
    sampler.load_weights(weights)
    [after] = sampler.generate([prompt], params)
    assert before.token_ids != after.token_ids
    sampler.load_weights(list(model.named_parameters()))  # the original weights back: the original sample back
    [again] = sampler.generate([prompt], params)
    assert again.token_ids == before.token_ids


def test_under_fsdp_every_rank_engine_gets_the_whole_trained_weights(tmp_path, model_dir):
    """Two gloo ranks with --fsdp --sampler vllm: the weights are gathered whole once per push, and each rank's
    engine receives them: at start, after each step, equal on both ranks and equal to the final model."""
    from safetensors.torch import load_file

    pushes = tmp_path / "pushes"
    pushes.mkdir()
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(STUBS), str(root)]),
        "OMP_NUM_THREADS": "1",
        "REDCODA_RECORD_PUSHES": str(pushes),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    cmd += ["algos.grpo_sft", "--preset", "tiny", "--model", model_dir, "--sampler", "vllm", "--fsdp", "--steps", "2"]
    cmd += ["--eval-questions", "0", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in pushes.iterdir())
    assert files == [f"rank{r}-push{k}.safetensors" for r in (0, 1) for k in (1, 2, 3)]
    from transformers import AutoModelForCausalLM

    final = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").named_parameters())
    first, last = load_file(pushes / "rank0-push1.safetensors"), load_file(pushes / "rank0-push3.safetensors")
    assert last.keys() == final.keys()
    for name, tensor in load_file(pushes / "rank1-push3.safetensors").items():
        assert torch.equal(tensor, last[name]), name  # both ranks' engines hold the same whole weights
        assert tensor.shape == final[name].shape, name  # whole tensors, not shards
        torch.testing.assert_close(tensor, final[name].detach(), atol=0, rtol=0, msg=name)
    assert any(not torch.equal(first[name], last[name]) for name in last)
