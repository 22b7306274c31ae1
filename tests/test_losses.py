"""Unit tests of the GRPO loss terms in algos/objectives/losses.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from algos.objectives.losses import (
    entropy_estimate,
    group_advantages,
    kl_penalty,
    kl_per_token,
    masked_mean,
    policy_loss,
    sampler_mismatch,
    sft_loss,
    tis_weights,
    total_loss,
)

# --- group_advantages -------------------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 2.0, 2.0, 2.0])
    group_id = torch.tensor([7, 7, 2, 2, 9, 4, 4, 4])
    adv = group_advantages(rewards, group_id, eps=0.0)  # (B,)
    # group 7: mean 2, unbiased std sqrt(2): +-1/sqrt(2); groups 2, 9 (singleton) and 4 are flat: 0.
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-s, s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    centered = group_advantages(rewards, group_id, scale=False)  # (B,)
    torch.testing.assert_close(centered, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_group_advantages_flat_group_is_exactly_zero():
    rewards = torch.full((3,), 0.1) * 3 / 3  # equal floats whose mean may round
    assert group_advantages(rewards, torch.zeros(3, dtype=torch.long)).eq(0).all()


def test_group_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


@st.composite
def grouped_rewards(draw):
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    group_id = [g for g, size in enumerate(sizes) for _ in range(size)]
    perm = draw(st.permutations(range(len(group_id))))
    rewards = draw(st.lists(st.floats(-10, 10, width=32), min_size=len(group_id), max_size=len(group_id)))
    shifts = draw(st.lists(st.floats(-100, 100, width=32), min_size=len(sizes), max_size=len(sizes)))
    gid = torch.tensor([group_id[i] for i in perm])
    return torch.tensor(rewards, dtype=torch.float64), gid, torch.tensor(shifts, dtype=torch.float64)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards())
def test_group_advantages_properties(data):
    rewards, group_id, shifts = data
    adv = group_advantages(rewards, group_id, eps=0.0)  # (B,)
    for g in group_id.unique():
        in_group = group_id == g
        r, a = rewards[in_group], adv[in_group]
        assert abs(float(a.sum())) < 1e-9  # mean 0 per group
        if r.max() == r.min():
            assert a.eq(0).all()
        elif (r.max() - r.min()) > 1e-3:
            torch.testing.assert_close(a.std(), torch.tensor(1.0, dtype=torch.float64))
    shifted = group_advantages(rewards + shifts[group_id], group_id, eps=0.0)  # (B,)
    spread = torch.tensor([float(rewards[group_id == g].max() - rewards[group_id == g].min()) for g in group_id])
    informative = (spread > 1e-3) | (spread == 0)  # a tiny spread may vanish under a shift
    torch.testing.assert_close(shifted[informative], adv[informative], atol=1e-6, rtol=1e-6)


# --- policy_loss ------------------------------------------------------------------------------------------------


def _leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_policy_loss_gradient_at_ratio_one_is_minus_adv_over_tokens():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4]], dtype=torch.float64)
    logp = old_logp.clone().requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -0.5], dtype=torch.float64)
    out = policy_loss(logp, old_logp, adv, mask)
    out["loss_pg"].backward()
    n_tokens = 5
    expected = -adv[:, None] * mask / n_tokens
    torch.testing.assert_close(logp.grad, expected)
    torch.testing.assert_close(
        out["loss_pg"].detach(), -(2.0 * 2 - 0.5 * 3) / n_tokens * torch.ones((), dtype=torch.float64)
    )
    assert out["clip_fraction"] == 0 and abs(float(out["approx_kl"])) < 1e-12


def test_policy_loss_ignores_unmasked_positions():
    mask = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5], dtype=torch.float64)
    old_logp = torch.tensor([[-1.0, -1.0, -2.0, -0.7]], dtype=torch.float64)
    logp = _leaf([[-0.9, -5.0, -2.3, -0.1]])
    out = policy_loss(logp, old_logp, adv, mask)
    out["loss_pg"].backward()
    assert logp.grad[~mask].eq(0).all() and logp.grad[mask].ne(0).all()
    # Arbitrary values (even inf, as padding might hold) off the mask change nothing.
    logp2 = _leaf([[-0.9, -math.inf, -2.3, 50.0]])
    old2 = torch.tensor([[-1.0, 3.0, -2.0, -math.inf]], dtype=torch.float64)
    out2 = policy_loss(logp2, old2, adv, mask)
    out2["loss_pg"].backward()
    assert out2["loss_pg"].item() == out["loss_pg"].item()
    torch.testing.assert_close(logp2.grad, logp.grad)
    assert out2["approx_kl"] == out["approx_kl"] and out2["clip_fraction"] == out["clip_fraction"]


@pytest.mark.parametrize(
    ("log_ratio", "adv", "clipped"),
    [
        (math.log(1.5), 1.0, True),  # above 1+eps, positive adv: clipped, no gradient
        (math.log(0.5), -1.0, True),  # below 1-eps, negative adv: clipped
        (math.log(1.5), -1.0, False),  # above 1+eps but negative adv: the unclipped term is the max
        (math.log(0.5), 1.0, False),  # below 1-eps but positive adv
        (math.log(1.1), 1.0, False),  # inside the window
    ],
)
def test_policy_loss_clipping(log_ratio, adv, clipped):
    old_logp = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = (old_logp + log_ratio).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = policy_loss(logp, old_logp, torch.tensor([adv], dtype=torch.float64), mask, clip_eps=0.2)
    out["loss_pg"].backward()
    ratio = math.exp(log_ratio)
    if clipped:
        assert logp.grad.item() == 0.0
        assert out["loss_pg"].item() == pytest.approx(-adv * min(max(ratio, 0.8), 1.2))
    else:
        assert logp.grad.item() == pytest.approx(-adv * ratio)  # d(-adv * r)/dlogp
        assert out["loss_pg"].item() == pytest.approx(-adv * ratio)
    assert out["clip_fraction"].item() == (0.0 if abs(ratio - 1) <= 0.2 else 1.0)
    assert out["approx_kl"].item() == pytest.approx(ratio - 1 - log_ratio)


def test_policy_loss_clip_higher():
    old_logp = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(1.25), dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.ones(1, dtype=torch.float64)
    out = policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    out["loss_pg"].backward()
    assert logp.grad.item() == pytest.approx(-1.25)  # 1.25 < 1.28: not clipped
    assert out["clip_fraction"].item() == 0.0


def test_policy_loss_per_token_advantage_and_micro_batches():
    gen = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    logp = (old_logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    mask = torch.rand(4, 6, generator=gen) > 0.4
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    full = policy_loss(logp, old_logp, adv, mask)["loss_pg"]
    per_token = policy_loss(logp, old_logp, adv[:, None].expand(4, 6), mask)["loss_pg"]
    torch.testing.assert_close(per_token, full)
    n = mask.sum()
    halves = sum(
        policy_loss(logp[i : i + 2], old_logp[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_tokens=n)["loss_pg"]
        for i in (0, 2)
    )
    torch.testing.assert_close(halves, full)


def test_policy_loss_empty_mask_is_zero_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    out = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    out["loss_pg"].backward()
    assert out["loss_pg"].item() == 0.0 and logp.grad.eq(0).all()


# --- kl, sft, entropy, total ------------------------------------------------------------------------------------


def test_kl_penalty_estimators_by_hand():
    logp = _leaf([[-1.0, -2.0, -7.0]])
    ref_logp = torch.tensor([[-1.5, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    d = torch.tensor([-0.5, 0.0], dtype=torch.float64)  # ref - logp on masked tokens
    assert kl_penalty(logp, ref_logp, mask, kind="k1").item() == pytest.approx(float(-d.mean()))
    assert kl_penalty(logp, ref_logp, mask, kind="k2").item() == pytest.approx(float((0.5 * d**2).mean()))
    k3 = kl_penalty(logp, ref_logp, mask)
    assert k3.item() == pytest.approx(float((d.exp() - d - 1).mean()))
    k3.backward()
    assert logp.grad[0, 2] == 0.0
    assert kl_penalty(ref_logp.clone(), ref_logp, mask).item() == 0.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref_logp, mask, kind="k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_is_the_token_mean_of_kl_per_token(kind):
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 6, generator=gen) * 4  # (N, L)
    ref_logp = logp + 0.3 * torch.randn(3, 6, generator=gen)  # (N, L)
    ref_logp[0, 0] = -torch.inf  # garbage off the mask never leaks
    mask = torch.rand(3, 6, generator=gen) > 0.3
    mask[0, 0] = False
    per_token = kl_per_token(logp, ref_logp, mask, kind)  # (N, L)
    assert per_token[~mask].eq(0).all()
    assert torch.equal(kl_penalty(logp, ref_logp, mask, kind), masked_mean(per_token, mask))
    assert torch.equal(kl_penalty(logp, ref_logp, mask, kind, num_tokens=40), masked_mean(per_token, mask, 40))
    # PPO's reward penalty at the sampling policy's log-probs: the estimators as PPO wrote them out
    d = ref_logp - logp
    by_hand = {"k1": -d, "k2": 0.5 * d * d, "k3": d.exp() - d - 1}[kind]
    assert torch.equal(per_token[mask], by_hand[mask])


def test_sft_loss_matches_cross_entropy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen)  # (N, L, V)
    target = torch.randint(0, 11, (2, 5), generator=gen)  # (N, L)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    logp = logits.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)  # (N, L)
    expected = F.cross_entropy(logits[mask], target[mask])
    torch.testing.assert_close(sft_loss(logp, mask), expected)


def test_entropy_estimate_and_masked_mean():
    old_logp = torch.tensor([[-1.0, -3.0, -100.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_estimate(old_logp, mask).item() == pytest.approx(2.0)
    assert masked_mean(old_logp, mask, num_tokens=6).item() == pytest.approx(-1.0)


def test_total_loss_sums_loss_keys_only():
    logp = torch.zeros(1, 2, requires_grad=True)
    terms = policy_loss(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    terms["loss_sft"] = 0.1 * sft_loss(logp, torch.ones(1, 2))
    terms["clip_fraction"] = torch.tensor(123.0)  # a metric: never summed
    assert total_loss(terms).item() == pytest.approx(-1.0)
    assert total_loss({"loss_a": torch.tensor(1.0), "loss_b": torch.tensor(2.0), "kl": torch.tensor(9.0)}) == 3.0
    with pytest.raises(ValueError):
        total_loss({"kl": torch.tensor(1.0)})


# --- a sampler that is not the trainer: mismatch and truncated importance sampling ---------------------------------


def test_a_known_sampler_mismatch_gives_its_truncated_importance_weights_and_its_kl():
    """Inject a known mismatch: the trainer's log-probs are the sampler's plus a chosen shift per token."""
    sampler_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, float("nan")]], dtype=torch.float64)
    shift = torch.tensor([[0.0, math.log(1.5), math.log(4.0), 9.0], [-math.log(2.0), 0.1, 0.0, 0.0]])
    old_logp = sampler_logp + shift
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # row 1's last token has no sampler value
    weights = tis_weights(old_logp, sampler_logp, mask, cap=2.0)
    expected = torch.tensor([[1.0, 1.5, 2.0, 0.0], [0.5, math.exp(0.1), 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), expected)  # capped at 2; 0 off the mask; 1 where the sampler gave none
    found = sampler_mismatch(old_logp, sampler_logp, mask)
    d = torch.tensor([0.0, math.log(1.5), math.log(4.0), -math.log(2.0), 0.1, 0.0], dtype=torch.float64)
    assert found["mismatch/logp_abs_diff"] == pytest.approx(float(d.abs().mean()))
    assert found["mismatch/kl"] == pytest.approx(float((d.exp() - d - 1).mean()))
    assert found["mismatch/missing"] == pytest.approx(1 / 7)
    equal = sampler_mismatch(sampler_logp, sampler_logp, mask)
    assert equal["mismatch/logp_abs_diff"] == 0 and equal["mismatch/kl"] == 0


def test_importance_weights_scale_each_tokens_policy_gradient():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    logp = old_logp.clone().requires_grad_(True)
    mask = torch.ones_like(old_logp, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=torch.float64)
    weight = torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64)
    policy_loss(logp, old_logp, adv, mask, is_weight=weight)["loss_pg"].backward()
    torch.testing.assert_close(logp.grad, -weight / 3)  # at ratio 1 the gradient is -adv * w / tokens
    unweighted = policy_loss(old_logp, old_logp, adv, mask)["loss_pg"]
    ones = policy_loss(old_logp, old_logp, adv, mask, is_weight=torch.ones_like(weight))["loss_pg"]
    assert float(ones) == float(unweighted)
