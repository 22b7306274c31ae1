"""User-defined tasks: the trust gate, the example task end to end through Gymnasium, the file format, task bugs."""

from __future__ import annotations

import textwrap
import traceback
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

import envs
from envs.tasks import EXAMPLE_TASK_FILE, Task, TaskCodeError, TaskEnv, TaskItem, load_task

EXAMPLE = Path(envs.__file__).parent / "tasks" / "example_arithmetic.yaml"
ENV_ID = "RedCoda-Task-v0"


def make(**kwargs):
    return gym.make(ENV_ID, task_file=str(EXAMPLE), trust_code=True, **kwargs)


def write_task(tmp_path, body: str, name: str = "task.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# --- the trust gate -----------------------------------------------------------------------------------------------


def test_a_task_file_never_loads_without_trust_code(tmp_path):
    marker = tmp_path / "ran"
    path = write_task(
        tmp_path,
        f"""
        system_prompt: hi
        items: [{{prompt: p, answer: a}}]
        code: |
          open({str(marker)!r}, "w").write("code ran")
          def score(response, answer): return 1.0
        """,
    )
    for attempt in (
        lambda: load_task(path),
        lambda: load_task(path, trust_code="yes"),
        lambda: gym.make(ENV_ID, task_file=str(path)),
        lambda: TaskEnv(task_file=path),
    ):
        with pytest.raises(PermissionError, match="runs the Python code.*trust_code=True"):
            attempt()
    assert not marker.exists()
    load_task(path, trust_code=True)
    assert marker.read_text() == "code ran"
    with pytest.raises(ValueError, match="give one task"):
        gym.make(ENV_ID, task_file=str(path), trust_code=True, task=load_task(path, trust_code=True))
    assert Path(gym.make(ENV_ID).unwrapped.task.source) == EXAMPLE_TASK_FILE.resolve()  # no task: our own example


# --- the example task end to end -------------------------------------------------------------------------------------


def test_example_task_passes_check_env():
    assert ENV_ID in envs.OTHER_ENV_IDS
    check_env(make().unwrapped, skip_render_check=True)
    check_env(make(render_mode="ansi").unwrapped)


def test_example_task_correct_answers_score_one_on_every_item():
    env = make()
    task = env.unwrapped.task
    assert task.name == "arithmetic" and len(task.items) == 12 and task.max_turns == 2
    for index, item in enumerate(task.items):
        obs, info = env.reset(options={"index": index})
        assert obs == f"{task.system_prompt}\n\n{item.prompt}\n" and info["user_message"] == item.prompt
        obs, reward, terminated, truncated, info = env.step(f"<think>work it out</think><answer>{item.answer}</answer>")
        assert (reward, terminated, truncated, obs) == (1.0, True, False, "")
        assert info["response"] == str(item.answer) and info["answer"] == item.answer and info["turns"] == 1


def test_example_task_wrong_answer_retry_and_truncation():
    env = make()
    env.reset(options={"index": 0})  # 3 boxes of 4 apples: 12
    *_, reward, terminated, _, info = env.step("<answer>The answer is 13</answer>")
    assert reward == 0.0 and terminated and info["answered"]

    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("I think it is 12.")
    assert info["invalid_action"] and info["action"] is None and "<answer>" in obs
    assert (reward, terminated, truncated) == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step("<answer> 12 apples </answer>")
    assert (reward, terminated, truncated) == (1.0, True, False) and info["invalid_actions"] == 1

    env.reset(options={"index": 10})  # a negative answer
    assert env.step("<answer>-5</answer>")[1] == 1.0

    env.reset(options={"index": 0})
    env.step("no answer")
    obs, reward, terminated, truncated, info = env.step("x" * 20_000)
    assert truncated and not terminated and reward == 0.0 and not info["answered"] and "over the limit" in info["error"]
    with pytest.raises(ResetNeeded):
        env.unwrapped.step("<answer>12</answer>")


def test_example_task_render_and_seeding():
    env = make(render_mode="ansi", max_turns=3)
    assert env.unwrapped.max_turns == 3
    env.reset(seed=3)
    env.step("hmm")
    text = env.render()
    assert "[system] Solve" in text and "[assistant] hmm" in text and "[user] No <answer>" in text
    assert env.reset(seed=5)[1]["index"] == env.reset(seed=5)[1]["index"]
    assert len({env.reset(seed=s)[1]["index"] for s in range(30)}) > 6
    with pytest.raises(IndexError, match="out of range"):
        env.reset(options={"index": 12})


def test_vector_env_of_the_example_task():
    vec = gym.make_vec(ENV_ID, num_envs=3, vectorization_mode="sync", task_file=str(EXAMPLE), trust_code=True)
    vec.reset(seed=0, options={"index": 1})
    _, rewards, terminated, _, _ = vec.step(("<answer>23</answer>", "<answer>22</answer>", "thinking"))
    assert list(rewards) == [1.0, 0.0, 0.0] and list(terminated) == [True, True, False]
    vec.close()


# --- the file format -------------------------------------------------------------------------------------------------


def test_module_items_file_and_multi_turn_functions(tmp_path):
    (tmp_path / "guess.py").write_text(
        textwrap.dedent(
            """
            def split_turn(text):
                text = text.strip()
                return text if text.isdigit() else None

            def feedback(history, answer):
                guess = int(history[-1]["action"] or -1)
                return "higher" if guess < answer else "lower"

            def is_done(history):
                return history[-2]["content"] == "lower" and history[-1]["action"] is not None

            def score(response, answer):
                return float(int(response) == answer)
            """
        )
    )
    (tmp_path / "items.jsonl").write_text('{"prompt": "Guess my number.", "answer": 7}\n')
    path = write_task(
        tmp_path,
        """
        name: guess
        system_prompt: Guess a number; I say higher or lower.
        max_turns: 4
        items_file: items.jsonl
        module: guess.py
        """,
    )
    env = gym.make(ENV_ID, task_file=str(path), trust_code=True)
    obs, _ = env.reset(options={"index": 0})
    assert obs.startswith("Guess a number")
    assert env.step("3")[0] == "higher"
    assert env.step("9")[0] == "lower"
    history_seen = env.unwrapped._copy_history()
    assert [m["role"] for m in history_seen] == ["system", "user", "assistant", "user", "assistant", "user"]
    obs, reward, terminated, truncated, info = env.step("7")
    assert (reward, terminated, truncated, info["turns"]) == (1.0, True, False, 3)


def test_defaults_and_a_task_built_in_python():
    task = Task(name="echo", system_prompt="", items=(TaskItem("Say hi.", "hi"),), score=lambda r, a: r == a)
    env = gym.make(ENV_ID, task=task)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset()
    assert obs == "Say hi.\n"
    obs, reward, terminated, truncated, _ = env.step("  hi ")
    assert (reward, terminated) == (1.0, True)  # a bool score counts as 0/1
    env.reset()
    obs, reward, terminated, truncated, info = env.step("   ")
    assert truncated and reward == 0.0 and info["invalid_action"]


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        ("system_prompt: x\nitems: [{prompt: p, answer: 1}]\n", ValueError, "exactly one of code"),
        ("system_prompt: x\nitems: []\ncode: 'def score(r, a): return 0'\n", ValueError, "no items"),
        ("items: [{prompt: p, answer: 1}]\ncode: 'def score(r, a): return 0'\n", ValueError, "system_prompt"),
        ("system_prompt: x\nitems: [{prompt: p}]\ncode: 'def score(r, a): return 0'\n", ValueError, r"items\[0\]"),
        ("system_prompt: x\nitem: [{prompt: p, answer: 1}]\ncode: ''\n", ValueError, "unknown keys"),
        ("system_prompt: x\nitems: [{prompt: p, answer: 1}]\ncode: 'x = 1'\n", TaskCodeError, "no score"),
        ("system_prompt: x\nitems: [{prompt: p, answer: 1}]\ncode: 'def score(:'\n", TaskCodeError, "failed to run"),
        ("- just a list\n", ValueError, "YAML mapping"),
        ("system_prompt: [\n", ValueError, "not valid YAML"),
        ("system_prompt: x\nitems: [{prompt: p, answer: 1}]\nmodule: nope.py\n", FileNotFoundError, "nope.py"),
    ],
)
def test_bad_task_files_raise_clear_errors(tmp_path, body, error, match):
    with pytest.raises(error, match=match):
        load_task(write_task(tmp_path, body), trust_code=True)


def test_task_bugs_raise_and_point_at_the_task_file(tmp_path):
    path = write_task(
        tmp_path,
        """
        system_prompt: x
        items: [{prompt: p, answer: 1}]
        code: |
          def split_turn(text):
              return text

          def score(response, answer):
              return 1 / 0
        """,
    )
    env = gym.make(ENV_ID, task_file=str(path), trust_code=True)
    env.reset()
    with pytest.raises(TaskCodeError, match="score raised ZeroDivisionError") as caught:
        env.step("anything")
    frames = traceback.extract_tb(caught.value.__cause__.__traceback__)
    assert frames[-1].filename == str(path.resolve()) and frames[-1].lineno == 9  # `return 1 / 0` in the YAML

    bad = Task(name="bad", system_prompt="", items=(TaskItem("p", 1),), score=lambda r, a: "1", split_turn=lambda t: 3)
    env = gym.make(ENV_ID, task=bad)
    env.reset()
    with pytest.raises(TaskCodeError, match="split_turn returned int"):
        env.step("x")
