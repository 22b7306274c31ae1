"""TorchRL's own ``GRPOLoss`` on our RL batch (a tiny model's real rollout) against our loss
(`algos.objectives.losses`).

A run's batch takes TorchRL's LLM keys beside ours (`agents.torchrl_layout.add_torchrl_keys`), so TorchRL's
``GRPOLoss`` (``masking_strategy="rlhf"``, actor a ``TransformersWrapper`` around the policy in
``input_mode="tokens"``, no entropy bonus) reads it directly. Where the two definitions agree, the numbers agree:

- clipping: the same. TorchRL clamps the log-ratio to ``[log(1 - eps_low), log(1 + eps_high)]`` and takes the
  smaller gain; we take the larger of ``-A r`` and ``-A clip(r)``: one objective, so ``loss_objective`` equals our
  ``loss_pg`` (DAPO's asymmetric clip included).
- normalisation of the policy term: the same on a whole batch (``aggregation="token_mean"``: the masked token mean).
  We divide a micro-batch's sum by the whole batch's token count, so micro-batches add up to the batch's loss;
  TorchRL divides by the tokens of the tensordict it is given. TorchRL's ``"prompt_mean"`` (a mean per sequence)
  has no counterpart here.
- KL to the reference: the same estimator (k3, ``exp(d) - d - 1`` with ``d = ref - logp``) and coefficient, but
  TorchRL averages it over every position of the ``(N, T)`` batch, padding and prompt included (they add 0), while
  our ``loss_kl`` is a mean over the sampled tokens: TorchRL's ``loss_kl_to_ref`` is ours times (sampled tokens /
  N*T). Its ``kl_to_inference`` term has no counterpart (ours is ``tis_cap``'s truncated importance weights, which
  TorchRL's GRPOLoss lacks).
- metrics: TorchRL's ``clip_fraction`` and ``kl_approx`` are also means over all N*T positions, and its
  ``kl_approx`` is the k1 estimate (``old - new``), while our ``approx_kl`` is k3 over the sampled tokens.
- temperature: TorchRL's wrapper scores with the raw logits; ours divide them by ``temperature`` first, so the two
  agree at temperature 1 only.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agents.torchrl_layout import add_torchrl_keys
from algos.batch import token_logprobs, trim_rows
from algos.config import preset_config
from algos.objectives.losses import group_advantages, kl_penalty, policy_loss
from algos.run.training_run import TrainingRun

pytest.importorskip("torchrl.objectives.llm")
from torchrl.modules.llm import TransformersWrapper  # noqa: E402
from torchrl.objectives.llm import GRPOLoss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIP = (0.2, 0.28)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """(run, its first step's RL batch with made-up advantages, the policy that sampled it, a moved policy).

    The tiny model's rewards all tie (advantage 0), so the batch gets advantages of made-up episode rewards; the
    moved policy (weights plus noise) makes ratios that leave the clip window.
    """
    run_dir = tmp_path_factory.mktemp("torchrl") / "run"
    run = TrainingRun(preset_config("tiny", run_dir=str(run_dir), clip_eps_high=0.28))
    try:
        rollouts = run.learner.collect_rollouts()
    finally:
        run.close()
    batch = rollouts.batch
    assert "tokens" not in batch.keys()  # TorchRL's keys are an export: the step reads ours only
    episodes = rollouts.episodes
    rewards = torch.arange(len(episodes), dtype=torch.float32) ** 2  # (B,)
    adv = group_advantages(rewards, torch.tensor([t.group_id for t in episodes]))  # (B,)
    batch["adv"] = adv[batch["episode_id"]]  # (N,)
    sampler = run.policy
    moved = copy.deepcopy(sampler)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
        batch["ref_logp"] = token_logprobs(sampler, batch["input_ids"], batch["attention_mask"])
    return run, add_torchrl_keys(batch), sampler, moved


def _grpo_loss(policy, tokenizer, **kwargs) -> GRPOLoss:
    actor = TransformersWrapper(policy, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True)
    return GRPOLoss(actor, clip_epsilon=CLIP, masking_strategy="rlhf", entropy_bonus=False, **kwargs)


def test_a_trainer_batch_takes_torchrl_keys(step):
    run, batch, _, _ = step
    assert run.collector.batches_done == 1  # one collect() for the step
    n, width = batch["input_ids"].shape
    assert batch["tokens", "full"] is batch["input_ids"]
    assert torch.equal(batch["masks", "all_attention_mask"], batch["attention_mask"].bool())
    assistant, log_probs = batch["masks", "all_assistant_mask"], batch["log_probs", "full"]
    assert assistant.shape == log_probs.shape == (n, width)
    # unshifted: position t is about token t (ours: column t is about token t + 1); nothing predicts a first token
    assert not assistant[:, 0].any() and torch.equal(assistant[:, 1:], batch["loss_mask"])
    assert torch.all(log_probs[:, 0] == 0) and torch.equal(log_probs[:, 1:], batch["old_logp"])
    assert batch["advantage"].shape == (n, width, 1)
    assert torch.equal(batch["advantage"][:, :, 0], batch["adv"][:, None].expand(n, width))
    assert batch["next", "ref_log_probs", "full"].shape == (n, width)
    per_token = add_torchrl_keys(batch.exclude("advantage").set("adv", torch.ones(n, width - 1)))["advantage"]
    assert per_token.shape == (n, width, 1) and torch.all(per_token[:, 0] == 0) and torch.all(per_token[:, 1:] == 1)


def test_torchrl_grpo_loss_equals_ours_on_our_batch(step):
    run, batch, _, moved = step
    mask = batch["loss_mask"]
    logp = token_logprobs(moved, batch["input_ids"], batch["attention_mask"])  # (N, T-1)
    ours = policy_loss(logp, batch["old_logp"], batch["adv"], mask, *CLIP)
    out = _grpo_loss(moved, run.tokenizer)(batch)
    assert 0.05 < float(ours["clip_fraction"]) < 0.95  # the clip window matters
    assert float(out.loss_objective.detach()) == pytest.approx(float(ours["loss_pg"].detach()), abs=1e-6)
    # the same gradient, parameter by parameter
    ours_grad = torch.autograd.grad(ours["loss_pg"], list(moved.parameters()))
    logp = token_logprobs(moved, batch["input_ids"], batch["attention_mask"])
    theirs = _grpo_loss(moved, run.tokenizer)(batch).loss_objective
    theirs_grad = torch.autograd.grad(theirs, list(moved.parameters()))
    for a, b in zip(ours_grad, theirs_grad, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # TorchRL's metrics are means over every position of the (N, T) batch; ours over the sampled tokens
    share = float(mask.sum()) / batch["input_ids"].numel()
    assert float(out.clip_fraction) == pytest.approx(float(ours["clip_fraction"]) * share, rel=1e-5)
    k1 = (batch["old_logp"] - logp.detach())[mask].sum() / batch["input_ids"].numel()
    assert float(out.kl_approx) == pytest.approx(float(k1), rel=1e-4, abs=1e-7)


def test_torchrl_kl_to_ref_is_ours_over_every_position(step):
    run, batch, _, moved = step
    mask = batch["loss_mask"]
    coef = 0.1
    logp = token_logprobs(moved, batch["input_ids"], batch["attention_mask"])
    ours = coef * kl_penalty(logp, batch["ref_logp"], mask, "k3")
    out = _grpo_loss(moved, run.tokenizer, kl_to_ref_coeff=coef)(batch)
    share = float(mask.sum()) / batch["input_ids"].numel()
    assert float(ours) > 0
    assert float(out.loss_kl_to_ref) == pytest.approx(float(ours) * share, rel=1e-4)


def test_the_trainers_micro_batches_keep_the_torchrl_keys_aligned(step):
    """`trim_rows` cuts TorchRL's token-aligned keys to the micro-batch's length, ours to one less: TorchRL's loss
    on a micro-batch is ours on it (both token means over the micro-batch's own tokens)."""
    run, batch, sampler, moved = step
    lengths = batch["attention_mask"].sum(-1)
    rows = [int(lengths.argmin())]
    part = trim_rows(batch, rows, "cpu")
    length = int(lengths[rows[0]])
    assert part["input_ids"].shape[1] == part["tokens", "full"].shape[1] == part["log_probs", "full"].shape[1]
    assert part["tokens", "full"].shape[1] == length and part["advantage"].shape[1:] == (length, 1)
    assert part["loss_mask"].shape[1] == part["old_logp"].shape[1] == length - 1
    logp = token_logprobs(moved, part["input_ids"], part["attention_mask"])
    ours = policy_loss(logp, part["old_logp"], part["adv"], part["loss_mask"], *CLIP)
    out = _grpo_loss(moved, run.tokenizer)(part)
    assert float(out.loss_objective.detach()) == pytest.approx(float(ours["loss_pg"].detach()), abs=1e-6)
    # at the weights that sampled it, every ratio is 1 up to numerics: nothing clips
    at_sampler = _grpo_loss(sampler, run.tokenizer)(batch)
    assert float(at_sampler.clip_fraction) == 0.0
