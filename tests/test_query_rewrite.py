"""QueryRewriteEnv: check_env, scripted rewrites on real HotpotQA rows and a real Lucene index, own data, bad input."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

import envs
from envs.data import load_examples
from envs.query_rewrite import parse_query

ENV_ID = "RedCoda-QueryRewrite-v0"


def test_registered_and_passes_check_env(bm25):
    assert ENV_ID in envs.OTHER_ENV_IDS
    check_env(gym.make(ENV_ID).unwrapped, skip_render_check=True)
    check_env(gym.make(ENV_ID, render_mode="ansi", action_format="raw").unwrapped)


@pytest.mark.parametrize("index", [0, 3, 17, 101])
def test_gold_titles_as_the_query_find_every_gold_paragraph(index):
    env = gym.make(ENV_ID)
    obs, info = env.reset(options={"index": index})
    example = load_examples("hotpotqa", "train")[index]
    assert f"Question: {example.question}" in obs and "<query>" in info["system_prompt"]
    action = f"<think>The paragraphs are about {' and '.join(example.gold_titles)}.</think><query>"
    obs, reward, terminated, truncated, info = env.step(action + " ".join(example.gold_titles) + "</query>")
    assert terminated and not truncated and not info["invalid_action"]
    assert reward == info["recall_at_k"] == 1.0 and info["mrr"] == 1.0
    assert len(info["retrieved_ids"]) == info["k"] == 5
    corpus = env.unwrapped.retriever.corpus
    gold_titles = {corpus.passage(i).title for group in info["gold_doc_ids"] for i in group}
    assert gold_titles == set(example.gold_titles)
    assert obs.count("Doc ") == 5 and all(f'(Title: "{t}")' in obs for t in example.gold_titles)


def test_the_question_itself_is_a_weaker_query_than_the_titles():
    env = gym.make(ENV_ID)
    recalls = []
    for index in range(40):
        env.reset(options={"index": index})
        question = env.unwrapped.examples[index].question
        recalls.append(env.step(f"<query>{question}</query>")[1])
    assert 0.3 < np.mean(recalls) < 1.0  # room to learn: the titles reach 1.0


def test_info_matches_the_metrics_and_k_is_an_argument():
    env = gym.make(ENV_ID, k=2)
    env.reset(options={"index": 0})  # gold: Alan Campbell (actor), Jake and the Fatman
    obs, reward, *_, info = env.step("<query>Jake and the Fatman</query>")
    assert len(info["retrieved_ids"]) == 2 and reward == info["recall_at_k"] == 0.5
    assert info["mrr"] == 1.0 and info["query"] == "Jake and the Fatman"


def test_a_paragraph_stored_twice_is_one_gold_paragraph():
    env = gym.make(ENV_ID)
    index = next(i for i, ex in enumerate(env.unwrapped.examples) if ex.id == "5ac23f9555429951e9e684db")
    group = next(g for g in env.unwrapped.examples[index].gold_doc_ids if len(g) > 1)
    assert sorted(group) == ["3508", "9425"]  # "Harry Morgan" is in the bundled corpus twice
    groups = len(env.unwrapped.examples[index].gold_doc_ids)
    env.reset(options={"index": index})
    *_, info = env.step("<query>Harry Morgan</query>")
    assert info["retrieved_ids"][:2] in (["3508", "9425"], ["9425", "3508"])
    hit = [any(i in info["retrieved_ids"] for i in g) for g in info["gold_doc_ids"]]
    assert info["recall_at_k"] == sum(hit) / groups  # both copies retrieved, counted once


@pytest.mark.parametrize(
    ("action", "error"),
    [
        ("Scott Derrickson nationality", "exactly one <query>"),
        ("<query>a</query><query>b</query>", "exactly one <query>"),
        ("<query>unclosed", "exactly one <query>"),
        ("</query>backwards<query>", "exactly one <query>"),
        ("<query>   </query>", "empty query"),
        ("<query>" + "word " * 300 + "</query>", "over the limit of 1024"),
        ("x" * (1 << 20), "over the limit of 16384"),
        ("\x00\ud7ff \U0001f600", "exactly one <query>"),
    ],
)
def test_agent_mistakes_are_observations(action, error):
    env = gym.make(ENV_ID)
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(action)
    assert info["invalid_action"] and error in info["error"] and "Invalid action" in obs
    assert reward == 0.0 and terminated and not truncated and info["retrieved_ids"] == []


def test_raw_action_format_and_non_ascii_queries():
    env = gym.make(ENV_ID, action_format="raw")
    obs, info = env.reset(options={"index": 3})
    assert "<query>" not in obs
    *_, info = env.step("  قاضی توقیر Qazi Touqeer singer  ")
    assert not info["invalid_action"] and info["query"] == "قاضی توقیر Qazi Touqeer singer"
    assert parse_query("<QUERY> a b </Query >") == ("a b", None)


def test_seeded_resets_and_misuse():
    env = gym.make(ENV_ID)
    assert env.reset(seed=7)[1]["index"] == env.reset(seed=7)[1]["index"]
    assert len({env.reset(seed=s)[1]["index"] for s in range(20)}) > 10
    with pytest.raises(IndexError, match="out of range"):
        env.reset(options={"index": 10_000})
    env.reset(options={"index": np.int64(1)})
    env.step("<query>x</query>")
    with pytest.raises(ResetNeeded):
        env.unwrapped.step("<query>x</query>")
    with pytest.raises(ValueError, match="data_path"):
        gym.make(ENV_ID, dataset="musique", split="dev")
    with pytest.raises(ValueError, match="action_format"):
        gym.make(ENV_ID, action_format="json")
    with pytest.raises(TypeError, match="search"):
        gym.make(ENV_ID, retriever=object())


def test_a_failing_retriever_scores_zero_without_crashing(bm25):
    class Broken:
        def search(self, query, k):
            raise ConnectionError("server down")

        def batch_search(self, queries, k):
            raise ConnectionError("server down")

    env = gym.make(ENV_ID, retriever=Broken())
    env.reset(options={"index": 0})
    obs, reward, terminated, _, info = env.step("<query>Ed Wood</query>")
    assert reward == 0.0 and terminated and "server down" in info["retrieval_error"] and "Search failed" in obs
    assert info["retrieval_errors"] == 1 and info["num_searches"] == 0  # what the trainer counts


def test_a_group_of_envs_shares_one_question_and_one_index():
    vec = gym.make_vec(ENV_ID, num_envs=4, vectorization_mode="sync")
    obs, info = vec.reset(seed=0, options={"index": 0})
    assert len(set(obs)) == 1
    queries = (
        "<query>Jake and the Fatman Alan Campbell</query>",
        "<query>Joe Penny</query>",
        "bad",
        "<query>CBS</query>",
    )
    _, rewards, terminated, _, info = vec.step(queries)
    assert all(terminated) and rewards[0] == 1.0 and rewards[2] == 0.0 and list(info["invalid_action"])[2]
    vec.close()
    assert gym.make(ENV_ID).unwrapped.retriever is gym.make(ENV_ID, split="dev").unwrapped.retriever


@pytest.fixture(scope="module")
def own_files(tmp_path_factory):
    """A corpus file of real paragraphs (the first 15 dev questions' own paragraphs) and a query file over it."""
    root = tmp_path_factory.mktemp("own")
    examples = load_examples("hotpotqa", "dev")[:15]
    ids: dict[str, str] = {}
    with open(root / "corpus.jsonl", "w") as f:
        for example in examples:
            for title, text in example.paragraphs:
                if title not in ids:
                    ids[title] = f"p{len(ids)}"
                    f.write(json.dumps({"doc_id": ids[title], "title": title, "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for example in examples:
            f.write(json.dumps({"query": example.question, "relevant_doc_ids": [ids[t] for t in example.gold_titles]}))
            f.write("\n")
    return root, examples, ids


def test_own_query_and_corpus_files(own_files):
    root, examples, ids = own_files
    env = gym.make(ENV_ID, data_path=str(root / "queries.jsonl"), corpus_path=str(root / "corpus.jsonl"))
    check_env(env.unwrapped, skip_render_check=True)
    assert env.unwrapped.num_examples == len(examples)
    for index in (0, 5):
        obs, info = env.reset(options={"index": index})
        assert examples[index].question in obs and info["id"] == str(index)
        *_, info = env.step(f"<query>{' '.join(examples[index].gold_titles)}</query>")
        assert info["recall_at_k"] == 1.0 and set(info["retrieved_ids"]) <= set(ids.values())


def test_own_files_with_any_retriever_and_bad_files(own_files, tmp_path):
    from envs.query_rewrite import load_corpus_file
    from retrievers.inmemory import InMemoryBM25

    root, examples, ids = own_files
    corpus = load_corpus_file(str(root / "corpus.jsonl"))
    retriever = InMemoryBM25(list(zip(corpus.doc_ids, corpus.titles, corpus.texts, strict=True)))
    env = gym.make(ENV_ID, data_path=str(root / "queries.jsonl"), retriever=retriever)
    env.reset(options={"index": 1})
    *_, info = env.step(f"<query>{' '.join(examples[1].gold_titles)}</query>")
    assert info["recall_at_k"] == 1.0

    with pytest.raises(ValueError, match="corpus_path"):
        gym.make(ENV_ID, data_path=str(root / "queries.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "relevant_doc_ids": ["nope"]}) + "\n")
    with pytest.raises(ValueError, match="not in"):
        gym.make(ENV_ID, data_path=str(bad), corpus_path=str(root / "corpus.jsonl"))
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="relevant_doc_ids"):
        gym.make(ENV_ID, data_path=str(bad), corpus_path=str(root / "corpus.jsonl"))
    with pytest.raises(FileNotFoundError):
        gym.make(ENV_ID, data_path=str(tmp_path / "missing.jsonl"), retriever=retriever)
