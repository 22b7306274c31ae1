"""What makes bigger models fit: gradient checkpointing, bfloat16 weights, and the memory estimate at start."""

from __future__ import annotations

import pytest
import torch

from algos.config import preset_config
from algos.run import memory
from algos.run.training_run import TrainingRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qwen25_3b_config():
    """Qwen2.5-3B's published shape (its config.json), with no weights."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )


def _step(tmp_path, name: str, **overrides) -> tuple[TrainingRun, dict[str, float], int]:
    """One GRPO + SFT step of the tiny preset; returns the run, its metrics and decoder-layer forward calls."""
    run = TrainingRun(preset_config("tiny", algo="grpo_sft", steps=1, run_dir=str(tmp_path / name), **overrides))
    calls = []
    mlp = run.policy.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):  # counts forward runs, the backward's recomputations included (hooks skip those)
        calls.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    mlp.forward = counted
    metrics = run.learner.train_step()
    return run, metrics, sum(calls)


def test_gradient_checkpointing_recomputes_and_gives_the_same_update(tmp_path):
    plain, plain_metrics, plain_grad_calls = _step(tmp_path, "plain")
    ckpt, ckpt_metrics, ckpt_grad_calls = _step(tmp_path, "ckpt", gradient_checkpointing=True)
    try:
        assert (
            ckpt.policy.model.layers[0].gradient_checkpointing
            and not plain.policy.model.layers[0].gradient_checkpointing
        )
        # with checkpointing each layer runs again in the backward pass (with gradients on): more forward calls
        assert ckpt_grad_calls > plain_grad_calls > 0
        assert ckpt_metrics["loss_sft"] == pytest.approx(plain_metrics["loss_sft"], rel=1e-6)
        plain_weights = dict(plain.policy.named_parameters())
        for name, p in ckpt.policy.named_parameters():
            torch.testing.assert_close(p, plain_weights[name], atol=1e-6, rtol=1e-5, msg=name)
    finally:
        plain.close()
        ckpt.close()


def test_bfloat16_weights_train_and_save(tmp_path):
    run = TrainingRun(preset_config("tiny", algo="grpo_sft", steps=1, param_dtype="bfloat16", run_dir=str(tmp_path)))
    try:
        before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
        assert all(p.dtype == torch.bfloat16 for p in before.values())
        run.learner.train_step()
        states = [v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
        assert states and all(v.dtype == torch.bfloat16 for v in states)  # AdamW's moments follow the weights
        changed = {n for n, p in run.policy.named_parameters() if not torch.equal(p, before[n])}
        matrices = {n for n, p in before.items() if p.ndim == 2}
        # every matrix moves; a norm's weights of about 1 may not: lr 1e-3 is below bfloat16's step there (2^-7),
        # the documented cost of bfloat16 weights
        assert matrices <= changed
        final = run.save_final_model()
    finally:
        run.close()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(final)
    assert saved.config.dtype == torch.bfloat16 or saved.config.torch_dtype == torch.bfloat16


def test_parameter_count_of_a_real_shape_without_weights():
    shape = memory.Shape.of(_qwen25_3b_config())
    assert 3.05e9 < shape.parameters < 3.12e9  # Qwen2.5-3B: 3.09B parameters
    assert (shape.layers, shape.hidden, shape.kv_dim, shape.vocab) == (36, 2048, 256, 151936)


def test_the_estimate_follows_the_settings():
    shape = memory.Shape.of(_qwen25_3b_config())
    base = preset_config("gpu", device="cuda")
    plain = memory.estimate(base, shape)
    n = shape.parameters
    assert plain.parts["weights"] == n * 4 and plain.parts["gradients"] == n * 4 and plain.parts["optimizer"] == n * 8

    half = memory.estimate(preset_config("gpu", device="cuda", param_dtype="bfloat16"), shape)
    for part in ("weights", "gradients", "optimizer"):
        assert half.parts[part] == plain.parts[part] / 2

    sharded = memory.estimate(preset_config("gpu", device="cuda", fsdp=True), shape, ranks=8)
    assert sharded.parts["optimizer"] == plain.parts["optimizer"] / 8
    assert sharded.parts["weights"] + sharded.parts["gathered weights"] == pytest.approx(plain.parts["weights"])
    assert sharded.parts["kv cache"] < plain.parts["kv cache"]  # each rank samples its share of the questions

    ckpt = memory.estimate(preset_config("gpu", device="cuda", gradient_checkpointing=True), shape)
    assert ckpt.parts["activations"] < plain.parts["activations"] / 5

    lora = memory.estimate(base, shape, trainable=n // 100)
    assert lora.parts["optimizer"] == 2 * (n // 100) * 4 and lora.parts["weights"] == n * 4  # the base stays whole
    assert "reference model" not in plain.parts
    assert memory.estimate(preset_config("gpu", device="cuda", kl_coef=0.01), shape).parts["reference model"] == n * 4
    assert plain.parts["term gradient copy"] == n * 4  # RED's: the RL gradient kept while the SFT term's adds up
    assert "term gradient copy" not in memory.estimate(base.with_values(term_grad_norms=False), shape).parts
    grpo = preset_config("gpu", device="cuda", algo="grpo")  # no SFT term to tell apart
    assert "term gradient copy" not in memory.estimate(grpo, shape).parts


def test_a_run_that_fits_without_the_gradient_copy_is_told_to_drop_it():
    shape = memory.Shape.of(_qwen25_3b_config())
    found = memory.estimate(preset_config("gpu", device="cuda", algo="red_grpo"), shape)
    without = found.total - found.parts["term gradient copy"]
    with pytest.raises(memory.DoesNotFit, match="try --no-term-grad-norms"):
        memory.check(found, capacity=(without + 1) / memory.MARGIN)


def test_check_refuses_in_one_line_what_does_not_fit():
    shape = memory.Shape.of(_qwen25_3b_config())
    found = memory.estimate(preset_config("gpu", device="cuda"), shape)
    memory.check(found, capacity=2 * found.total)
    with pytest.raises(memory.DoesNotFit) as err:
        memory.check(found, capacity=80 * memory.GIB * 0.5)
    assert "\n" not in str(err.value) and "--gradient-checkpointing" in str(err.value)
    assert f"{found.total / memory.GIB:.2f} GiB per GPU" in str(err.value)


def test_a_gpu_offers_the_run_what_is_free_and_what_pytorch_already_holds(monkeypatch):
    """The check measures against what this process can still use, not the card's size: memory that another process
    or library (JAX preallocates 75%) holds is not the run's. CUDA's answers are stood in for (no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * memory.GIB, 140 * memory.GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * memory.GIB)
    assert memory.usable_memory("cuda:0") == 36 * memory.GIB
    monkeypatch.setattr(memory, "device_memory", lambda device: 20 * memory.GIB)  # free RAM moves between two reads
    assert memory.usable_memory("cpu") == 20 * memory.GIB


def test_the_trainer_refuses_a_run_that_cannot_fit(tmp_path, capsys):
    from algos.run.launch import main

    with pytest.raises(SystemExit) as stop:
        main(
            ["--preset", "tiny", "--micro-batch-tokens", "100000000", "--run-dir", str(tmp_path / "run")],
            algo="red_grpo",
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the memory estimate") and "\n" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_vllm_engine_sized_in_gib_is_counted_as_sized(monkeypatch):
    """--vllm-kv-cache-gib: the engine counts its own weights and the cache it was given, not a share of the memory,
    so two ranks' engines fit one machine's estimate."""
    from algos.config import VALIDATE_ON_INIT

    monkeypatch.setattr(memory, "device_memory", lambda device: 16 * memory.GIB)  # two reads of free RAM may differ

    shape = memory.Shape.of(_qwen25_3b_config())
    token = VALIDATE_ON_INIT.set(False)  # the settings alone: this venv need not hold vLLM
    try:
        shared = memory.estimate(preset_config("cpu", sampler="vllm", model="m"), shape).parts["vllm engine"]
        sized = memory.estimate(preset_config("cpu", sampler="vllm", model="m", vllm_kv_cache_gib=1.5), shape)
    finally:
        VALIDATE_ON_INIT.reset(token)
    assert sized.parts["vllm engine"] == shape.parameters * 4 + 1.5 * memory.GIB
    assert shared == preset_config("cpu").model.vllm_gpu_memory_utilization * 16 * memory.GIB


def test_the_estimate_counts_the_rollout_batch_and_refuses_an_absurd_group(tmp_path, capsys):
    from algos.run.launch import main

    shape = memory.Shape.of(_qwen25_3b_config())
    small = memory.estimate(preset_config("cpu"), shape).parts["rollout batch"]
    huge = memory.estimate(preset_config("cpu", group_size=100000), shape).parts["rollout batch"]
    assert huge == pytest.approx(small * 100000 / preset_config("cpu").rl.group_size, rel=0.01)
    flags = ["--preset", "tiny", "--protocol", "coda", "--group-size", "100000", "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as stop:  # 200,000 CoDA episodes: about 70 GB of rollouts
        main(flags, algo="grpo")
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the memory estimate") and "rollout batch" in err and "\n" not in err
    assert "try a smaller --group-size or --questions-per-step" in err


def test_memory_cli_estimates_a_local_config(tmp_path, capsys):
    _qwen25_3b_config().save_pretrained(tmp_path)
    found = memory.main(["--model", str(tmp_path), "--preset", "gpu", "--device", "cuda", "--gradient-checkpointing"])
    assert "3.09B parameters" in capsys.readouterr().out
    assert found.parts["weights"] == pytest.approx(3.09e9 * 4, rel=0.01)
