"""Reading SFT demonstration files: good lines load, bad lines name the file, the line and the fault."""

from __future__ import annotations

import json
import re

import pytest

from algos.sft_data import read_demonstrations, sample_indices
from envs.data import DataError


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


def _write(tmp_path, *lines: str):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "role": "agent", "f1": 1.0})


def test_both_formats_load_and_wrong_answers_are_skipped(tmp_path, tokenizer):
    chat = {"f1": 0.5, "contexts": [{"role": "agent", "messages": [{"role": "assistant", "content": "hello"}]}]}
    wrong = json.dumps({"token_ids": [4], "loss_mask": [1], "f1": 0.0})
    demos = read_demonstrations(_write(tmp_path, GOOD, "", json.dumps(chat), wrong), tokenizer)
    assert [d.token_ids for d in demos[:1]] == [(1, 2, 3)] and len(demos) == 2
    assert demos[1].token_ids == tuple(tokenizer("hello", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    ("line", "fault"),
    [
        ('{"token_ids": [1, 2], "loss_mask": [0, 1', "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object (one demonstration), got a list"),
        (json.dumps({"token_ids": [1, 2, 10_000_000], "loss_mask": [0, 1, 1]}), "token id 10000000 is outside"),
        (json.dumps({"token_ids": [1, -2], "loss_mask": [0, 1]}), "token id -2 is outside"),
        (json.dumps({"token_ids": [1, 2], "loss_mask": [0]}), "token_ids, loss_mask and sample_logprobs must align"),
        (json.dumps({"token_ids": [1, 2]}), "has no 'loss_mask' field"),
        (json.dumps({"token_ids": ["a"], "loss_mask": [1]}), "token_ids must be integers"),
        (json.dumps({"contexts": [{"messages": [{"content": "x"}]}]}), "has no 'role' field"),
        (json.dumps({"f1": 1.0}), "neither token_ids/loss_mask nor contexts/messages"),
    ],
)
def test_bad_lines_name_the_file_the_line_and_the_fault(tmp_path, tokenizer, line, fault):
    path = _write(tmp_path, GOOD, "", line)
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}: line 3: .*{re.escape(fault)}"):
        read_demonstrations(path, tokenizer)


def test_demonstrations_without_quotes_have_their_own_cache(tokenizer):
    from algos.config import preset_config
    from algos.sft_data import demonstrations_cache_path

    quoting = preset_config("cpu", quote_words=12)
    assert preset_config("cpu").sft.quote_words == 0 and preset_config("gpu").sft.quote_words == 12
    path = demonstrations_cache_path(quoting, tokenizer)
    assert demonstrations_cache_path(preset_config("cpu"), tokenizer) != path
    with pytest.raises(ValueError, match="--quote-words must be >= 0"):
        preset_config("cpu", quote_words=-1)


def test_demonstrations_that_search_twice_have_their_own_cache(tokenizer):
    """--min-searches 2 and --results-queries change the demonstrations, so their cache; the defaults keep the key of
    earlier runs."""
    from algos.config import preset_config
    from algos.sft_data import demonstrations_cache_path

    default = demonstrations_cache_path(preset_config("cpu"), tokenizer)
    assert demonstrations_cache_path(preset_config("cpu", min_searches=1), tokenizer) == default
    twice = demonstrations_cache_path(preset_config("cpu", min_searches=2), tokenizer)
    assert twice != default
    read_off = demonstrations_cache_path(preset_config("cpu", min_searches=2, results_queries=True), tokenizer)
    assert read_off not in (default, twice)
    with pytest.raises(ValueError, match="--min-searches must be >= 1"):
        preset_config("cpu", min_searches=0)


def test_a_planner_share_sets_how_many_planner_contexts_each_minibatch_draws():
    roles = ["planner", "executor"] * 50
    for step in range(20):
        picks = sample_indices(100, 8, seed=0, step=step, roles=roles, planner_share=0.25)
        assert len(set(picks)) == 8 and sum(roles[i] == "planner" for i in picks) == 2
        assert picks == list(sample_indices(100, 8, seed=0, step=step, roles=roles, planner_share=0.25))  # resumable
    uniform = [sum(roles[i] == "planner" for i in sample_indices(100, 8, 0, step)) for step in range(200)]
    assert 3.5 < sum(uniform) / len(uniform) < 4.5  # without a share: about half, as the demonstrations are
    few = ["planner"] * 3 + ["executor"] * 97  # fewer planners than the share asks for: the executors fill in
    picks = sample_indices(100, 20, 0, 0, roles=few, planner_share=0.5)
    assert len(set(picks)) == 20 and sum(few[i] == "planner" for i in picks) == 3
    flat = ["agent"] * 10  # no planner at all (flat): the share changes nothing
    assert sample_indices(10, 8, 0, 3, roles=flat, planner_share=0.25) == sample_indices(10, 8, 0, 3)
    with pytest.raises(ValueError, match="roles"):
        sample_indices(10, 8, 0, 0, roles=flat[:5], planner_share=0.25)


def _episode(index: int, answer: str, role: str = "executor") -> str:
    return json.dumps({"token_ids": [1, 2], "loss_mask": [0, 1], "role": role, "index": index, "answer": answer})


def test_demonstrations_mixed_like_the_questions_keep_each_kind_at_its_share(tmp_path, tokenizer):
    # 10 questions: 6 bridge, 2 comparison, 2 yes/no. The oracle grounded 3 bridge questions (0-2), both
    # comparisons (6, 7) and both yes/no (8: yes, 9: no), each episode two contexts (planner and executor).
    kinds = ["bridge"] * 6 + ["comparison"] * 2 + ["yes/no"] * 2
    lines = [
        _episode(i, a, role)
        for i, a in [(0, "x"), (1, "y"), (2, "z"), (6, "a"), (7, "b"), (8, "yes"), (9, "no")]
        for role in ("planner", "executor")
    ]
    path = _write(tmp_path, *lines)
    everything = read_demonstrations(path, tokenizer)
    mixed = read_demonstrations(path, tokenizer, question_kinds=kinds)
    assert len(everything) == 14
    # bridge limits: 3 episodes at a share of 0.6 allow 1 comparison (share 0.2) and 1 yes/no, which cannot be
    # split into a balanced pair, so none; episodes stay whole and in file order.
    assert len(mixed) == 8 and all(d.role in ("planner", "executor") for d in mixed)


def test_the_mix_keeps_yes_no_balanced_and_its_first_episodes():
    from algos.sft_data import mix_like_questions

    kinds = ["bridge"] * 4 + ["comparison"] * 2 + ["yes/no"] * 4  # shares 0.4 / 0.2 / 0.4
    keys = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    answers = {k: "no" if k in (6, 7) else "yes" if k in (8, 9) else f"a{k}" for k in keys}
    assert mix_like_questions(keys, kinds, answers) == keys  # already in the questions' shares
    answers_skewed = {**answers, 8: "no"}  # yes/no episodes 6 (no), 8 (no), 9 (yes): 3 at a share of 0.4
    kept = mix_like_questions([0, 1, 2, 3, 4, 5, 6, 8, 9], kinds, answers_skewed)
    assert kept == [0, 1, 2, 4, 6, 9]  # 3 / 0.4 = 7.5 episodes: 3 bridge, 1 comparison, 3 yes/no -> 1 yes, 1 no
    assert mix_like_questions(["line3", 1], kinds, answers) == ["line3", 1]  # no question indices: unchanged


def test_question_kinds_of_the_bundled_split():
    from algos.config import preset_config
    from algos.sft_data import question_kinds

    kinds = question_kinds(preset_config("cpu"))
    assert len(kinds) == 1325 and set(kinds) == {"bridge", "comparison", "yes/no"}
    bamboogle = preset_config("cpu", env="RedCoda-Bamboogle-v0", split="test", eval_questions=0)  # one split only
    assert question_kinds(bamboogle) is None  # no types


def test_excluded_questions_leave_no_episode(tmp_path, tokenizer):
    """The validation questions' episodes are dropped whole; lines without a question index stay."""
    lines = [_episode(i, f"a{i}", role) for i in range(4) for role in ("planner", "executor")]
    path = _write(tmp_path, *lines, GOOD)
    kept = read_demonstrations(path, tokenizer, exclude=range(2, 4))
    assert len(read_demonstrations(path, tokenizer)) == 9
    assert len(kept) == 5  # questions 0 and 1 (two contexts each) and the line without an index
