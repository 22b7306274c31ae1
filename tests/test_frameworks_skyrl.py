"""RedCoda's env in SkyRL-gym, through skyrl_gym's own registry and API (make, init, step, get_metrics)."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

import envs
from envs.frameworks import json_roundtrip
from envs.frameworks.skyrl import SKYRL_ENV_ID, EpisodeOver, RedCodaSkyRLEnv, skyrl_rows

QAZI = ["<think>Who is Qazi?</think><search>Qazi Touqeer</search>", "<answer>Kolkata</answer>"]


def test_redcoda_is_in_skyrl_gym_s_registry_and_plays_an_oracle_episode():
    assert SKYRL_ENV_ID in skyrl_gym.registry
    [row] = skyrl_rows(indices=[3])
    assert row["env_class"] == "redcoda" and row["reward_spec"]["ground_truth"]["target"] == ["Kolkata"]
    env = skyrl_gym.make(row["env_class"], env_config={}, extras={**row, "max_turns": 4})  # as SkyRL's generator
    assert isinstance(env, BaseTextEnv)
    chat, info = env.init(row["prompt"])
    assert chat == row["prompt"] and chat[1]["content"].startswith("Question: Qazi") and info["index"] == 3
    outputs = [env.step(action) for action in QAZI]

    plain = gym.make("RedCoda-HotpotQA-v0")
    obs, _ = plain.reset(options={"index": 3})
    expected = [plain.step(action) for action in QAZI]
    assert outputs[0]["observations"] == [{"role": "user", "content": expected[0][0]}] and not outputs[0]["done"]
    assert [o["reward"] for o in outputs] == [e[1] for e in expected] and outputs[-1]["done"]
    assert [o["metadata"] for o in outputs] == [json_roundtrip(e[4]) for e in expected]
    assert outputs[-1]["metadata"]["f1"] == 1.0 and outputs[-1]["reward"] > 3
    metrics = env.get_metrics()
    assert metrics == envs.episode_metrics(expected[-1][4]) and metrics["f1"] == 1.0
    assert RedCodaSkyRLEnv.aggregate_metrics([metrics, {**metrics, "f1": 0.0}])["f1"] == 0.5


def test_bad_input_in_skyrl_s_style():
    row = {"extra_info": {"index": 3}}
    env = skyrl_gym.make("redcoda", env_config={"env_kwargs": {"max_turns": 3}}, extras=row)
    with pytest.raises(EpisodeOver, match="init"):
        env.step("<answer>Kolkata</answer>")
    env.init([])
    malformed = env.step("<search>Qazi")  # the env's rule: an observation that says what was wrong
    assert malformed["metadata"]["invalid_action"] and "never closed" in malformed["observations"][0]["content"]
    long = env.step("<search>" + "q" * 20_000 + "</search>")
    assert long["metadata"]["invalid_action"] and "over the limit" in long["observations"][0]["content"]
    last = env.step("<answer>Kolkata</answer>")
    assert last["done"] and last["metadata"]["invalid_actions"] == 2 and last["metadata"]["f1"] == 1.0
    with pytest.raises(EpisodeOver, match="ended"):
        env.step("<answer>again</answer>")
    assert isinstance(EpisodeOver("x"), skyrl_gym.error.Error)

    with pytest.raises(IndexError, match="index 99999 out of range for 1325 questions"):
        skyrl_gym.make("redcoda", env_config={}, extras={"extra_info": {"index": 99_999}})
    with pytest.raises(ValueError, match="names no question"):
        skyrl_gym.make("redcoda", env_config={}, extras={})
    with pytest.raises(ValueError, match="flat protocol only"):
        skyrl_gym.make("redcoda", env_config={"env_kwargs": {"protocol": "coda"}}, extras=row)


def test_two_trajectories_share_nothing_but_the_index():
    first = skyrl_gym.make("redcoda", env_config={}, extras={"extra_info": {"index": 3}})
    second = skyrl_gym.make("redcoda", env_config={}, extras={"extra_info": {"index": 0}})
    first.init([])
    second.init([])
    first.step(QAZI[0])
    done = second.step("<answer>no idea</answer>")
    assert done["done"] and done["metadata"]["index"] == 0 and done["metadata"]["num_searches"] == 0
    assert first.step(QAZI[1])["metadata"]["f1"] == 1.0 and len(first.chat_history) == 5
    assert first.env.unwrapped.retriever is second.env.unwrapped.retriever  # one index per process


def test_without_the_extra_the_import_names_it(monkeypatch):
    from gymnasium.error import DependencyNotInstalled

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    monkeypatch.delitem(sys.modules, "envs.frameworks.skyrl")
    with pytest.raises(DependencyNotInstalled, match=r"^skyrl-gym is not installed: pip install 'redcoda\[skyrl\]'$"):
        import envs.frameworks.skyrl  # noqa: F401


def test_the_docs_skyrl_example_runs(capsys):
    from test_frameworks_openenv import doc_example

    exec(doc_example(2), {})
    assert capsys.readouterr().out.split() == ["3.05", "True", "1.0"]
