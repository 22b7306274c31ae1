"""Tests of the SFT weighting rules in algos/objectives/weighting.py, RED against its formula by hand."""

from __future__ import annotations

import json
import math
import random

import pytest

from algos.objectives.weighting import RED, FixedSFT, NoSFT, SFTWeighting


def test_every_rule_has_the_interface():
    for rule in (NoSFT(), FixedSFT(), RED()):
        assert isinstance(rule, SFTWeighting)
    assert not NoSFT.uses_sft and FixedSFT.uses_sft and RED.uses_sft
    assert NoSFT().weight(rl_entropy=1.0, batch_accuracy=0.3) == 0.0
    assert FixedSFT().weight(rl_entropy=1.0, batch_accuracy=0.3) == 1.0
    assert FixedSFT().metrics() == {"sft/weight": 1.0}


def test_red_by_hand_through_both_entropy_clips():
    """decay 0.5 keeps the arithmetic readable; G = 5; accuracy part off."""
    red = RED(max_factor=5.0, decay=0.5, use_accuracy=False)
    # step 1: H_rl := 2.0 (first observation, change 0); no SFT change yet: ratio 0 -> lower clip 1.
    assert red.weight(rl_entropy=2.0, batch_accuracy=0.5) == 1.0
    red.observe_sft_entropy(1.0)  # H_sft := 1.0, change 0
    # step 2: H_rl 2.0 -> 1.5 (d = -0.5); dH_sft still 0 -> 1.
    assert red.weight(rl_entropy=1.0, batch_accuracy=0.5) == 1.0
    red.observe_sft_entropy(0.0)  # H_sft 1.0 -> 0.5, d = -0.5
    # step 3: H_rl 1.5 -> 1.3 (d = -0.2): |−0.5| / |−0.2| = 2.5, inside [1, 5].
    assert red.weight(rl_entropy=1.1, batch_accuracy=0.5) == pytest.approx(2.5)
    assert red.metrics()["red/entropy_weight"] == pytest.approx(2.5)
    red.observe_sft_entropy(1.5)  # H_sft 0.5 -> 1.0, d = +0.5
    # step 4: H_rl unchanged (1.3 -> 1.3): 0.5 / 1e-8 -> upper clip G = 5.
    assert red.weight(rl_entropy=1.3, batch_accuracy=0.5) == pytest.approx(5.0)
    red.observe_sft_entropy(1.0)  # H_sft unchanged, d = 0
    # step 5: H_rl 1.3 -> 1.8 (d = 0.5); dH_sft 0 -> lower clip 1.
    assert red.weight(rl_entropy=2.3, batch_accuracy=0.5) == 1.0
    assert red.state_dict() == pytest.approx({"h_rl": 1.8, "h_sft": 1.0, "dh_rl": 0.5, "dh_sft": 0.0})


def test_red_by_hand_with_accuracy_factor_and_final_clip():
    red = RED(max_factor=5.0, decay=0.5)
    red.weight(rl_entropy=2.0, batch_accuracy=0.0)
    red.observe_sft_entropy(1.0)
    red.weight(rl_entropy=1.0, batch_accuracy=0.0)
    red.observe_sft_entropy(0.0)
    # entropy weight 2.5 (as above) times accuracy factor 5 (acc 0): 12.5, inside [1, 25].
    assert red.weight(rl_entropy=1.1, batch_accuracy=0.0) == pytest.approx(12.5)
    m = red.metrics()
    assert m["red/accuracy_factor"] == pytest.approx(5.0) and m["red/final_weight"] == pytest.approx(12.5)
    assert m["red/batch_accuracy"] == 0.0 and m["sft/weight"] == m["red/final_weight"]
    red.observe_sft_entropy(1.5)
    # entropy weight 5 (upper clip) times 5: 25 = G**2, the top of w's range.
    assert red.weight(rl_entropy=1.3, batch_accuracy=0.0) == pytest.approx(25.0)
    red.observe_sft_entropy(1.0)
    # entropy weight 1 times 1/5 (acc 1) = 0.2: the final clip lifts it to 1.
    assert red.weight(rl_entropy=2.3, batch_accuracy=1.0) == 1.0
    assert red.metrics()["red/accuracy_factor"] == pytest.approx(0.2)


@pytest.mark.parametrize(("acc", "factor"), [(0.0, 5.0), (0.5, 1.0), (1.0, 0.2), (0.25, math.sqrt(5.0))])
def test_red_accuracy_factor(acc, factor):
    red = RED(max_factor=5.0)
    w = red.weight(rl_entropy=1.0, batch_accuracy=acc)  # first step: entropy weight 1
    assert red.metrics()["red/accuracy_factor"] == pytest.approx(factor)
    assert w == pytest.approx(max(factor, 1.0))


def test_red_accuracy_part_switched_off():
    red = RED(max_factor=5.0, use_accuracy=False)
    for acc in (0.0, 0.5, 1.0):
        assert red.weight(rl_entropy=1.0, batch_accuracy=acc) == 1.0
        assert red.metrics()["red/accuracy_factor"] == 1.0


def _reference_weights(steps, g: float, decay: float, use_accuracy: bool) -> list[float]:
    """The DESIGN.md formula written out independently of the class."""
    h_rl = h_sft = None
    d_rl = d_sft = 0.0
    weights = []
    for rl_entropy, acc, sft_entropy in steps:
        if h_rl is None:
            h_rl = rl_entropy
        else:
            d_rl = (1 - decay) * (rl_entropy - h_rl)
            h_rl += d_rl
        ew = min(max(abs(d_sft) / (abs(d_rl) + 1e-8), 1.0), g)
        af = min(max(g ** (1 - 2 * acc), 1 / g), g) if use_accuracy else 1.0
        weights.append(min(max(ew * af, 1.0), g * g))
        if h_sft is None:
            h_sft = sft_entropy
        else:
            d_sft = (1 - decay) * (sft_entropy - h_sft)
            h_sft += d_sft
    return weights


@pytest.mark.parametrize("use_accuracy", [True, False])
def test_red_matches_the_formula_at_default_decay(use_accuracy):
    rng = random.Random(0)
    steps = [(rng.uniform(0.5, 2.0), rng.choice([0.0, 0.25, 0.5, 1.0]), rng.uniform(0.5, 2.0)) for _ in range(40)]
    red = RED(use_accuracy=use_accuracy)
    weights = []
    for rl_entropy, acc, sft_entropy in steps:
        weights.append(red.weight(rl_entropy=rl_entropy, batch_accuracy=acc))
        red.observe_sft_entropy(sft_entropy)
    assert weights == pytest.approx(_reference_weights(steps, 5.0, 0.99, use_accuracy))
    assert len(set(round(w, 6) for w in weights)) > 3  # the run exercised more than the clips


def test_red_with_g_one_is_fixed_sft():
    rng = random.Random(1)
    red, fixed = RED(max_factor=1.0), FixedSFT()
    for _ in range(20):
        inputs = {"rl_entropy": rng.uniform(0, 3), "batch_accuracy": rng.random()}
        assert red.weight(**inputs) == fixed.weight(**inputs) == 1.0
        red.observe_sft_entropy(rng.uniform(0, 3))


def test_red_state_dict_round_trip():
    rng = random.Random(2)
    steps = [(rng.uniform(0.5, 2.0), rng.random(), rng.uniform(0.5, 2.0)) for _ in range(12)]
    red = RED()
    for rl_entropy, acc, sft_entropy in steps[:6]:
        red.weight(rl_entropy=rl_entropy, batch_accuracy=acc)
        red.observe_sft_entropy(sft_entropy)
    resumed = RED()
    resumed.load_state_dict(json.loads(json.dumps(red.state_dict())))
    assert resumed.state_dict() == red.state_dict()
    for rl_entropy, acc, sft_entropy in steps[6:]:
        assert resumed.weight(rl_entropy=rl_entropy, batch_accuracy=acc) == red.weight(
            rl_entropy=rl_entropy, batch_accuracy=acc
        )
        red.observe_sft_entropy(sft_entropy)
        resumed.observe_sft_entropy(sft_entropy)
    fresh = RED()
    fresh.load_state_dict(RED().state_dict())
    assert fresh.state_dict() == {"h_rl": None, "h_sft": None, "dh_rl": 0.0, "dh_sft": 0.0}


def test_red_rejects_bad_input():
    with pytest.raises(ValueError):
        RED(max_factor=0.5)
    with pytest.raises(ValueError):
        RED(decay=1.0)
    with pytest.raises(ValueError):
        RED().weight(rl_entropy=1.0, batch_accuracy=1.5)
    with pytest.raises(ValueError):
        RED().weight(rl_entropy=math.nan, batch_accuracy=0.5)
