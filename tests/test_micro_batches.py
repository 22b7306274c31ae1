"""Micro-batches by length: padding stays under its cap, and the loss and gradients equal one padded batch's.

The loss test runs the real trainer (tiny model, real env, real BM25 index) on one step's RL batch and SFT
minibatch, once through `Trainer._rl_backward` / `_sft_backward` (grouped by `micro_batches`) and once as a
single padded batch of every row.
"""

from __future__ import annotations

import random

import pytest
import torch

from agents.collate import collate_trajectories
from algos.batch import micro_batches
from algos.config import preset_config
from algos.objectives.losses import sft_loss, total_loss
from algos.objectives.policy_losses import LossScale
from algos.run.training_run import TrainingRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def padding(lengths, groups) -> tuple[int, int]:
    """(padding tokens, padded tokens) when each micro-batch runs trimmed to its longest row."""
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return padded - sum(lengths[i] for g in groups for i in g), padded


def budget_only(lengths, max_tokens) -> list[list[int]]:
    """The grouping by the token budget alone: longest first, a row joins while rows x longest fits."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@pytest.mark.parametrize("max_tokens", [512, 4096, 16384])
def test_every_micro_batch_is_within_the_padding_cap_and_the_budget(max_tokens):
    rng = random.Random(max_tokens)
    cases = [
        [rng.randint(200, 3000) for _ in range(64)],  # RL contexts: prompts plus a few turns
        [rng.choice([400, 401, 420, 800, 801]) for _ in range(40)],  # many ties and near-ties
        [7, 5, 3000, 2999, 1],
        [100],
    ]
    for lengths in cases:
        groups = micro_batches(lengths, max_tokens)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            longest = max(lengths[i] for i in g)
            assert len(g) == 1 or len(g) * longest <= max_tokens
            pad, padded = padding(lengths, [g])
            assert pad <= 0.05 * padded
        assert micro_batches(lengths, max_tokens, max_padding=1.0) == budget_only(lengths, max_tokens)
        pad, padded = padding(lengths, groups)
        assert pad <= 0.05 * padded
    lengths = cases[1]
    assert max(len(g) for g in micro_batches(lengths, 16384)) > 1, "rows of equal length still share"


def test_the_earlier_grouping_padded_more_on_spread_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(300, 1500) for _ in range(8)]  # a few contexts of spread lengths, as a CPU step has
    before, before_padded = padding(lengths, budget_only(lengths, 4096))
    after, after_padded = padding(lengths, micro_batches(lengths, 4096))
    assert after / after_padded <= 0.05 < before / before_padded


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    config = preset_config(
        "tiny",
        run_dir=str(tmp_path_factory.mktemp("micro") / "run"),
        algo="grpo_sft",
        skip_zero_advantage=False,
        sft_batch_size=4,
    )
    run = TrainingRun(config)
    yield run
    run.close()


def grads(run: TrainingRun) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in run.trainable if p.grad is not None])


def test_rl_loss_and_gradients_equal_one_padded_batch(run):
    trajectories = run.collector.collect()
    adv = torch.linspace(-1.0, 1.0, len(trajectories))  # (B,): every context carries signal
    batch = collate_trajectories(trajectories, pad_token_id=run.pad_id)
    batch["adv"] = adv[batch["episode_id"]]
    num_tokens = float(batch["loss_mask"].sum())
    run.policy.train()
    run.optimizer.zero_grad(set_to_none=True)
    padded = run.learner._rows(batch, list(range(batch.batch_size[0])))  # one micro-batch, padded to the longest
    terms = run.learner.rl_loss_terms(padded, LossScale(num_tokens, batch.batch_size[0], num_tokens))
    total_loss(terms).backward()
    reference, reference_loss = grads(run), float(terms["loss_pg"].detach())

    lengths = batch["attention_mask"].sum(-1).tolist()
    config = run.config
    for budget in (config.optim.micro_batch_tokens, 2 * max(lengths)):  # the preset's budget, and about 2 rows each
        run.learner.config = config.with_values(micro_batch_tokens=budget)
        run.optimizer.zero_grad(set_to_none=True)
        metrics = run.learner._rl_backward(batch)
        parts = run.learner.rl_micro_batches(batch)  # the micro-batches that backward ran
        pad, total = padding(lengths, parts)
        assert pad <= 0.05 * total
        assert metrics["loss_pg"] == pytest.approx(reference_loss, rel=1e-6, abs=1e-6)
        torch.testing.assert_close(grads(run), reference, rtol=1e-4, atol=1e-6)
    assert len(parts) > 1
    run.learner.config = config
    run.optimizer.zero_grad(set_to_none=True)


def test_sft_loss_and_gradients_equal_one_padded_batch(run):
    sft = run.learner.sft_minibatch(0)
    lengths = sft["attention_mask"].sum(-1).tolist()
    config = run.config
    run.learner.config = config.with_values(micro_batch_tokens=max(lengths))  # rows of unequal length apart
    groups = micro_batches(lengths, run.config.optim.micro_batch_tokens)
    assert len(groups) > 1 and len(set(lengths)) > 1
    num_tokens = float(sft["loss_mask"].sum())
    coef = 0.7
    run.policy.train()
    run.optimizer.zero_grad(set_to_none=True)
    padded = run.learner._rows(sft, list(range(len(lengths))))
    logp, _ = run.learner._logprobs(run.policy, padded, with_entropy=True)
    nll = sft_loss(logp, padded["loss_mask"], num_tokens=num_tokens)
    (coef * nll).backward()
    reference = grads(run)

    run.optimizer.zero_grad(set_to_none=True)
    metrics = run.learner._sft_backward(sft, coef)
    assert metrics["loss_sft"] == pytest.approx(coef * float(nll.detach()), rel=1e-6, abs=1e-6)  # fp32 sums
    torch.testing.assert_close(grads(run), reference, rtol=1e-4, atol=1e-6)
    run.learner.config = config
    run.optimizer.zero_grad(set_to_none=True)
