"""RedCoda's verifiers taskset, run by verifiers' own rollout loop (serving, harness chat loop, MCP tool server,
scoring) against a scripted OpenAI-compatible model on 127.0.0.1: no network, no model weights."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import gymnasium as gym
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

import envs
from envs.frameworks import json_roundtrip

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "split": "train",
    "max_turns": 4,
    "corpus": "distractor",
}  # BM25 over each question's own paragraphs: no index to load in the tool server


def scripted_model(plans: dict[str, list[tuple[str, str | dict]]], seen: list[dict]) -> FastAPI:
    """An OpenAI-compatible chat endpoint that plays a fixed list of tool calls per question (streamed, as verifiers'
    chat loop asks), then a closing message without tool calls. A call is (tool, its one argument's value) or (tool,
    the arguments as a dict). `seen` collects every request body."""
    app = FastAPI()

    def reply(body: dict) -> dict:
        seen.append(body)
        question = next(m["content"] for m in body["messages"] if m["role"] == "user").split("Question: ")[-1]
        done = sum(m["role"] == "tool" for m in body["messages"])
        plan = plans[question]
        if done >= len(plan):
            return {"role": "assistant", "content": "Done."}
        name, argument = plan[done]
        arguments = argument if isinstance(argument, dict) else {"query" if name == "search" else "answer": argument}
        call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function"}
        call["function"] = {"name": name, "arguments": json.dumps(arguments)}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        message = reply(body)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": "chatcmpl-1", "created": int(time.time()), "model": body["model"]}
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        delta = {**message, "tool_calls": [{"index": 0, **c} for c in message.get("tool_calls") or []] or None}
        chunks = [
            {"index": 0, "delta": {k: v for k, v in delta.items() if v is not None}, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": finish},
        ]
        events = [{**head, "object": "chat.completion.chunk", "choices": [c]} for c in chunks]
        events.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return StreamingResponse(iter([text]), media_type="text/event-stream")

    return app


def oracle_calls(example) -> list[tuple[str, str]]:
    return [*(("search", title) for title in example.gold_titles), ("answer", example.answer)]


def gym_outcome(index: int, calls: list[tuple[str, str]]):
    env = gym.make("RedCoda-HotpotQA-v0", **SETTINGS)
    env.reset(options={"index": index})
    for name, argument in calls:
        _, reward, terminated, truncated, info = env.step(f"<{name}>{argument}</{name}>")
        if terminated or truncated:
            return reward, json_roundtrip(info)
    reward, info = env.unwrapped.end_episode("the model stopped calling tools")
    return reward, json_roundtrip(info)


def test_verifiers_rollouts_score_the_env_s_reward(serve_app, monkeypatch):
    import verifiers.v1 as vf

    from envs.frameworks.verifiers_env import load_environment

    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the tool server and the chat loop import this checkout
    monkeypatch.setenv("OPENAI_API_KEY", "local")
    examples = gym.make("RedCoda-HotpotQA-v0").unwrapped.examples
    bad = [
        ("search", {"q": "Scott Derrickson"}),  # malformed arguments: the tool server refuses them, the rollout goes on
        ("search", "x" * 20_000),  # over the env's action length: the env's invalid-action observation
        ("answer", examples[17].answer),
        ("answer", "again"),  # after the end: told the episode is over
    ]
    plans = {
        examples[3].question: oracle_calls(examples[3]),
        examples[0].question: [("search", "Scott Derrickson")],
        examples[17].question: bad,
    }
    seen: list[dict] = []
    url, _ = serve_app(scripted_model(plans, seen))

    env = load_environment(indices=[3, 0, 17], **SETTINGS)
    tasks = list(env.taskset)
    assert [t.data.index for t in tasks] == [3, 0, 17] and tasks[0].data.answers == ["Kolkata"]
    client = vf.EvalClientConfig(base_url=f"{url}/v1", api_key_var="OPENAI_API_KEY")
    ctx = vf.ModelContext(model="scripted", client=client)

    async def run():
        async with env.serving():
            return await asyncio.gather(*(env.run_episode(task, ctx) for task in tasks))

    episodes = asyncio.run(run())
    for episode in episodes:
        assert not episode.errors, episode.errors
    answered, silent, mistaken = (episode.traces[0] for episode in episodes)
    offered = {tool["function"]["name"] for tool in seen[0]["tools"]}
    assert offered == {"search", "answer"}

    reward, info = gym_outcome(3, plans[examples[3].question])
    assert answered.rewards["redcoda"].score == reward and answered.state.info == info and info["f1"] == 1.0
    assert answered.metrics["f1"] == 1.0 and answered.metrics["em"] == 1.0 and answered.metrics["format"] == 0.5
    assert answered.state.actions == [f"<{n}>{a}</{n}>" for n, a in plans[examples[3].question]]

    reward, info = gym_outcome(0, plans[examples[0].question])  # never answered: scored as the env scores it
    assert silent.rewards["redcoda"].score == reward < 0 and silent.metrics["answered"] == 0.0
    assert silent.state.index == 0 and silent.state.actions == ["<search>Scott Derrickson</search>"]
    assert envs.episode_metrics(info) == {k: silent.metrics[k] for k in envs.episode_metrics(info)}

    assert mistaken.state.actions == [f"<search>{'x' * 20_000}</search>", f"<answer>{examples[17].answer}</answer>"]
    assert mistaken.state.info["invalid_actions"] == 1 and mistaken.metrics["f1"] == 1.0
    asked = [b for b in seen if any(examples[17].question in str(m.get("content")) for m in b["messages"])]
    replies = asked[-1]["messages"]
    tool_replies = [m["content"] for m in replies if m["role"] == "tool"]
    assert len(tool_replies) == 4 and "query" in str(tool_replies[0]) and "over the limit" in str(tool_replies[1])
    assert "episode is over" in str(tool_replies[3])


def test_an_unknown_question_and_a_tool_call_without_a_task_are_clear_errors():
    from envs.frameworks.verifiers_env import RedCodaState, RedCodaTools, RedCodaToolsConfig, load_environment

    with pytest.raises(IndexError, match="index 99999 out of range for 1325 questions"):
        list(load_environment(indices=[99_999], corpus="distractor").taskset)
    with pytest.raises(ValueError, match="carries no RedCoda question"):
        RedCodaTools(RedCodaToolsConfig(env_kwargs={"corpus": "distractor"})).play(RedCodaState(), "<search>a</search>")


def test_an_episode_dropped_from_the_tool_server_s_memory_comes_back_as_it_was(monkeypatch):
    import envs.frameworks.verifiers_env as adapter

    monkeypatch.setattr(adapter, "LIVE_EPISODES", 1)
    tools = adapter.RedCodaTools(adapter.RedCodaToolsConfig(env_kwargs=SETTINGS))
    asyncio.run(tools.setup())
    first, second = adapter.RedCodaState(index=3, episode="a"), adapter.RedCodaState(index=0, episode="b")
    tools.play(first, "<search>Qazi Touqeer</search>")
    tools.play(second, "<search>Scott Derrickson</search>")
    assert list(tools._episodes) == ["b"]  # the first rollout's env is gone
    tools.play(first, "<answer>Kolkata</answer>")
    assert (first.reward, first.info) == gym_outcome(3, [("search", "Qazi Touqeer"), ("answer", "Kolkata")])
    assert first.info["num_searches"] == 1 and first.actions == [
        "<search>Qazi Touqeer</search>",
        "<answer>Kolkata</answer>",
    ]


def test_without_the_extra_the_import_names_it(monkeypatch):
    from gymnasium.error import DependencyNotInstalled

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.delitem(sys.modules, "envs.frameworks.verifiers_env", raising=False)
    with pytest.raises(
        DependencyNotInstalled, match=r"^verifiers is not installed: pip install 'redcoda\[verifiers\]'$"
    ):
        import envs.frameworks.verifiers_env  # noqa: F401


def test_a_fresh_process_finds_the_taskset_by_its_id_alone(tmp_path):
    """verifiers imports a taskset id as a top-level module: the installed project's ``redcoda`` is it, so a `vf eval`
    or prime-rl worker in a new process (here: started in an empty directory) loads it by name."""
    code = (
        "from verifiers.v1.utils.loaders import harness_class, taskset_class; "
        "print(taskset_class('redcoda').__name__, harness_class('redcoda').__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["RedCodaTaskset", "LocalChatHarness"]
