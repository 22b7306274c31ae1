"""The oracle teacher on real rows and the real BM25 index: perfect answers, exact records, valid JSONL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.oracle import OracleAgent, _quote, base_title, demonstration_record, main
from agents.samplers import encode_chat
from envs.protocol import EXECUTOR_INSTRUCTIONS, PLANNER_INSTRUCTIONS
from envs.rewards import RewardWeights, is_yes_no

ROOT = Path(__file__).resolve().parents[1]
ENV_IDS = {"flat": "RedCoda-HotpotQA-v0", "coda": "RedCoda-HotpotQA-CoDA-v0"}
ORACLE_ENV = {"split": "dev", "max_turns": 6, "max_planner_turns": 6, "max_executor_turns": 4}
"""The env settings `python -m agents.oracle` uses."""
ROWS = list(range(16))


@pytest.fixture(scope="module")
def tokenizer():
    from agents.models import smollm2_tokenizer

    return smollm2_tokenizer()


def tokenizer_text(generation) -> str:
    from agents.models import smollm2_tokenizer

    return smollm2_tokenizer().decode(generation.token_ids)


def masked_runs(generation) -> list[list[int]]:
    """Token ids of each run of loss-masked tokens, in order."""
    out: list[list[int]] = []
    previous = 0
    for token, mask in zip(generation.token_ids, generation.loss_mask, strict=True):
        if mask and not previous:
            out.append([])
        if mask:
            out[-1].append(token)
        previous = mask
    return out


@pytest.fixture(scope="module", params=["flat", "coda"])
def episodes(request, bm25, tokenizer):
    """(protocol, envs, trajectories) of the oracle on the first 16 dev questions."""
    env_list = [gym.make(ENV_IDS[request.param], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
    trajectories = OracleAgent(tokenizer, seed=0).rollout(env_list, ROWS, seed=0)
    return request.param, env_list, trajectories


def test_oracle_answers_perfectly_and_grounds_what_it_can(episodes):
    protocol, env_list, trajectories = episodes
    assert [t.example_index for t in trajectories] == ROWS
    for trajectory in trajectories:
        info = trajectory.info
        assert info["f1"] == info["em"] == 1.0 and info["answered"] and info["invalid_actions"] == 0
        assert info["num_searches"] >= 1
        queries = re.findall(r"<search>(.*?)</search>", "".join(trajectory.actions))
        assert len(queries) == len(set(queries)), "a query is never repeated"
        for generation in trajectory.generations:  # a later query never asks for a passage already shown
            text = tokenizer_text(generation)
            for query in re.findall(r"<search>(.*?)</search>", text)[1:]:
                shown = re.findall(r'Doc \d+ \(Title: "(.*?)"\)', text.split(f"<search>{query}</search>", 1)[0])
                assert query not in shown, f"{query!r} was already shown"
        if not info["oracle_grounded"]:
            continue
        assert info["format"] == info["refine"] == 1.0
        assert trajectory.reward == pytest.approx(RewardWeights().maximum)
        example = env_list[0].unwrapped.examples[trajectory.example_index]
        for generation in trajectory.generations:
            if generation.role == "planner":
                continue
            text = tokenizer_text(generation)
            asked = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            episode = text.split("<|im_start|>assistant", 1)[1]
            for i, query in enumerate(re.findall(r"<search>(.*?)</search>", episode)):
                before = episode.split(f"<search>{query}</search>", 1)[0]
                if i == 0:  # the question (or the task) itself
                    assert asked.endswith(query)
                else:  # a title already shown in the question or a passage: a copy, never a guess
                    assert query.lower() in (asked + before).lower()
        quote = re.findall(r"<refine>(.*?)</refine>", "".join(trajectory.actions), re.S)[-1]
        if example.answer.lower() not in ("yes", "no"):
            assert example.answer.lower() in quote.lower(), "the answer is read from quoted evidence"
    grounded = [t for t in trajectories if t.info["oracle_grounded"]]
    assert len(grounded) >= 4
    assert len({t.info["num_searches"] for t in grounded}) > 1, "demonstrations vary in their number of searches"


def test_oracle_masks_hold_exactly_its_actions(episodes, tokenizer):
    protocol, _, trajectories = episodes
    for trajectory in trajectories:
        written = [tokenizer.decode(run) for g in trajectory.generations for run in masked_runs(g)]
        assert sorted(written) == sorted(trajectory.actions)
        for generation in trajectory.generations:
            assert generation.loss_mask[0] == 0 and generation.role in ("agent", "planner", "executor")


@pytest.mark.parametrize("episodes", ["coda"], indirect=True)
def test_coda_oracle_contexts_are_decoupled(episodes, tokenizer):
    _, _, trajectories = episodes
    for trajectory in trajectories:
        roles = [g.role for g in trajectory.generations]
        assert roles[-1] == "planner" and roles.count("planner") == 1
        assert roles.count("executor") == trajectory.info["num_tasks"] >= 1
        planner = tokenizer.decode(trajectory.generations[-1].token_ids)
        assert "<information>" not in planner and "Doc 1 (Title:" not in planner
        tasks = re.findall(r"<task>(.*?)</task>", "".join(trajectory.actions))
        for generation, task in zip(trajectory.generations[:-1], tasks, strict=True):
            messages = [
                {"role": "system", "content": EXECUTOR_INSTRUCTIONS},
                {"role": "user", "content": f"Task: {task.strip()}"},
            ]
            prompt = encode_chat(tokenizer, messages)
            assert list(generation.token_ids[: len(prompt)]) == prompt
            text = tokenizer.decode(generation.token_ids)
            assert PLANNER_INSTRUCTIONS not in text and "<result>" not in text


def test_demonstration_records_round_trip(episodes, tokenizer):
    protocol, env_list, trajectories = episodes
    for trajectory in trajectories:
        record = json.loads(json.dumps(demonstration_record(trajectory, tokenizer, env_list[0])))
        assert record["protocol"] == protocol and record["index"] == trajectory.example_index
        assert record["id"] == env_list[0].unwrapped.examples[trajectory.example_index].id
        assert record["f1"] == 1.0
        assert record["reward"] == pytest.approx(RewardWeights().maximum) or not record["grounded"]
        assert [c["role"] for c in record["contexts"]] == [g.role for g in trajectory.generations]
        for context, generation in zip(record["contexts"], trajectory.generations, strict=True):
            roles = [m["role"] for m in context["messages"]]
            assert roles[0] == "observation" and all(a != b for a, b in zip(roles, roles[1:], strict=False))
            assistant = [m["content"] for m in context["messages"] if m["role"] == "assistant"]
            assert assistant == [tokenizer.decode(run) for run in masked_runs(generation)]
            assert "".join(m["content"] for m in context["messages"]) == tokenizer.decode(generation.token_ids)
            # what SFT readers do: re-tokenize message by message, mask the assistant messages
            ids, mask = [], []
            for message in context["messages"]:
                piece = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(message["role"] == "assistant")] * len(piece)
            assert (tuple(ids), tuple(mask)) == (generation.token_ids, generation.loss_mask)


def _check_jsonl(path: Path, protocol: str, n: int) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == n
    for i, line in enumerate(lines):
        record = json.loads(line)
        assert set(record) == {"id", "index", "protocol", "reward", "f1", "grounded", "contexts"}
        assert record["index"] == i and record["protocol"] == protocol and record["f1"] == 1.0
        if record["grounded"]:
            assert record["reward"] == pytest.approx(RewardWeights().maximum)
        for context in record["contexts"]:
            assert context["messages"] and all(m["role"] in ("assistant", "observation") for m in context["messages"])
            assert any(m["role"] == "assistant" and "<answer>" in m["content"] for m in context["messages"])


def test_oracle_cli_writes_valid_jsonl(tmp_path):
    out = tmp_path / "oracle.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "agents.oracle", "--split", "dev", "--limit", "5", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote 5 demonstrations" in done.stdout and "mean F1 1.000" in done.stdout
    _check_jsonl(out, "flat", 5)


def test_oracle_main_writes_coda_demonstrations(tmp_path, bm25, capsys):
    out = tmp_path / "coda.jsonl"
    main(["--split", "dev", "--protocol", "coda", "--limit", "5", "--batch", "3", "--out", str(out)])
    assert "wrote 5 demonstrations" in capsys.readouterr().out
    _check_jsonl(out, "coda", 5)


def test_quotes_centre_on_the_answer_not_on_a_name_that_starts_like_it():
    text = (
        "Cosmos was a Latvian a cappella band that formed in Riga in 2002. The band comprised singers Janis "
        "Sipkevics, Andris Sejans (both countertenors), Juris Lisenko (tenor), Janis Ozols (baritone), Janis "
        "Strazdins (bass) and Reinis Sejans (rhythm)."
    )
    quote = _quote(text, "Janis Strazdins", 12)
    assert "Janis Strazdins" in quote and len(quote.split()) == 12
    assert _quote(text, "Riga", 12) == "was a Latvian a cappella band that formed in Riga in 2002."  # 13 words: one cut
    long_answer = "Sipkevics, Andris Sejans (both countertenors), Juris Lisenko (tenor), Janis Ozols"
    assert long_answer in _quote(text, long_answer, 5)  # an answer longer than the cut is kept whole
    assert _quote(text, "Vilnius", 12) is None


def test_without_quotes_the_oracle_acts_the_same_and_answers_directly(episodes, bm25, tokenizer):
    protocol, _, quoting = episodes
    env_list = [gym.make(ENV_IDS[protocol], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
    plain = OracleAgent(tokenizer, seed=0, quote_words=0).rollout(env_list, ROWS, seed=0)
    for quoted, bare in zip(quoting, plain, strict=True):
        assert bare.info["f1"] == 1.0 and bare.info["oracle_grounded"] == quoted.info["oracle_grounded"]
        assert not any("<refine>" in action for action in bare.actions)
        assert [a for a in bare.actions if "<answer>" not in a] == [a for a in quoted.actions if "<answer>" not in a]
        assert re.findall(r"<answer>.*?</answer>", bare.actions[-1]) == re.findall(
            r"<answer>.*?</answer>", quoted.actions[-1]
        )
    with pytest.raises(ValueError, match="quote_words"):
        OracleAgent(tokenizer, quote_words=-1)


def test_following_the_bridge_searches_a_named_missing_title_even_when_the_answer_is_shown(episodes, bm25, tokenizer):
    """`follow_bridge`: wherever the default oracle answered from its first results while a gold title was still
    missing and named in what it read, it searches that title next; otherwise it acts as before."""
    protocol, _, default = episodes
    env_list = [gym.make(ENV_IDS[protocol], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
    following = OracleAgent(tokenizer, seed=0, follow_bridge=True).rollout(env_list, ROWS, seed=0)
    followed = 0
    for before, after in zip(default, following, strict=True):
        example = env_list[0].unwrapped.examples[before.example_index]
        assert after.info["f1"] == 1.0 and after.info["num_searches"] >= before.info["num_searches"]
        if is_yes_no(example.answer):
            assert after.actions == before.actions  # yes/no: the evidence rule already asks for both passages
            continue
        queries = [re.findall(r"<search>(.*?)</search>", "".join(acts)) for acts in (before.actions, after.actions)]
        if queries[1] != queries[0]:
            followed += 1
            assert queries[1][: len(queries[0])] == queries[0] and len(queries[1]) == len(queries[0]) + 1
            extra = queries[1][-1]
            assert any(extra in (title, base_title(title)) for title in example.gold_titles)
            assert after.info["oracle_grounded"] == before.info["oracle_grounded"]
    assert followed >= 2, "the first 16 dev questions hold bridge questions whose answer the first results show"


def test_a_minimum_of_two_searches_makes_the_second_search_the_rule(episodes, bm25, tokenizer):
    """`min_searches=2`: every episode (flat) or task (coda) searches twice before answering wherever a gold title
    it can copy remains, the first query unchanged and the second a gold title named in the question or the
    results; the answers, their grounding and the episodes that already searched twice stay as they were."""
    protocol, _, default = episodes
    env_list = [gym.make(ENV_IDS[protocol], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
    twice = OracleAgent(tokenizer, seed=0, min_searches=2).rollout(env_list, ROWS, seed=0)
    added = 0
    for before, after in zip(default, twice, strict=True):
        example = env_list[0].unwrapped.examples[before.example_index]
        assert after.info["f1"] == 1.0 and after.info["oracle_grounded"] == before.info["oracle_grounded"]
        queries = [re.findall(r"<search>(.*?)</search>", "".join(acts)) for acts in (before.actions, after.actions)]
        assert queries[1][: len(queries[0][:1])] == queries[0][:1]
        if len(queries[0]) >= 2:
            assert after.actions == before.actions
            continue
        if queries[1] != queries[0]:
            added += 1
            assert len(queries[1]) == 2
            assert any(queries[1][1] in (title, base_title(title)) for title in example.gold_titles)
    assert added >= 4, "most of the first 16 dev questions answer from their first results by default"
    with pytest.raises(ValueError, match="min_searches"):
        OracleAgent(tokenizer, min_searches=0)


def test_results_queries_read_the_second_query_off_the_results(episodes, bm25, tokenizer):
    """`results_queries` with `min_searches=2`: a second search added after the answer already shows names a gold
    title that the first results name and the question does not, never one copied from the question (the default
    `min_searches=2` copies one there on some of these rows); the answers and their grounding stay perfect."""
    protocol, _, default = episodes
    queries_of = {}
    for name, options in {"plain": {}, "results": {"results_queries": True}}.items():
        env_list = [gym.make(ENV_IDS[protocol], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
        trajectories = OracleAgent(tokenizer, seed=0, min_searches=2, **options).rollout(env_list, ROWS, seed=0)
        queries_of[name] = [re.findall(r"<search>(.*?)</search>", "".join(t.actions)) for t in trajectories]
        assert all(t.info["f1"] == 1.0 for t in trajectories)
    examples = env_list[0].unwrapped.examples
    copied = {"plain": 0, "results": 0}
    read_off = 0
    for before, plain, results in zip(default, queries_of["plain"], queries_of["results"], strict=True):
        example = examples[before.example_index]
        if before.info["num_searches"] != 1 or is_yes_no(example.answer):
            continue  # the first results showed the answer: any second search is the one min_searches adds
        for name, queries in (("plain", plain), ("results", results)):
            copied[name] += len(queries) >= 2 and queries[1].lower() in example.question.lower()
        if len(results) >= 2:
            read_off += 1
            assert results[1].lower() not in example.question.lower()
            assert any(results[1] in (title, base_title(title)) for title in example.gold_titles)
    assert copied["results"] == 0 and copied["plain"] >= 1 and read_off >= 1


def test_restating_the_question_opens_every_answering_turn_with_it(episodes, bm25, tokenizer):
    """`restate_question`: the same episodes, each answering turn preceded by <think> and the question it answers
    (flat and planner: the question; executor: its task); the env scores them as before."""
    protocol, _, default = episodes
    env_list = [gym.make(ENV_IDS[protocol], retriever=bm25, **ORACLE_ENV) for _ in ROWS]
    restating = OracleAgent(tokenizer, seed=0, restate_question=True).rollout(env_list, ROWS, seed=0)
    for before, after in zip(default, restating, strict=True):
        example = env_list[0].unwrapped.examples[before.example_index]
        assert after.info["f1"] == 1.0 and after.info["oracle_grounded"] == before.info["oracle_grounded"]
        assert after.reward == pytest.approx(before.reward)
        assert len(after.actions) == len(before.actions)
        tasks = [example.question]
        for old, new in zip(before.actions, after.actions, strict=True):
            tasks += re.findall(r"<task>(.*?)</task>", old)
            if "<answer>" not in old:
                assert new == old
                continue
            restated = re.fullmatch(r"<think>(.*?)</think>\n(.*)", new, flags=re.S)
            assert restated and restated.group(2) == old
            assert restated.group(1) in {t.strip() for t in tasks}
        final = re.fullmatch(r"<think>(.*?)</think>\n.*", after.actions[-1], flags=re.S)
        assert final and final.group(1) == example.question.strip()  # the last answer is the episode's


def test_the_oracle_reads_search_r1_observations_too(bm25, tokenizer):
    """In Search-R1's observation format (``Doc 1(Title: "..") text``, whole passages) the oracle sees what was shown:
    it grounds its answers and never searches a title already shown, as in ours."""
    env_list = [gym.make(ENV_IDS["flat"], retriever=bm25, observation_format="search_r1", **ORACLE_ENV) for _ in ROWS]
    trajectories = OracleAgent(tokenizer, seed=0).rollout(env_list, ROWS, seed=0)
    grounded = [t for t in trajectories if t.info["oracle_grounded"]]
    assert len(grounded) >= 4 and all(t.info["f1"] == 1.0 for t in trajectories)
    for trajectory in trajectories:
        text = tokenizer_text(trajectory.generations[0]).split("<|im_start|>assistant", 1)[1]  # after the prompt
        for query in re.findall(r"<search>(.*?)</search>", text)[1:]:
            shown = re.findall(r'Doc \d+\(Title: "(.*?)"\)', text.split(f"<search>{query}</search>", 1)[0])
            assert shown and query not in shown, f"{query!r} was already shown"
