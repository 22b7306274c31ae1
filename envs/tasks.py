"""User-defined text tasks: a YAML file of prompts, answers and Python functions, played by one generic env.

    ******************************************************************************************************
    *  LOADING A TASK FILE RUNS THE PYTHON CODE IN IT, with your permissions, in this process. Load only  *
    *  task files you wrote or have read. Nothing here loads a file of yours implicitly: `load_task` and  *
    *  `gym.make("RedCoda-Task-v0", task_file=...)` refuse unless you pass `trust_code=True`.             *
    ******************************************************************************************************

A researcher trains on a new task by writing a task file instead of an env:

    import gymnasium as gym, envs
    env = gym.make("RedCoda-Task-v0", task_file="envs/tasks/example_arithmetic.yaml", trust_code=True)
    obs, info = env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<think>3 * 4 = 12</think><answer>12</answer>")

The task file's format is `load_task`'s; the functions a task defines, and what they get, are `Task`'s. With no
task given, ``gym.make("RedCoda-Task-v0")`` plays that example (`EXAMPLE_TASK_FILE`, part of this package).
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from envs.pickling import BuiltInWorker
from envs.spaces import UnicodeText

History = list[dict[str, Any]]
"""Chat messages: {"role", "content"} (assistant messages also hold "action")."""

TASK_KEYS = frozenset(
    {"name", "description", "system_prompt", "max_turns", "no_response_reward", "items", "items_file", "code", "module"}
)
"""Keys a task file may hold."""
FUNCTION_NAMES = ("score", "split_turn", "is_done", "feedback")
"""Functions a task's code may define (score is required)."""
EXAMPLE_TASK_FILE = Path(__file__).parent / "tasks" / "example_arithmetic.yaml"
"""The example task shipped with RedCoda (12 arithmetic word problems): TaskEnv's task when none is given."""

UNTRUSTED_MESSAGE = (
    "loading task file {path} runs the Python code in it (its `code` or `module`) with your permissions. "
    "Read the file, then load it explicitly with load_task(path, trust_code=True) or "
    'gym.make("RedCoda-Task-v0", task_file=path, trust_code=True)'
)


class TaskCodeError(RuntimeError):
    """A task's own function raised or returned something of the wrong type."""


def default_split_turn(text: str) -> str | None:
    """The whole turn, stripped; None when it is empty."""
    return text.strip() or None


def default_is_done(history: History) -> bool:
    """Done as soon as a turn holds a valid action."""
    return history[-1].get("action") is not None


def default_feedback(history: History, answer: Any) -> str:
    """A reminder to follow the instructions (the last turn held no valid action)."""
    return "Your reply did not contain a valid answer. Follow the instructions and try again."


@dataclass(frozen=True)
class TaskItem:
    """One question of a task."""

    prompt: str
    """What the agent is asked (its first user message)."""
    answer: Any
    """The reference answer, as the task file gives it; passed to `score` and `feedback` unchanged."""


@dataclass(frozen=True)
class Task:
    """A text task: instructions, items and the functions that score and drive an episode.

    Build one in Python (your own functions, nothing to trust) or with `load_task` from a task file.

    The functions (only `score` is required):

    * ``score(response: str, answer) -> float``: the episode's reward. `response` is the last valid action of
      the episode; `answer` is the item's answer exactly as written in the file (a number stays a number).
    * ``split_turn(text: str) -> str | None``: the action in one raw turn (say, the content of an
      ``<answer>`` tag), or None when the turn holds no valid action (the env flags it and the turn is used up).
      Default: the stripped text, None when empty.
    * ``is_done(history: list[dict]) -> bool``: whether the episode has ended, asked after every turn. Default:
      as soon as a turn holds a valid action.
    * ``feedback(history: list[dict], answer) -> str``: the env's reply to a turn that did not end the
      episode. Default: a reminder to follow the instructions.

    ``history`` is the conversation so far as chat messages, ``{"role": "system" | "user" | "assistant",
    "content": str}``, the assistant's also holding ``"action"`` (split_turn's result); functions get a copy.
    Errors raised by task code are the task author's bugs: they propagate as `TaskCodeError`, naming the task
    and the function, and tracebacks of inline ``code`` point at lines of the task file.
    """

    name: str
    """Short name, shown in infos and errors."""
    system_prompt: str
    """Instructions: the first part of every first observation."""
    items: tuple[TaskItem, ...]
    """The questions; `reset(options={"index": i})` picks one."""
    score: Callable[[str, Any], float]
    """score(response, answer) -> reward of the episode."""
    split_turn: Callable[[str], str | None] = default_split_turn
    """split_turn(text) -> the action in a turn, or None when it holds none."""
    is_done: Callable[[History], bool] = default_is_done
    """is_done(history) -> whether the episode ended (terminated)."""
    feedback: Callable[[History, Any], str] = default_feedback
    """feedback(history, answer) -> the env's reply to a turn that did not end the episode."""
    max_turns: int = 1
    """Turns before the episode is truncated."""
    no_response_reward: float = 0.0
    """Reward of an episode that never produced a valid action (`score` is not called)."""
    description: str = ""
    """Free text about the task."""
    source: str = field(default="", compare=False)
    """The task file it came from ("" when built in Python)."""

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(f"task {self.name!r} has no items")
        if self.max_turns < 1:
            raise ValueError(f"task {self.name!r}: max_turns must be >= 1, got {self.max_turns}")
        for name in FUNCTION_NAMES:
            if not callable(getattr(self, name)):
                raise TypeError(f"task {self.name!r}: {name} must be callable")


def load_task(path: str | os.PathLike, *, trust_code: bool = False) -> Task:
    """Load a task file, running the Python code it holds.

    A task file (YAML, read with `yaml.safe_load`):

        name: arithmetic                  # optional, defaults to the file's stem
        description: ...                  # optional
        system_prompt: |                  # required: the instructions the agent sees first
          Solve the problem; put the final number inside <answer> and </answer>.
        max_turns: 2                      # optional, default 1: turns before the episode is truncated
        no_response_reward: 0.0           # optional: the reward of an episode without any valid action
        items:                            # the questions: a list of {prompt, answer}; or instead
          - {prompt: "What is 3 * 4?", answer: 12}
        items_file: items.jsonl           # JSON lines of {prompt, answer}, relative to the task file
        code: |                           # Python source defining the functions (`Task`); or instead
          def score(response, answer): ...
        module: my_task.py                # a Python file defining them, relative to the task file

    Args:
        path: the task file (YAML).
        trust_code: must be True: loading executes the file's `code` (or imports its `module`) with your
            permissions. Read the file first.

    Returns:
        The task.

    Raises:
        PermissionError: `trust_code` is not True (nothing was read or run).
        FileNotFoundError: the task file, its items_file or its module is missing.
        ValueError: the file is not a valid task file.
        TaskCodeError: its code failed to run or lacks a `score` function.
    """
    path = Path(path).expanduser().resolve()
    if trust_code is not True:
        raise PermissionError(UNTRUSTED_MESSAGE.format(path=path))
    if not path.is_file():
        raise FileNotFoundError(f"no task file at {path}")
    import yaml

    text = path.read_text(encoding="utf-8")
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a task file is a YAML mapping with system_prompt, items and code")
    unknown = set(spec) - TASK_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; a task file may hold {sorted(TASK_KEYS)}")
    name = str(spec.get("name") or path.stem)
    system_prompt = spec.get("system_prompt")
    if not isinstance(system_prompt, str):
        raise ValueError(f"{path}: system_prompt (a string) is required")
    system_prompt = system_prompt.strip()  # a YAML block scalar keeps its final newline
    items = _items(spec, path)
    functions = _functions(spec, path, text, name)
    try:
        max_turns = int(spec.get("max_turns", 1))
        no_response_reward = float(spec.get("no_response_reward", 0.0))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: max_turns must be an integer and no_response_reward a number ({err})") from err
    return Task(
        name=name,
        system_prompt=system_prompt,
        items=items,
        max_turns=max_turns,
        no_response_reward=no_response_reward,
        description=str(spec.get("description", "")),
        source=str(path),
        **functions,
    )


def _items(spec: dict[str, Any], path: Path) -> tuple[TaskItem, ...]:
    if ("items" in spec) == ("items_file" in spec):
        raise ValueError(f"{path}: give exactly one of items (a list) and items_file (JSON lines)")
    if "items" in spec:
        rows, where = spec["items"], "items"
        if not isinstance(rows, list):
            raise ValueError(f"{path}: items must be a list of {{prompt, answer}} mappings")
    else:
        from retrievers.corpus import open_text

        file = path.parent / str(spec["items_file"])
        if not file.is_file():
            raise FileNotFoundError(f"{path}: items_file {file} does not exist")
        rows, where = [], str(file)
        for line_no, line in enumerate(open_text(file), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{file}:{line_no}: not valid JSON ({err.msg})") from err
    items = []
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise ValueError(f"{path}: {where}[{n}] must be a mapping with a string prompt and an answer")
        items.append(TaskItem(row["prompt"], row["answer"]))
    if not items:
        raise ValueError(f"{path}: the task has no items")
    return tuple(items)


def _functions(spec: dict[str, Any], path: Path, text: str, name: str) -> dict[str, Callable]:
    """Run the task's code and pick its functions."""
    if ("code" in spec) == ("module" in spec):
        raise ValueError(f"{path}: give exactly one of code (inline Python) and module (a .py file)")
    module_name = f"redcoda_task_{path.stem.replace('-', '_')}"
    if "code" in spec:
        source = spec["code"]
        if not isinstance(source, str):
            raise ValueError(f"{path}: code must be a string of Python source (use `code: |`)")
        module = types.ModuleType(module_name)
        module.__file__ = str(path)
        # Pad with blank lines so that tracebacks and syntax errors point at the task file's own lines.
        compiled_source = "\n" * _code_line(text) + source
        try:
            exec(compile(compiled_source, str(path), "exec"), module.__dict__)
        except Exception as err:
            raise TaskCodeError(f"task {name!r}: its code failed to run ({type(err).__name__}: {err})") from err
    else:
        file = path.parent / str(spec["module"])
        if not file.is_file():
            raise FileNotFoundError(f"{path}: module {file} does not exist")
        module_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise TaskCodeError(f"task {name!r}: module {file} failed to run ({type(err).__name__}: {err})") from err
    found = {fn: getattr(module, fn) for fn in FUNCTION_NAMES if hasattr(module, fn)}
    if "score" not in found:
        raise TaskCodeError(f"task {name!r}: its code defines no score(response, answer) function")
    for fn, value in found.items():
        if not callable(value):
            raise TaskCodeError(f"task {name!r}: {fn} is not a function")
    return found


def _code_line(text: str) -> int:
    """0-based line of the task file where the `code` block's first line is (0 when unknown)."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 0
    for key, value in getattr(root, "value", ()):
        if getattr(key, "value", None) == "code" and isinstance(value, yaml.ScalarNode):
            return value.start_mark.line + (1 if value.style in ("|", ">") else 0)
    return 0


class TaskEnv(BuiltInWorker, gym.Env[str, str]):
    """A multi-turn text task defined by a task file (or a `Task`): prompts, answers and scoring functions.

    WARNING: building this env from a task file RUNS THE PYTHON CODE IN THE FILE. It refuses unless
    ``trust_code=True`` is passed; see `envs.tasks` for the file format. Given neither a task file nor a task, it
    plays RedCoda's own example task (`EXAMPLE_TASK_FILE`: arithmetic word problems).

    ## Description
    Each episode is one item of the task. The first observation is the task's system prompt and the item's
    prompt. Every action is one turn of the agent: the task's ``split_turn(text)`` extracts its action (None:
    no valid action), ``is_done(history)`` says whether the episode ended, and otherwise the task's
    ``feedback(history, answer)`` is the next observation. When the episode ends, ``score(response, answer)``
    of the last valid action is the reward.

    ## Action Space
    ``UnicodeText(1_048_576)``: any Unicode string. A turn without a valid action (split_turn returns None) or
    over ``max_action_chars`` is flagged ``info["invalid_action"] = True`` and uses up a turn.

    ## Observation Space
    ``UnicodeText(1_048_576)``. The first observation is the system prompt and the prompt (also in ``info``
    as ``system_prompt`` and ``user_message`` for chat templates); later ones are the task's feedback; the
    last one is "".

    ## Rewards
    0 on every step but the last. On the last: ``score(response, answer)``, where ``response`` is the last
    valid action of the episode, or the task's ``no_response_reward`` (default 0) when there was none. The
    terminal ``info`` holds ``score``, ``response``, ``answer``, ``answered``, ``turns`` and
    ``invalid_actions``; every ``info`` holds ``action``, ``invalid_action`` and ``turn``.

    ## Episode End
    Terminated when ``is_done(history)`` is true (by default: after the first valid action). Truncated after
    ``max_turns`` turns otherwise.

    ## Arguments
    | argument | default | meaning |
    |---|---|---|
    | task_file | None | a task file (YAML); loading it runs its code. None (and no task): `EXAMPLE_TASK_FILE` |
    | trust_code | False | must be True with task_file: you accept that the file's code runs |
    | task | None | a `Task` built in Python, instead of task_file |
    | max_turns | None | overrides the task's max_turns |
    | max_action_chars | 16384 | longer actions are invalid (split_turn is not called) |
    | render_mode | None | None or "ansi" (the episode transcript) |

    ## Version History
    * v0: initial release.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        task_file: str | os.PathLike | None = None,
        trust_code: bool = False,
        task: Task | None = None,
        max_turns: int | None = None,
        max_action_chars: int = 16384,
        render_mode: str | None = None,
    ) -> None:
        if task_file is not None and task is not None:
            raise ValueError("give one task: task_file=PATH with trust_code=True (its code runs), or task=Task(...)")
        if task_file is None and task is None:  # RedCoda's own example, shipped in the package: nothing to trust
            task_file, trust_code = EXAMPLE_TASK_FILE, True
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.task = task if task is not None else load_task(task_file, trust_code=trust_code)
        self.max_turns = self.task.max_turns if max_turns is None else max_turns
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.max_action_chars = max_action_chars
        self.render_mode = render_mode
        self.action_space = UnicodeText(1 << 20)
        self.observation_space = UnicodeText(1 << 20)
        self._history: History = []
        self._item: TaskItem | None = None
        self._index = -1
        self._turns = 0
        self._invalid = 0
        self._response: str | None = None
        self._done = True

    @property
    def num_items(self) -> int:
        """Number of items in the task."""
        return len(self.task.items)

    def _call(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.task, fn)(*args)
        except Exception as err:
            raise TaskCodeError(f"task {self.task.name!r}: {fn} raised {type(err).__name__}: {err}") from err

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on item `options["index"]`, or on an item drawn with `self.np_random`."""
        super().reset(seed=seed)
        options = options or {}
        index = options.get("index")
        if index is None:
            index = int(self.np_random.integers(self.num_items))
        elif not isinstance(index, numbers.Integral) or not 0 <= int(index) < self.num_items:
            raise IndexError(f"index {index!r} out of range for {self.num_items} items of task {self.task.name!r}")
        self._index, self._item = int(index), self.task.items[int(index)]
        self._turns, self._invalid, self._response, self._done = 0, 0, None, False
        system, user = self.task.system_prompt, self._item.prompt
        self._history = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        obs = f"{system}\n\n{user}\n" if system else f"{user}\n"
        info = {"index": self._index, "task": self.task.name, "system_prompt": system, "user_message": user}
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._item is None or self._done:
            raise ResetNeeded("call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"an action is a str, got {type(action).__name__}")
        self._turns += 1
        info: dict[str, Any] = {"turn": self._turns}
        if len(action) > self.max_action_chars:
            parsed = None
            info["error"] = f"action is {len(action)} characters, over the limit of {self.max_action_chars}"
        else:
            parsed = self._call("split_turn", action)
            if parsed is not None and not isinstance(parsed, str):
                raise TaskCodeError(
                    f"task {self.task.name!r}: split_turn returned {type(parsed).__name__}, not str/None"
                )
            if parsed is None:
                info["error"] = "the turn holds no valid action"
        info.update(action=parsed, invalid_action=parsed is None)
        if parsed is None:
            self._invalid += 1
        else:
            self._response = parsed
        self._history.append({"role": "assistant", "content": action, "action": parsed})
        terminated = bool(self._call("is_done", self._copy_history()))
        truncated = not terminated and self._turns >= self.max_turns
        reward, obs = 0.0, ""
        if terminated or truncated:
            self._done = True
            reward = self._finish(info)
        else:
            obs = self._call("feedback", self._copy_history(), self._item.answer)
            if not isinstance(obs, str):
                raise TaskCodeError(f"task {self.task.name!r}: feedback returned {type(obs).__name__}, not str")
            self._history.append({"role": "user", "content": obs})
        return obs, reward, terminated, truncated, info

    def _copy_history(self) -> History:
        return [dict(message) for message in self._history]

    def _finish(self, info: dict[str, Any]) -> float:
        if self._response is None:
            reward = float(self.task.no_response_reward)
        else:
            value = self._call("score", self._response, self._item.answer)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bools count as 0/1
                raise TaskCodeError(f"task {self.task.name!r}: score returned {value!r}, not a finite number")
            reward = float(value)
        info.update(
            score=reward,
            response=self._response,
            answer=self._item.answer,
            answered=self._response is not None,
            turns=self._turns,
            invalid_actions=self._invalid,
            index=self._index,
        )
        return reward

    def render(self) -> str | None:
        """The episode transcript (render_mode="ansi"); None otherwise."""
        if self.render_mode != "ansi" or not self._history:
            return None
        return "".join(f"[{m['role']}] {m['content'].strip()}\n" for m in self._history)
