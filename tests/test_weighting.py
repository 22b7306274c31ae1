"""Tests of the SFT weighting rules in algos/objectives/weighting.py, RED against its formula by hand."""

from __future__ import annotations

import json
import math
import random

import pytest

from algos.objectives.weighting import RED, FixedSFT, NoSFT, SFTWeighting, Trend


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


def _resumes_exactly(make, seed: int) -> None:
    """A rule from `make` resumed from its JSON state after 6 steps weighs the next 6 exactly as the original."""
    rng = random.Random(seed)
    steps = [(rng.uniform(0.5, 2.0), rng.random(), rng.uniform(0.5, 2.0)) for _ in range(12)]
    red = make()
    for rl_entropy, acc, sft_entropy in steps[:6]:
        red.weight(rl_entropy=rl_entropy, batch_accuracy=acc)
        red.observe_sft_entropy(sft_entropy)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(red.state_dict())))
    assert resumed.state_dict() == red.state_dict()
    for rl_entropy, acc, sft_entropy in steps[6:]:
        assert resumed.weight(rl_entropy=rl_entropy, batch_accuracy=acc) == red.weight(
            rl_entropy=rl_entropy, batch_accuracy=acc
        )
        red.observe_sft_entropy(sft_entropy)
        resumed.observe_sft_entropy(sft_entropy)


def test_red_state_dict_round_trip():
    _resumes_exactly(RED, seed=2)
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


def test_trend_by_hand():
    trend = Trend(window=3)
    assert trend.slope_and_error()[0] == 0.0 and trend.change == 0.0
    for x in (1.0, 2.0):
        trend.add(x)
    assert trend.change == 0.0  # two points: a slope but no error, so no change counts
    trend.add(4.0)
    # t = 0, 1, 2 (mean 1), y mean 7/3, sum (t - 1)^2 = 2; slope ((-1)(-4/3) + (1)(5/3)) / 2 = 1.5;
    # fitted 5/6, 7/3, 23/6 -> residuals 1/6, -1/3, 1/6, RSS 1/6; se = sqrt(RSS / (3 - 2) / 2) = sqrt(1/12)
    slope, se = trend.slope_and_error()
    assert trend.mean == pytest.approx(7 / 3)
    assert slope == pytest.approx(1.5) and se == pytest.approx(math.sqrt(1 / 12))
    assert trend.change == pytest.approx(1.5 - math.sqrt(1 / 12))
    trend.add(5.0)  # the window drops the oldest value: 2, 4, 5
    assert trend.values == [2.0, 4.0, 5.0] and trend.mean == pytest.approx(11 / 3)


def test_a_trend_inside_its_noise_counts_no_change():
    trend = Trend(window=4)
    for x in (1.0, 2.0, 1.0, 2.0):
        trend.add(x)
    # slope 1 / 5 = 0.2; residuals -0.2, 0.6, -0.6, 0.2 -> RSS 0.8; se = sqrt(0.8 / 2 / 5) = 0.283 > 0.2
    slope, se = trend.slope_and_error()
    assert slope == pytest.approx(0.2) and se == pytest.approx(math.sqrt(0.08))
    assert trend.change == 0.0
    falling = Trend(window=4)
    for x in (4.0, 3.0, 2.0, 1.0):
        falling.add(x)
    assert falling.slope_and_error() == pytest.approx((-1.0, 0.0)) and falling.change == pytest.approx(-1.0)


def test_red_with_a_window_by_hand():
    """window 3, G = 5: both entropies and the accuracy over the last 3 steps."""
    red = RED(max_factor=5.0, window=3)
    # step 1: rl [3]: no change; dH_sft 0 -> entropy weight 1; accuracy mean 0 -> factor 5
    assert red.weight(rl_entropy=3.0, batch_accuracy=0.0) == pytest.approx(5.0)
    red.observe_sft_entropy(2.0)
    # step 2: rl [3, 2]: no change yet; accuracy mean (0 + 0.5) / 2 = 0.25 -> factor 5 ** 0.5
    assert red.weight(rl_entropy=2.0, batch_accuracy=0.5) == pytest.approx(math.sqrt(5))
    assert red.metrics()["red/accuracy"] == pytest.approx(0.25) and red.metrics()["red/batch_accuracy"] == 0.5
    red.observe_sft_entropy(1.0)
    # step 3: rl [3, 2, 1] a straight line: slope -1, se 0, change -1; sft [2, 1]: no change -> weight 1;
    # accuracy mean (0 + 0.5 + 1) / 3 = 0.5 -> factor 1
    assert red.weight(rl_entropy=1.0, batch_accuracy=1.0) == pytest.approx(1.0)
    assert red.dh_rl == pytest.approx(-1.0) and red.metrics()["red/dh_rl_se"] == pytest.approx(0.0)
    red.observe_sft_entropy(0.5)
    # sft [2, 1, 0.5]: slope -0.75; residuals 1/12, -1/6, 1/12, RSS 1/24; se sqrt(1/48); change -(0.75 - se)
    sft_change = -(0.75 - math.sqrt(1 / 48))
    assert red.dh_sft == pytest.approx(sft_change) and red.h_sft == pytest.approx(7 / 6)
    # step 4: rl [2, 1, 1]: slope -0.5; residuals 1/6, -1/3, 1/6, RSS 1/6; se sqrt(1/12); change -(0.5 - se)
    rl_change = -(0.5 - math.sqrt(1 / 12))
    # accuracy [0.5, 1, 0] mean 0.5 -> factor 1; entropy weight |sft change| / |rl change| = 0.606 / 0.211 = 2.866
    w = red.weight(rl_entropy=1.0, batch_accuracy=0.0)
    assert red.dh_rl == pytest.approx(rl_change) and red.h_rl == pytest.approx(4 / 3)
    assert w == pytest.approx(abs(sft_change) / (abs(rl_change) + 1e-8)) and w == pytest.approx(2.866, abs=1e-3)
    metrics = red.metrics()
    assert metrics["red/entropy_weight"] == pytest.approx(w) and metrics["red/accuracy_factor"] == pytest.approx(1)
    assert metrics["red/dh_rl_slope"] == pytest.approx(-0.5) and metrics["red/dh_sft_slope"] == pytest.approx(-0.75)
    assert metrics["red/dh_sft_se"] == pytest.approx(math.sqrt(1 / 48))


def test_red_with_a_window_forgets_the_first_batch():
    """The EMA at 0.99 still holds most of the first batch after 47 steps; a window of 8 holds none of it."""
    ema, window = RED(), RED(window=8)
    for step in range(47):
        entropy = 4.0 if step == 0 else 0.3
        for red in (ema, window):
            red.weight(rl_entropy=entropy, batch_accuracy=0.0)
            red.observe_sft_entropy(1.0)
    assert ema.h_rl > 0.3 + 0.6 * (4.0 - 0.3)  # 0.99 ** 46 = 0.63 of the first batch is still in it
    assert window.h_rl == pytest.approx(0.3) and window.dh_rl == 0.0


def test_red_with_a_window_state_round_trip_and_checks():
    _resumes_exactly(lambda: RED(window=4), seed=3)
    for bad in (1, 2, -1):
        with pytest.raises(ValueError, match="window"):
            RED(window=bad)
    with pytest.raises(ValueError):
        RED(window=3).weight(rl_entropy=math.inf, batch_accuracy=0.5)


def test_red_with_a_window_logs_a_slope_only_once_it_has_an_error():
    red = RED(window=3)
    for step, entropy in enumerate((3.0, 2.0, 1.5, 1.2)):
        red.weight(rl_entropy=entropy, batch_accuracy=0.0)
        red.observe_sft_entropy(entropy / 2)
        metrics = red.metrics()
        assert ("red/dh_rl_se" in metrics) == (step >= 2) and ("red/dh_sft_se" in metrics) == (step >= 3)
        assert all(math.isfinite(value) for value in metrics.values())
