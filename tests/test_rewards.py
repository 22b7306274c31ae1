"""The answer metrics against the official HotpotQA evaluation rules, and the episode reward."""

import pytest

from envs.data import load_examples
from envs.rewards import (
    RewardWeights,
    cover_exact_match,
    episode_reward,
    exact_match,
    f1_score,
    format_score,
    normalize_answer,
    refine_score,
    title_recall,
)


def test_normalize_answer_follows_official_script():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("U.S.A.") == "usa"
    assert normalize_answer("theater") == "theater"  # articles only as whole words


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("yes", "yes", 1.0),
        ("Yes.", "yes", 1.0),
        ("yes it is", "yes", 0.0),  # the yes/no rule: no partial credit
        ("no", "yes", 0.0),
        ("yes", "yes sir", 0.0),
        ("noanswer", "no answer", 0.0),
        ("the Chicago Bulls", "Chicago Bulls", 1.0),
        ("Chicago", "Chicago Bulls", 2 * (1.0 * 0.5) / 1.5),
        ("Paris France", "Lyon", 0.0),
    ],
)
def test_f1_official_cases(prediction, gold, expected):
    assert f1_score(prediction, gold) == pytest.approx(expected)


def test_metrics_take_max_over_aliases():
    assert exact_match("Meg", ("Margaret", "Meg")) == 1.0
    assert f1_score("Meg Griffin", ("Margaret", "Meg")) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        f1_score("x", ())


def test_cover_em_needs_whole_tokens():
    assert cover_exact_match("It was born in Kolkata, India", "Kolkata") == 1.0
    assert cover_exact_match("Kolkatan food", "Kolkata") == 0.0


def test_every_gold_answer_scores_one_against_itself():
    for example in load_examples("hotpotqa", "train"):
        assert f1_score(example.answer, example.answers) == 1.0
        assert exact_match(example.answer, example.answers) == 1.0


def test_format_score_is_graduated_and_capped():
    assert format_score([], []) == 0.0
    assert format_score(["search"], []) == 0.25
    assert format_score(["think", "search", "answer"], ["search"]) == 0.5
    assert format_score(["think", "search", "refine", "answer", "task"], []) == 1.0


def test_refine_score_is_share_of_blocks_with_the_answer():
    assert refine_score([], "Kolkata") == 0.0
    assert refine_score(["born in Kolkata", "a singer"], "Kolkata") == 0.5


def test_episode_reward_formula_and_weights():
    assert episode_reward(1.0, 1.0, 1.0) == pytest.approx(3.2) == pytest.approx(RewardWeights().maximum)
    assert episode_reward(0.0, 0.5, 0.0) == pytest.approx(-3 + 0.05)
    weights = RewardWeights(answer=1.0, offset=0.0, format=0.5, refine=0.0)
    assert episode_reward(0.5, 1.0, 1.0, weights) == pytest.approx(1.0)
    assert episode_reward(0.5, 1.0, 1.0, weights, recall=1.0) == pytest.approx(1.0)  # recall weighs 0 by default
    with_recall = RewardWeights(recall=2.0)
    assert episode_reward(0.0, 0.0, 0.0, with_recall, recall=0.5) == pytest.approx(-3.0 + 1.0)
    assert with_recall.maximum == pytest.approx(RewardWeights().maximum + 2.0)


def test_title_recall():
    assert title_recall(["Ed Wood", "x"], ["ed wood", "Scott Derrickson"]) == 0.5
    assert title_recall([], []) == 0.0


def test_is_yes_no_reads_the_normalized_answer():
    from envs.rewards import is_yes_no

    assert is_yes_no("Yes") and is_yes_no(" no. ") and is_yes_no("YES!")
    assert not is_yes_no("Norway") and not is_yes_no("yes and no") and not is_yes_no("noanswer")
