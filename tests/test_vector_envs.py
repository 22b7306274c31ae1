"""Gymnasium's vector envs with Gymnasium's defaults: the async vector env (its observations in shared memory) returns
what the env returns; the text spaces carry any Unicode within their length, which the env's observations respect;
pickling an env says how to build it in a worker."""

from __future__ import annotations

import json
import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces.utils import flatten, unflatten
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

import envs
from envs.spaces import CODE_POINTS, UnicodeText

TEXTS = [
    "",
    "plain",
    'Doc 1 (Title: "Zürich") 中文, 日本語; é\n\t<search>x</search>',
    "emoji \U0001f600 and a lone \ud800",
]


def test_the_async_vector_env_returns_what_the_env_returns():
    """`gym.make_vec(..., vectorization_mode="async")` with its defaults (shared memory on): the reset and the steps
    give each env's own observation, whatever its characters (the passages' commas, quotes and non-ASCII letters)."""
    actions = ["<search>Qazi Touqeer</search>", "<answer>Kolkata</answer>"]
    single = gym.make("RedCoda-HotpotQA-v0")
    expected_reset, _ = single.reset(seed=0, options={"index": 3})
    expected_search = single.step(actions[0])[0]
    vec = gym.make_vec("RedCoda-HotpotQA-v0", num_envs=2, vectorization_mode="async")
    try:
        obs, info = vec.reset(seed=0, options={"index": 3})
        assert obs == (expected_reset, expected_reset) and list(info["index"]) == [3, 3]
        obs, reward, terminated, truncated, _ = vec.step(actions)
        assert obs[0] == expected_search and any(not c.isascii() for c in obs[0])  # a passage's own letters
        assert list(terminated) == [False, True] and list(truncated) == [False, False] and reward[1] > 0
    finally:
        vec.close()


@pytest.mark.parametrize("text", TEXTS)
def test_the_text_space_carries_any_unicode_through_gymnasium(text):
    """Flattening (a Text's characters as int32 indexes into its character set: here, code points) and the vector
    env's shared memory give the text back; a longer text than the space admits is refused, not cut silently."""
    space = UnicodeText(96)
    assert space.contains(text) and all(c in space.character_set for c in text)
    flat = flatten(space, text)
    assert flat.shape == (96,) and flat.dtype == np.int32 and (flat[len(text) :] == CODE_POINTS).all()
    assert unflatten(space, flat) == text
    memory = create_shared_memory(space, n=2)
    observations = read_from_shared_memory(space, memory, n=2)  # read once, as the vector env does, then written
    write_to_shared_memory(space, 1, text, memory)
    write_to_shared_memory(space, 0, "other", memory)
    assert observations == ("other", text)
    with pytest.raises(ValueError, match="longer than"):
        flatten(space, text + "x" * 97)


def test_samples_stay_in_the_sample_charset():
    space = UnicodeText(40, seed=3)
    samples = [space.sample() for _ in range(20)]
    assert all(space.contains(s) and set(s) <= set(space.characters) for s in samples)
    assert len(space.sample(mask=(7, None))) == 7
    with pytest.raises(ValueError, match="length only"):
        space.sample(mask=(3, np.ones(5, dtype=np.int8)))


def test_an_observation_longer_than_the_space_is_cut_to_it_and_says_so(tmp_path):
    """Whole passages (``observation_format="search_r1"``) of a corpus of huge paragraphs: the observation is cut to
    the space's length, ends with a line that says so, and ``info["observation_cut"]`` holds its full length."""
    corpus = tmp_path / "huge.jsonl"
    rows = [{"id": str(i), "contents": f'"Huge {i}"\n' + "Kolkata river " * 50_000} for i in range(3)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = gym.make(
        "RedCoda-HotpotQA-v0", corpus_path=str(corpus), retriever="bm25-python", observation_format="search_r1"
    )
    env.reset(seed=0, options={"index": 0})
    obs, _, _, _, info = env.step("<search>Kolkata river</search>")
    bound = env.observation_space.max_length
    assert info["observation_cut"] > bound == len(obs) and env.observation_space.contains(obs)
    assert obs.endswith(f"[observation cut from {info['observation_cut']} to {bound} characters]\n")
    obs, _, _, _, info = env.step("<answer>Kolkata</answer>")
    assert "observation_cut" not in info


@pytest.mark.parametrize("env_id", ["RedCoda-HotpotQA-v0", "RedCoda-QueryRewrite-v0"])
def test_pickling_an_env_says_how_to_build_it_in_a_worker(env_id):
    env = gym.make(env_id)
    with pytest.raises(TypeError, match=rf'build the env in the worker, e.g. send `lambda: gym.make\("{env_id}"'):
        pickle.dumps(env)
    assert env_id in envs.ENV_IDS or env_id in envs.OTHER_ENV_IDS
