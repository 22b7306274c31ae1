"""The start-of-run disk check: what a run writes (checkpoints kept and the one being written, the final model, the
evaluation's outputs) against its run directory's free space, at fixed free-space readings."""

from __future__ import annotations

import pytest

from algos.config import preset_config
from algos.run import disk
from algos.run.memory import GIB

N = 3_085_938_688
"""Qwen2.5-3B's parameters (tied embeddings once)."""


def test_a_3b_run_counts_its_checkpoints_final_model_and_outputs():
    """fp32 weights and AdamW's two moments: 34.5 GiB a checkpoint; the gpu preset keeps 3 and writes a fourth before
    it drops the oldest; the final model is every weight once."""
    config = preset_config("gpu", device="cuda")
    found = disk.plan(config, parameters=N, trainable=N)
    assert found.checkpoint == N * 4 * 3 + disk.STATE_BYTES
    assert found.checkpoints == 4
    assert found.final_model == N * 4 + disk.TOKENIZER_BYTES
    assert found.outputs == 480 * disk.METRICS_ROW_BYTES + 2 * 100 * 4096 * disk.TRANSCRIPT_BYTES_PER_TOKEN
    assert found.total == 4 * found.checkpoint + found.final_model + found.outputs

    once = disk.plan(preset_config("gpu", device="cuda", steps=2, save_every=0), parameters=N, trainable=N)
    assert once.checkpoints == 1  # the final checkpoint alone
    assert (
        disk.plan(
            preset_config("gpu", steps=5, save_every=2, keep_checkpoints=9), parameters=N, trainable=N
        ).checkpoints
        == 3
    )
    half = disk.plan(preset_config("gpu", device="cuda", param_dtype="bfloat16"), parameters=N, trainable=N)
    assert half.checkpoint - disk.STATE_BYTES == (found.checkpoint - disk.STATE_BYTES) / 2
    lora = disk.plan(config, parameters=N, trainable=N // 100)
    assert lora.checkpoint < found.checkpoint / 50 and lora.final_model == found.final_model
    averaged = disk.plan(preset_config("gpu", weight_average=0.9), parameters=N, trainable=N)
    assert averaged.checkpoint - disk.STATE_BYTES == N * 4 * 4
    resumed = disk.plan(config, parameters=N, trainable=N, present=(3, 3 * found.checkpoint))
    assert resumed.total == found.total - 3 * found.checkpoint  # kept ones on disk already


def test_a_run_that_does_not_fit_is_refused_in_one_line_with_what_shrinks_it():
    config = preset_config("gpu", device="cuda")
    found = disk.plan(config, parameters=N, trainable=N)
    assert disk.check(found, found.total + 2 * found.checkpoint, config, "runs/big") is None
    with pytest.raises(disk.DiskDoesNotFit) as err:
        disk.check(found, 100 * GIB, config, "runs/big")
    message = str(err.value)
    assert "\n" not in message and "runs/big" in message and "100.00 GiB free" in message
    assert f"{found.total / GIB:.2f} GiB (4 checkpoint(s) of 34.49 GiB, final model 11.53 GiB" in message
    # 100 GiB less the final model holds two checkpoints: one kept and the one being written
    assert "--keep-checkpoints 1" in message and "--save-every 0" in message and "--param-dtype bfloat16" in message
    with pytest.raises(disk.DiskDoesNotFit) as err:
        disk.check(found, 40 * GIB, config, "runs/big")  # not even one checkpoint and the final model
    assert "--keep-checkpoints" not in str(err.value) and "--save-every 0" not in str(err.value)


def test_a_run_with_less_than_a_checkpoint_to_spare_is_warned_about():
    config = preset_config("gpu", device="cuda", steps=2, save_every=0)
    found = disk.plan(config, parameters=N, trainable=N)
    warning = disk.check(found, found.total + found.checkpoint / 2, config, "runs/big")
    assert warning is not None and "less than one checkpoint to spare" in warning and "\n" not in warning


def test_the_trainer_refuses_at_start_what_its_disk_cannot_hold(tmp_path, capsys, monkeypatch, one_torch_thread):
    """A tiny run whose run directory reads 1 MiB free stops before any step, with exit status 2 and one line."""
    from algos.run.launch import main

    monkeypatch.setattr(disk, "free_bytes", lambda path: float(1 << 20))
    with pytest.raises(SystemExit) as stop:
        main(["--preset", "tiny", "--run-dir", str(tmp_path / "run")], algo="grpo")
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the run writes ") and "\n" not in err
    assert "which has 1.0 MiB free" in err and "--param-dtype bfloat16" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_on_a_cpu_the_memory_estimate_counts_the_copy_a_checkpoint_is_written_from():
    from algos.run import memory

    shape = memory.Shape(parameters=N, layers=36, hidden=2048, intermediate=11008, vocab=151936, kv_dim=256)
    cpu = memory.estimate(preset_config("gpu", device="cpu"), shape)
    assert cpu.parts["checkpoint copy"] == N * 4 * 3  # weights and AdamW's two moments, float32
    sharded = memory.estimate(preset_config("gpu", device="cpu", fsdp=True), shape, ranks=2)
    assert sharded.parts["checkpoint copy"] == N * 4 * 3 / 2  # --fsdp: each rank copies its shards
    assert "checkpoint copy" not in memory.estimate(preset_config("gpu", device="cpu", save_every=0), shape).parts
    assert "checkpoint copy" not in memory.estimate(preset_config("gpu", device="cuda"), shape).parts  # host memory
