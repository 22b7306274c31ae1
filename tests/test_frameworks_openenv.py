"""RedCoda's OpenEnv server, driven by openenv-core's own client: oracle episodes (flat and CoDA), 8 isolated
sessions at once, bad input answered in openenv-core's style while the server keeps serving, and the command."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import httpx
import pytest
from openenv.core.env_client import EnvClient
from websockets.sync.client import connect

import envs  # noqa: F401  (registers the ids)
from envs.frameworks import json_roundtrip
from envs.frameworks.openenv_client import RedCodaAction, RedCodaEnv
from envs.frameworks.openenv_server import RedCodaEnvironment, ServerSettings, _parser, create_redcoda_app

ROOT = Path(__file__).resolve().parents[1]
QAZI = ["<think>Who is Qazi?</think><search>Qazi Touqeer</search>", "<answer>Kolkata</answer>"]
"""Question 3's oracle: its answer is in the first passage of the search for its first gold title."""
QAZI_CODA = [
    "<task>Who is Qazi Touqeer?</task>",
    "<search>Qazi Touqeer</search>",
    "<refine>Qazi Touqeer won Fame Gurukul.</refine><answer>Kolkata</answer>",
    "<answer>Kolkata</answer>",
]


@pytest.fixture(scope="module")
def servers(serve_app):
    """An in-process uvicorn server per protocol (the real app, on 127.0.0.1), each at most 10 sessions."""
    flat, _ = serve_app(create_redcoda_app(ServerSettings(), max_sessions=10))
    coda, _ = serve_app(create_redcoda_app(ServerSettings(env_kwargs={"protocol": "coda"}), max_sessions=10))
    return {"flat": flat, "coda": coda}


def gym_episode(index: int, actions: list[str], **kwargs):
    env = gym.make("RedCoda-HotpotQA-v0", **kwargs)
    env.reset(options={"index": index})
    steps = [env.step(action) for action in actions]
    return [
        (obs, reward, terminated, truncated, json_roundtrip(info)) for obs, reward, terminated, truncated, info in steps
    ]


@pytest.mark.parametrize("protocol", ["flat", "coda"])
def test_an_oracle_episode_through_openenv_core_s_client(servers, protocol):
    actions = QAZI if protocol == "flat" else QAZI_CODA
    expected = gym_episode(3, actions, protocol=protocol)
    with RedCodaEnv(base_url=servers[protocol]).sync() as env:
        first = env.reset(index=3)
        assert first.observation.new_context and first.observation.info["index"] == 3 and not first.done
        assert first.observation.role == ("agent" if protocol == "flat" else "planner")
        results = [env.step(RedCodaAction(text=action)) for action in actions]
        state = env.state()
    for result, (obs, reward, terminated, truncated, info) in zip(results, expected, strict=True):
        seen = result.observation
        assert (seen.text, result.reward, seen.terminated, seen.truncated, seen.info) == (
            obs,
            reward,
            terminated,
            truncated,
            info,
        )
        assert seen.role == info["role"] and seen.new_context == info["new_context"]
        assert result.done == (terminated or truncated)
    assert results[-1].done and results[-1].observation.info["f1"] == 1.0 and results[-1].reward > 3
    if protocol == "coda":  # the executor's fresh context, and the planner's return, are visible to the client
        assert [r.observation.role for r in results] == ["executor", "executor", "planner", "planner"]
        assert results[0].observation.new_context and results[0].observation.text.startswith("You are a search worker")
        assert "<result>Kolkata</result>" in results[2].observation.text
    assert state.done and state.index == 3 and state.actions == actions and state.protocol == protocol


def test_eight_clients_at_once_each_in_its_own_session(servers):
    indices = [3, 0, 17, 101, 5, 8, 13, 21]

    async def play(index: int):
        env = gym.make("RedCoda-HotpotQA-v0").unwrapped
        title = env.examples[index].gold_titles[0]
        actions = [f"<search>{title}</search>", f"<search>{title} {index}</search>", "<answer>unknown</answer>"]
        async with RedCodaEnv(base_url=servers["flat"]) as client:
            opened = await client.reset(index=index)
            before = await client.state()
            results = [await client.step(RedCodaAction(text=action)) for action in actions]
            return index, actions, opened, before, results, await client.state()

    async def all_at_once():
        return await asyncio.gather(*(play(index) for index in indices))

    for index, actions, opened, before, results, state in asyncio.run(all_at_once()):
        question = gym.make("RedCoda-HotpotQA-v0").unwrapped.examples[index].question
        assert opened.observation.info["question"] == question == state.question and state.index == index
        assert before.cache_entries == 0, "a new session starts with an empty query cache"
        assert state.actions == actions and state.step_count == 3, "the session's history is its own"
        assert state.cache_entries == 2, "its cache holds its own two queries, no other session's"
        final = results[-1].observation.info
        assert final["index"] == index and final["num_searches"] == 2 and final["answer"] == "unknown"
        assert results[-1].reward == gym_episode(index, actions)[-1][1]


def raw_step(ws, data) -> dict:
    ws.send(json.dumps({"type": "step", "data": data}))
    return json.loads(ws.recv(timeout=30))


def test_bad_input_is_an_openenv_error_and_the_session_goes_on(servers):
    with RedCodaEnv(base_url=servers["flat"]).sync() as env:
        with pytest.raises(RuntimeError, match=r"out of range for 1325 questions \(code: EXECUTION_ERROR\)"):
            env.reset(index=99_999)
        with pytest.raises(RuntimeError, match=r"must be an int.*EXECUTION_ERROR"):
            env.reset(index="three")
        with pytest.raises(RuntimeError, match=r"reset\(\).*EXECUTION_ERROR"):
            env.step(RedCodaAction(text="<search>Qazi</search>"))  # no episode yet
        env.reset(index=3)
        long = env.step(RedCodaAction(text="<search>" + "a" * 20_000 + "</search>"))  # over the env's 16,384
        assert long.observation.info["invalid_action"] and "over the limit" in long.observation.text
        assert not long.done
        env.step(RedCodaAction(text="<answer>Kolkata</answer>"))
        with pytest.raises(RuntimeError, match=r"episode has ended.*EXECUTION_ERROR"):
            env.step(RedCodaAction(text="<answer>again</answer>"))
        assert env.reset(index=4).observation.info["index"] == 4  # the same session plays on

    ws_url = servers["flat"].replace("http://", "ws://") + "/ws"
    with connect(ws_url, max_size=None) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"index": 3}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "observation"
        for malformed in ({"txt": "<answer>x</answer>"}, {"text": 42}, {"text": "a" * ((1 << 20) + 1)}):
            reply = raw_step(ws, malformed)
            assert reply["type"] == "error" and reply["data"]["code"] == "VALIDATION_ERROR", reply["data"]["message"]
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=30))["data"]["code"] == "INVALID_JSON"
        assert raw_step(ws, {"text": "<answer>Kolkata</answer>"})["data"]["done"] is True


def test_a_dropped_client_frees_its_session_and_the_server_keeps_serving(servers):
    ws_url = servers["flat"].replace("http://", "ws://") + "/ws"
    for _ in range(12):  # more than the server's 10 sessions: each dropped one must have been closed
        deadline = time.monotonic() + 10
        while True:  # the server notices a drop when its socket closes: allow it a moment
            ws = connect(ws_url)
            ws.send(json.dumps({"type": "reset", "data": {"index": 3}}))
            reply = json.loads(ws.recv(timeout=30))
            if reply["type"] == "observation" or time.monotonic() > deadline:
                break
            ws.close()
            time.sleep(0.1)
        assert reply["type"] == "observation", reply
        ws.socket.close()  # gone without a close message, mid-episode
    with RedCodaEnv(base_url=servers["flat"]).sync() as env:
        assert env.reset(index=3).observation.info["index"] == 3
        assert env.state().actions == [], "a new session inherits nothing of the dropped ones"


def own_addresses() -> set[str]:
    """This machine's IPv4 addresses: its name's, and the one its default route leaves from (no packet is sent)."""
    found = set()
    try:
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except socket.gaierror:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("10.255.255.255", 1))
            found.add(udp.getsockname()[0])
        except OSError:
            pass
    return found


def test_the_command_serves_on_localhost_only(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "envs.frameworks.openenv_server", "--port", str(port), "--protocol", "coda"]
    command += ["--env-kwargs", json.dumps({"corpus": "distractor"})]  # no index: the command starts in seconds
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()["status"] == "healthy":
                    break
            except httpx.HTTPError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        with RedCodaEnv(base_url=f"http://127.0.0.1:{port}").sync() as env:
            env.reset(index=3)
            rewards = [env.step(RedCodaAction(text=action)).reward for action in QAZI_CODA]
        assert rewards[-1] == gym_episode(3, QAZI_CODA, protocol="coda", corpus="distractor")[-1][1]
        for address in own_addresses() - {"127.0.0.1"}:
            with socket.socket() as probe:
                probe.settimeout(1)
                assert probe.connect_ex((address, port)) != 0, f"the server is reachable on {address}"
    finally:
        server.terminate()
        output = server.communicate(timeout=20)[0]
    assert f"on http://127.0.0.1:{port}" in output
    assert _parser().parse_args([]).host == "127.0.0.1"


def test_without_the_extra_the_command_says_which_one_in_one_line():
    code = (
        "import sys, runpy; sys.modules['openenv'] = None; "
        "runpy.run_module('envs.frameworks.openenv_server', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: openenv-core is not installed: pip install 'redcoda[openenv]'"


def test_without_the_extra_an_import_raises_gymnasium_s_dependency_error(monkeypatch):
    from gymnasium.error import DependencyNotInstalled

    monkeypatch.setitem(sys.modules, "openenv", None)
    for name in ("envs.frameworks.openenv_client", "envs.frameworks.openenv_models"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        DependencyNotInstalled, match=r"^openenv-core is not installed: pip install 'redcoda\[openenv\]'$"
    ):
        import envs.frameworks.openenv_client  # noqa: F401


def test_the_adapter_is_openenv_core_s_environment_and_client():
    from openenv.core.env_server.interfaces import Environment

    assert issubclass(RedCodaEnv, EnvClient) and issubclass(RedCodaEnvironment, Environment)
    assert RedCodaEnvironment.SUPPORTS_CONCURRENT_SESSIONS


def doc_example(number: int) -> str:
    """The `number`-th Python example of docs/environment.md's "From other frameworks" section."""
    text = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    section = text.split("## From other frameworks", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[number]


def test_the_docs_openenv_example_runs(servers, capsys):
    exec(doc_example(0).replace("http://127.0.0.1:8000", servers["coda"]), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "executor True 0.0" and printed[-2] == "planner False 3.075"
    assert printed[-1].startswith("1.0 Qazi is a Kashmiri singer")
