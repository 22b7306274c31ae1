"""RAGEnv through Gymnasium: registry-wide checks, scripted episodes on real rows, bad input."""

from __future__ import annotations

import json
import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

import envs
from envs.rag_env import MAX_ERROR_CHARS
from envs.rewards import RewardWeights, episode_reward
from retrievers.base import Passage

MAX_REWARD = RewardWeights().maximum


def make(env_id: str = "RedCoda-HotpotQA-v0", **kwargs):
    return gym.make(env_id, **kwargs)


@pytest.mark.parametrize("env_id", sorted(envs.ENV_IDS))
def test_check_env_passes_for_every_id(env_id, bm25):
    kwargs = {"retriever": bm25} if "Bamboogle" in env_id else {}
    env = make(env_id, **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    check_env(make(env_id, render_mode="ansi", **kwargs).unwrapped)


REGISTERED_IDS = sorted(env_id for env_id in gym.registry if env_id.startswith("RedCoda-"))


@pytest.mark.parametrize("env_id", REGISTERED_IDS)
def test_every_registered_id_makes_with_no_arguments(env_id):
    """Gymnasium's registry, not our own list: every RedCoda id a researcher can name works as `gym.make(id)`."""
    env = gym.make(env_id)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()


def test_importing_envs_starts_no_jvm_and_no_torch():
    import subprocess
    import sys

    code = "import envs, sys, jnius_config; assert not jnius_config.vm_running; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def oracle_flat_actions(example) -> list[str]:
    titles = example.gold_titles
    searches = [f"<think>I need {title}.</think><search>{title}</search>" for title in titles]
    evidence = " ".join(s for t in titles for s in example.supporting_sentences(t))
    return [
        *searches,
        f"<refine>{evidence} So the answer is {example.answer}.</refine><answer>{example.answer}</answer>",
    ]


def oracle_coda_actions(example) -> list[str]:
    actions = []
    for title in example.gold_titles:
        actions += [
            f"<think>Find {title}.</think><task>What does {title} say?</task>",
            f"<search>{title}</search>",
            f"<refine>{' '.join(example.supporting_sentences(title))} {example.answer}</refine>"
            f"<answer>{title}</answer>",
        ]
    return [*actions, f"<think>Done.</think><answer>{example.answer}</answer>"]


def run(env, index: int, actions: list[str]):
    obs, info = env.reset(options={"index": index})
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return reward, terminated, truncated, info
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("index", [0, 3, 17, 101])
def test_scripted_flat_episode_reaches_max_reward(index):
    env = make()
    example = env.unwrapped.examples[index]
    reward, terminated, truncated, info = run(env, index, oracle_flat_actions(example))
    assert terminated and not truncated
    assert info["f1"] == info["em"] == 1.0
    assert info["format"] == info["refine"] == 1.0
    assert info["recall"] == 1.0 and info["num_searches"] == len(example.gold_titles)
    assert reward == pytest.approx(MAX_REWARD)


@pytest.mark.parametrize("index", [0, 3, 17])
def test_scripted_coda_episode_reaches_max_reward(index):
    env = make("RedCoda-HotpotQA-CoDA-v0", max_planner_turns=4)
    example = env.unwrapped.examples[index]
    obs, info = env.reset(options={"index": index})
    assert info["role"] == "planner" and info["new_context"]
    roles = []
    for action in oracle_coda_actions(example):
        obs, reward, terminated, truncated, info = env.step(action)
        roles.append((info["role"], info["new_context"]))
        if info["role"] == "planner":
            assert "<information>" not in obs  # raw documents never reach the planner
    assert roles[:3] == [("executor", True), ("executor", False), ("planner", False)]
    assert terminated and not truncated
    assert info["f1"] == 1.0 and info["format"] == 1.0 and info["refine"] == 1.0 and info["recall"] == 1.0
    assert reward == pytest.approx(MAX_REWARD)


def test_wrong_answer_scores_as_the_formula_says():
    env = make()
    reward, terminated, _, info = run(env, 3, ["<search>Qazi Touqeer</search>", "<answer>Srinagar</answer>"])
    assert terminated and info["f1"] == 0.0 and info["format"] == 0.5 and info["refine"] == 0.0
    assert reward == pytest.approx(episode_reward(0.0, 0.5, 0.0)) == pytest.approx(-2.95)


def test_an_evidence_recall_weight_credits_the_gold_titles_the_searches_returned():
    """reward_weights={"recall": w} (a dict, as a run's JSON config passes it) adds w x the share of gold titles
    among the passages the episode's searches returned; the default weight 0 leaves the reward as it was."""
    actions = ["<search>Qazi Touqeer</search>", "<answer>Srinagar</answer>"]
    plain, *_, info = run(make(), 3, actions)
    credited, *_, credited_info = run(make(reward_weights={"recall": 2.0}), 3, actions)
    assert credited_info["recall"] == info["recall"] > 0
    assert credited == pytest.approx(plain + 2.0 * info["recall"])
    assert plain == pytest.approx(episode_reward(0.0, 0.5, 0.0))


def test_each_search_step_reports_the_gold_titles_it_brought_first_and_a_repeated_query():
    """A search step's info says which titles came back, how many gold titles no earlier search of the episode had
    returned, and whether the query (normalized as answers are) was searched before: what per-search credit reads."""
    env = make()
    env.reset(options={"index": 3})
    gold = {t.lower() for t in env.unwrapped._episode.example.gold_titles}
    _, _, _, _, first = env.step("<search>Qazi Touqeer</search>")
    assert first["titles"] and first["gold_titles_total"] == len(gold) == 2
    assert first["new_gold_titles"] == len({t.lower() for t in first["titles"]} & gold) > 0
    assert first["repeated_query"] is False
    _, _, _, _, again = env.step("<search>  qazi TOUQEER! </search>")  # the same query, other case and punctuation
    assert again["repeated_query"] is True and again["new_gold_titles"] == 0


def test_truncation_scores_as_no_answer():
    env = make(max_turns=2)
    reward, terminated, truncated, info = run(env, 0, ["<search>a</search>", "<search>b</search>"])
    assert truncated and not terminated and info["answer"] is None and info["f1"] == 0.0
    assert reward == pytest.approx(-3 + 0.1 * 0.25)


def test_coda_executor_limit_returns_no_answer_and_planner_limit_truncates():
    env = make("RedCoda-HotpotQA-CoDA-v0", max_executor_turns=2, max_planner_turns=2)
    env.reset(options={"index": 0})
    env.step("<task>find it</task>")
    env.step("<search>q1</search>")
    obs, _, _, _, info = env.step("<search>q2</search>")
    assert info["role"] == "planner" and info["executor_truncated"] and "<result>no answer" in obs
    assert "<information>" not in obs  # the worker's last documents never reach the planner
    obs, reward, terminated, truncated, info = env.step("<task>again</task>")
    assert info["role"] == "executor" and not truncated
    env.step("<answer>x</answer>")
    # planner used 2 turns and got control back: truncated
    assert env.unwrapped._episode.done


def test_same_seed_same_episode_and_np_random_choice():
    env = make()
    obs_a, info_a = env.reset(seed=123)
    obs_b, info_b = env.reset(seed=123)
    assert obs_a == obs_b and info_a["index"] == info_b["index"]
    indices = {env.reset(seed=s)[1]["index"] for s in range(20)}
    assert len(indices) > 10


def test_vector_env_steps_in_lockstep():
    vec = gym.make_vec("RedCoda-HotpotQA-v0", num_envs=8, vectorization_mode="sync")
    obs, info = vec.reset(seed=0, options={"index": 5})  # a GRPO group: 8 envs, one question
    assert len(set(obs)) == 1 and list(info["index"]) == [5] * 8
    actions = tuple(["<search>Ed Wood</search>"] * 4 + ["<answer>yes</answer>"] * 4)
    obs, rewards, terminated, truncated, info = vec.step(actions)
    assert list(terminated) == [False] * 4 + [True] * 4
    assert np.all(rewards[:4] == 0) and np.all(rewards[4:] < 0)
    assert all("<information>" in o for o in obs[:4])
    vec.close()


def test_distractor_setting_searches_only_own_paragraphs():
    env = make(corpus="distractor")
    obs, info = env.reset(options={"index": 3})
    own = {title for title, _ in env.unwrapped.examples[3].paragraphs}
    obs, *_, info = env.step("<search>singer born Kolkata Fame Gurukul</search>")
    titles = [line.split('(Title: "')[1].split('")')[0] for line in obs.split("Doc ")[1:]]
    assert titles and set(titles) <= own


def test_pure_python_bm25_searches_the_pooled_corpus_without_a_jvm():
    """retriever="bm25-python" (for machines without a JDK): a scripted episode over the pooled corpus reaches the
    maximum reward in a process that never starts the JVM, and the scores are BM25's formula."""
    import subprocess
    import sys

    code = (
        "import gymnasium as gym, jnius_config, envs\n"
        "from tests.test_env import oracle_flat_actions, run\n"
        "env = gym.make('RedCoda-HotpotQA-v0', retriever='bm25-python')\n"
        "reward, terminated, _, info = run(env, 0, oracle_flat_actions(env.unwrapped.examples[0]))\n"
        "assert terminated and info['recall'] == 1.0 and info['f1'] == 1.0, info\n"
        "assert not jnius_config.vm_running\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

    import math

    from retrievers.inmemory import InMemoryBM25, tokenize

    passages = [("a", "Paris", "Paris is the capital of France."), ("b", "Lyon", "Lyon is a city in France, France.")]
    passages += [(f"x{i}", f"Filler {i}", "Nothing about the query here.") for i in range(8)]
    retriever = InMemoryBM25(passages)
    hits = retriever.search("capital of France", 10)
    assert [p.doc_id for p in hits] == ["a", "b"]  # only passages holding a query term; the better one first
    lengths = [len(tokenize(f"{t} {x}")) for _, t, x in passages]
    avg = sum(lengths) / len(lengths)

    def term(tf: int, df: int, length: int) -> float:
        # Lucene's BM25 (since Lucene 8 without the constant (k1 + 1) factor); bm25s scores in float32
        idf = math.log(1 + (len(passages) - df + 0.5) / (df + 0.5))
        return idf * tf / (tf + 0.9 * (1 - 0.4 + 0.4 * length / avg))

    assert tokenize("the capital of France") == ["capit", "franc"]  # Lucene's stopwords, Snowball stems
    assert hits[0].score == pytest.approx(term(1, 1, lengths[0]) + term(1, 2, lengths[0]), rel=1e-6)
    assert hits[1].score == pytest.approx(term(2, 2, lengths[1]), rel=1e-6)
    assert retriever.search("capitals of France", 10) == hits  # stemmed: plural and singular are one term
    twice = retriever.search("capital capital of France", 10)[0].score
    assert twice == pytest.approx(2 * term(1, 1, lengths[0]) + term(1, 2, lengths[0]), rel=1e-6)


def test_top_k_and_passage_length_are_arguments():
    env = make(top_k=5, max_passage_words=10)
    env.reset(options={"index": 0})
    obs, *_ = env.step("<search>Ed Wood film</search>")
    docs = obs.strip().removeprefix("<information>").removesuffix("</information>").split("\n")
    assert len(docs) == 5
    assert all(len(d.split(") ", 1)[1].split()) <= 11 for d in docs)


@pytest.mark.parametrize("protocol_name", ["flat", "coda"])
def test_question_after_results_ends_each_search_with_the_contexts_question(protocol_name):
    env = make(protocol=protocol_name, question_after_results=True)
    obs, info = env.reset(options={"index": 0})
    asked = info["user_message"]
    if protocol_name == "coda":  # the executor's results end with its own task, not the planner's question
        obs, *_, info = env.step("<task>Who directed Ed Wood?</task>")
        asked = info["user_message"]
        assert asked == "Task: Who directed Ed Wood?"
    obs, *_ = env.step("<search>Ed Wood film</search>")
    results, question = obs.strip().rsplit("\n\n", 1)
    assert question == asked and results.endswith("</information>")
    plain = make(protocol=protocol_name)
    plain.reset(options={"index": 0})
    if protocol_name == "coda":
        plain.step("<task>Who directed Ed Wood?</task>")
    assert plain.step("<search>Ed Wood film</search>")[0].strip() == results  # otherwise the same observation


@pytest.mark.parametrize("protocol_name", ["flat", "coda"])
def test_short_instructions_open_every_context(protocol_name):
    from envs.protocol import INSTRUCTIONS, SHORT_INSTRUCTIONS

    env = make(protocol=protocol_name, instructions="short")
    obs, info = env.reset(options={"index": 0})
    short = SHORT_INSTRUCTIONS[info["role"]]
    assert obs.startswith(short) and info["system_prompt"] == short
    if protocol_name == "coda":  # the executor's fresh context too
        obs, *_, info = env.step("<task>Who directed Ed Wood?</task>")
        assert info["role"] == "executor" and obs.startswith(SHORT_INSTRUCTIONS["executor"])
    default, default_info = make(protocol=protocol_name).reset(options={"index": 0})
    assert default_info["system_prompt"] == INSTRUCTIONS[default_info["role"]] and len(default) > len(obs)
    with pytest.raises(ValueError, match="instructions must be one of"):
        make(instructions="terse")


@pytest.mark.parametrize(
    "action",
    [
        "<search>unclosed",
        "<answer>a</answer><answer>b</answer>",
        "<think><search>nested</search></think>",
        "<search>   </search>",
        "x" * (1 << 20),
        "no tags at all, just prose with ünïcödé 中文",
        "\x00\ud7ff binary-ish \U0001f600",
    ],
)
def test_agent_mistakes_are_observations(action):
    env = make()
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(action)
    assert info["invalid_action"] and "Invalid action" in obs and info["error"]
    assert reward == 0.0 and not terminated
    obs, reward, terminated, truncated, info = env.step("<answer>x</answer>")
    assert terminated and info["invalid_actions"] == 1


def test_non_ascii_query_is_searched():
    env = make()
    env.reset(options={"index": 3})
    obs, *_, info = env.step("<search>قاضی توقیر Kashmiri singer</search>")
    assert not info["invalid_action"] and "Qazi" in obs


def test_misuse_raises_clear_errors(tmp_path):
    env = make()
    with pytest.raises(ResetNeeded):
        env.unwrapped.step("<answer>x</answer>")
    env.reset(options={"index": 0})
    env.step("<answer>x</answer>")
    with pytest.raises(ResetNeeded, match="reset"):
        env.unwrapped.step("<answer>x</answer>")
    with pytest.raises(IndexError, match="out of range"):
        env.reset(options={"index": 10_000})
    with pytest.raises(FileNotFoundError):
        make(data_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no paragraphs"):
        make("RedCoda-Bamboogle-v0", corpus="distractor")
    with pytest.raises(ValueError, match="protocol"):
        make(protocol="tree")
    with pytest.raises(TypeError, match="search"):
        make(retriever=object())


def test_official_hotpotqa_json_file_loads(tmp_path):
    import json

    from envs.data import bundled_path
    from retrievers.corpus import open_text

    rows = [json.loads(line) for line, _ in zip(open_text(bundled_path("hotpotqa", "dev")), range(5), strict=False)]
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(rows))
    env = make(data_path=str(path), split="dev")
    assert env.unwrapped.num_examples == 5
    obs, info = env.reset(options={"index": 4})
    assert rows[4]["question"] in obs


def test_render_ansi_shows_the_transcript():
    env = make(render_mode="ansi")
    env.reset(options={"index": 0})
    env.step("<search>Ed Wood</search>")
    text = env.render()
    assert "[agent] <search>Ed Wood</search>" in text and "<information>" in text


def test_one_index_serves_many_envs():
    a, b = make(), make("RedCoda-HotpotQA-CoDA-v0")
    assert a.unwrapped.retriever is b.unwrapped.retriever


def test_query_cache_is_shared_and_optional():
    a, b = make(), make()
    a.reset(options={"index": 0})
    b.reset(options={"index": 0})
    a.step("<search>Ed Wood director</search>")
    hits_before = len(a.unwrapped.retriever)
    obs_b, *_ = b.step("<search>Ed Wood director</search>")
    assert len(b.unwrapped.retriever) == hits_before  # the second env's identical query was a cache hit
    uncached = make(query_cache=0)
    assert uncached.unwrapped.retriever is not a.unwrapped.retriever
    uncached.reset(options={"index": 0})
    assert uncached.step("<search>Ed Wood director</search>")[0] == obs_b


def test_reset_index_accepts_numpy_integers_and_rejects_other_types():
    env = make()
    assert env.reset(options={"index": np.int64(3)})[1]["index"] == 3
    assert env.reset(options={"index": np.uint8(4)})[1]["index"] == 4
    for bad in (True, False, 3.0, "3", np.float32(3)):
        with pytest.raises(TypeError, match="must be an int"):
            env.reset(options={"index": bad})
    with pytest.raises(IndexError, match="out of range"):
        env.reset(options={"index": np.int64(-1)})


def test_error_observations_stay_short_whatever_the_action():
    """With max_action_chars raised, a 3.6 MB action of repeated mistakes used to produce a 10 MB observation."""
    env = make(max_action_chars=5_000_000)
    env.reset(options={"index": 0})
    for action in ("</search>" * 400_000, "<search>" * 200_000 + "</answer>" * 200_000, "<b>" + "x" * 3_000_000):
        obs, reward, terminated, truncated, info = env.step(action)
        assert info["invalid_action"] and "Invalid action" in obs
        assert len(obs) <= MAX_ERROR_CHARS + 20 and len(info["error"]) <= MAX_ERROR_CHARS
        assert env.observation_space.contains(obs)
        env.reset(options={"index": 0})


def test_lone_surrogate_in_a_query_is_cleaned_not_a_failed_search():
    env = make()
    env.reset(options={"index": 0})
    obs, *_, info = env.step("<search>Ed Wood\ud800 film</search>")
    assert "retrieval_error" not in info and "Search failed" not in obs
    env.reset(options={"index": 0})
    assert env.step("<search>Ed Wood film</search>")[0] == obs
    env.step("<answer>x</answer>")


def test_settings_that_cannot_work_are_refused_at_construction():
    for kwargs in ({"max_action_chars": 0}, {"max_action_chars": -5}, {"top_k": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            make(**kwargs)
    with pytest.raises(ValueError, match="retriever_timeout"):
        make(retriever_timeout=0)
    with pytest.raises(ValueError, match="retriever_retries"):
        make(retriever_retries=-1)


def test_a_dead_server_is_counted_not_searched(bm25, serve_app):
    """Failed searches are retrieval_errors, not searches; the terminal info says what failed."""
    from retrievers.server import create_app

    url, stop = serve_app(create_app(bm25))
    env = make(retriever=url, retriever_timeout=5, retriever_retries=0)
    env.reset(options={"index": 0})
    obs, *_, info = env.step("<search>Ed Wood</search>")
    assert "<information>Doc 1" in obs
    stop()  # the server dies mid-episode
    obs, *_, info = env.step("<search>Tim Burton</search>")
    assert "Search failed (ConnectionError)" in obs and "retrieval server" in info["retrieval_error"]
    *_, terminated, _, info = env.step("<answer>x</answer>")
    assert terminated and info["num_searches"] == 1 and info["retrieval_errors"] == 1
    assert "ConnectError" in info["retrieval_error"]


def test_a_hung_server_times_out_as_the_env_arguments_say(serve_app):
    """A server that answers /health but never /retrieve: each search waits timeout x (retries + 1), then fails."""
    import threading

    from fastapi import FastAPI

    release = threading.Event()
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.post("/retrieve")(lambda: release.wait(30))
    url, stop = serve_app(app)
    try:
        env = make(retriever=url, retriever_timeout=0.2, retriever_retries=1)
        client = env.unwrapped.retriever.inner  # the shared client, behind the envs' shared query cache
        assert (client.timeout, client.retries) == (0.2, 1)
        env.reset(options={"index": 0})
        obs, *_, info = env.step("<search>Ed Wood</search>")
        assert "Search failed" in obs and "failed 2 time(s)" in info["retrieval_error"]
        assert "ReadTimeout" in info["retrieval_error"]
    finally:
        release.set()
        stop()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda rows: json.dumps(rows)[:-200], r"line 1, column \d+: not valid JSON .*truncated"),
        (lambda rows: json.dumps(rows[0]) + "\n{not json\n", "line 2: not valid JSON"),
        (lambda rows: json.dumps(rows[0]) + "\n\n[1, 2]\n", "line 3: expected a JSON object"),
        (lambda rows: json.dumps({k: v for k, v in rows[0].items() if k != "question"}), "line 1: .*no 'question'"),
    ],
)
def test_bad_data_files_name_the_file_the_line_and_the_fault(tmp_path, content, message):
    from envs.data import DataError, bundled_path
    from retrievers.corpus import open_text

    rows = [json.loads(line) for line, _ in zip(open_text(bundled_path("hotpotqa", "dev")), range(3), strict=False)]
    path = tmp_path / "hotpot_dev.json"
    path.write_text(content(rows))
    with pytest.raises(DataError, match=f"{re.escape(str(path))}: {message}"):
        make(data_path=str(path))


@pytest.mark.slow  # a whole run in its own process: the slow set keeps the default run short
def test_a_search_prints_no_java_warnings(tmp_path):
    """Starting the JVM and searching (a fresh process) writes none of Java's sun.misc.Unsafe warnings, nor
    Lucene's "Java 22 or later" MMapDirectory warning."""
    import subprocess
    import sys

    code = (
        "import gymnasium as gym, envs\n"
        "env = gym.make('RedCoda-HotpotQA-v0', split='dev')\n"
        "env.reset(options={'index': 3})\n"
        "print(env.step('<search>Qazi Touqeer</search>')[0][:40])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<information>Doc 1" in done.stdout
    assert "sun.misc.Unsafe" not in done.stderr + done.stdout
    assert "MMapDirectory" not in done.stderr + done.stdout and "WARNING" not in done.stderr


class _FixedRetriever:
    """Returns the same two passages (one with a multi-line text, one without a title) for any query."""

    passages = (
        Passage("1", "Ed Wood", "Edward Davis Wood Jr. was an American filmmaker.\nHe directed films.", 2.0),
        Passage("2", "", "A passage without a title", 1.0),
    )

    def search(self, query: str, k: int) -> list[Passage]:
        return list(self.passages[:k])

    def batch_search(self, queries, k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]


SEARCH_R1_OBSERVATION = (
    '\n\n<information>Doc 1(Title: "Ed Wood") Edward Davis Wood Jr. was an American filmmaker.\nHe directed films.'
    "\nDoc 2(Title: A passage without a title)</information>\n\n"
)
"""What Search-R1's trainer (search_r1/llm_agent/generation.py: `_passages2string`, then the <information> block it
appends after a search) shows for `_FixedRetriever`'s passages, served as Search-R1 corpus rows."""


def test_the_search_r1_observation_format_is_search_r1s_byte_for_byte():
    env = gym.make("RedCoda-HotpotQA-v0", retriever=_FixedRetriever(), observation_format="search_r1")
    env.reset(options={"index": 0})
    obs, *_ = env.step("<search>Ed Wood</search>")
    assert obs == SEARCH_R1_OBSERVATION
    ours = gym.make("RedCoda-HotpotQA-v0", retriever=_FixedRetriever(), max_passage_words=3)
    ours.reset(options={"index": 0})
    assert ours.step("<search>Ed Wood</search>")[0] == (
        '\n\n<information>Doc 1 (Title: "Ed Wood") Edward Davis Wood ...\nDoc 2 (Title: "") A passage without ...'
        "</information>\n\n"
    )
    with pytest.raises(ValueError, match="observation_format"):
        gym.make("RedCoda-HotpotQA-v0", retriever=_FixedRetriever(), observation_format="search-r1")


def test_a_paragraph_is_cut_at_each_envs_own_width_though_search_results_remember_it():
    def shown(words: int) -> str:
        env = gym.make("RedCoda-HotpotQA-v0", retriever=_FixedRetriever(), max_passage_words=words)
        env.reset(options={"index": 0})
        return env.step("<search>Ed Wood</search>")[0].split("\n")[2]

    assert [shown(3), shown(5), shown(3), shown(11)] == [
        '<information>Doc 1 (Title: "Ed Wood") Edward Davis Wood ...',
        '<information>Doc 1 (Title: "Ed Wood") Edward Davis Wood Jr. was ...',
        '<information>Doc 1 (Title: "Ed Wood") Edward Davis Wood ...',
        '<information>Doc 1 (Title: "Ed Wood") Edward Davis Wood Jr. was an American filmmaker. He directed films.',
    ]


def test_the_class_docstring_example_prints_what_it_says():
    import doctest

    from envs.rag_env import RAGEnv

    finder = doctest.DocTestFinder(recurse=False)
    [test] = finder.find(RAGEnv, "RAGEnv", globs={})
    result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test)
    assert result.attempted >= 8 and result.failed == 0


def test_spaces_hash_consistently_with_equality():
    from envs.spaces import UnicodeText

    env = make()
    assert hash(env.action_space) == hash(UnicodeText(env.action_space.max_length))
    assert {env.action_space: "action"}[UnicodeText(env.action_space.max_length)] == "action"
    assert UnicodeText(10) != UnicodeText(11) and len({UnicodeText(10), UnicodeText(10), UnicodeText(11)}) == 2


def test_pure_python_bm25_keeps_the_retriever_contract(hotpot_corpus, check_retriever):
    from retrievers.inmemory import InMemoryBM25

    retriever = InMemoryBM25.for_corpus(hotpot_corpus)
    check_retriever(retriever, ["Who directed Ed Wood?", "Scott Derrickson nationality", "capitals of France"], 5)
    assert retriever.search("Ed Wood film", 1)[0].title == "Ed Wood (film)"
    assert retriever.search("the of and", 3) == [] and retriever.batch_search([], 3) == []
    assert InMemoryBM25([]).search("Ed Wood", 3) == []


def test_vector_autoreset_keeps_each_env_on_its_groups_question_when_asked():
    def play(**kwargs):
        vec = gym.make_vec("RedCoda-HotpotQA-v0", num_envs=4, vectorization_mode="sync", **kwargs)
        vec.reset(seed=0, options={"index": 5})
        asked = []
        for _ in range(3):
            *_, terminated, _, info = vec.step(("<answer>yes</answer>",) * 4)
            assert all(terminated)
            obs, *_, info = vec.step(("<answer>yes</answer>",) * 4)  # the autoreset step: each env starts anew
            asked.append(list(info["index"]))
        vec.close()
        return asked

    assert play(autoreset_same_question=True) == [[5] * 4] * 3
    assert any(indices != [5] * 4 for indices in play())  # the default: a question drawn with np_random


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_turns": float("nan")}, "max_turns"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 2.5}, "max_turns"),
        ({"max_planner_turns": True}, "max_planner_turns"),
        ({"top_k": float("nan")}, "top_k"),
        ({"top_k": 10**10}, "top_k"),
        ({"max_passage_words": float("inf")}, "max_passage_words"),
        ({"retriever_timeout": float("inf")}, "retriever_timeout"),
        ({"retriever_timeout": float("nan")}, "retriever_timeout"),
        ({"retriever_timeout": 0}, "retriever_timeout"),
        ({"retriever_retries": -1}, "retriever_retries"),
        ({"reward_weights": {"recall": float("nan")}}, "recall"),
        ({"reward_weights": {"answer": float("inf")}}, "answer"),
    ],
)
@pytest.mark.parametrize("env_id", ["RedCoda-HotpotQA-v0", "RedCoda-HotpotQA-CoDA-v0"])
def test_harmful_arguments_are_refused_at_make(env_id, kwargs, named):
    """NaN, infinite and out-of-range settings would run (never truncating, failing every search, a NaN reward);
    they raise at construction instead, naming the argument."""
    with pytest.raises(ValueError, match=named):
        gym.make(env_id, corpus="distractor", **kwargs)
