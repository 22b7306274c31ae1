"""The text protocol: which tags each role may write, the action parser, and the prompts.

Tags the model writes: <think>, <refine> (anywhere, any number), and exactly one tool call per turn:
flat agent: <search> or <answer>; CoDA planner: <task> or <answer>; CoDA executor: <search> or <answer>.
Tags only the env writes: <information> (search results) and <result> (an executor's answer to the
planner). Text outside known tags is free; unknown tags such as <b> are plain text.

`parse_action` never raises on agent text: every mistake (no tool call, two tool calls, unclosed,
unopened or nested tags, a tag the role may not use, an env-only tag, an empty argument or one without a
letter or digit such as the hint's "...", an over-long action) comes back as `ParsedAction.error`, which
the env turns into an observation and info flags.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

MODEL_TAGS = ("think", "refine", "search", "answer", "task")
ENV_TAGS = ("information", "result")
ROLE_TOOLS: dict[str, tuple[str, ...]] = {
    "agent": ("search", "answer"),
    "planner": ("task", "answer"),
    "executor": ("search", "answer"),
}
"""Tool tags each role may call (one per turn)."""
_MAX_ERRORS = 5
"""Distinct mistakes an error message lists at most."""
_TAG = re.compile(r"<(/?)(" + "|".join(MODEL_TAGS + ENV_TAGS) + r")\s*>", re.IGNORECASE)


@dataclass(frozen=True)
class ParsedAction:
    """What an action text says, or why it is invalid."""

    tool: str | None
    """The tool tag called (search, answer or task), None when the action is invalid."""
    argument: str
    """The stripped content of the tool call ("" when invalid)."""
    refines: tuple[str, ...]
    """Contents of complete <refine> blocks, valid action or not."""
    used_tags: frozenset[str]
    """Tags that appeared as complete, non-nested blocks."""
    malformed_tags: frozenset[str]
    """Tags that appeared unclosed, unopened, nested, or not allowed for the role."""
    error: str | None
    """Why the action is invalid; None when it is valid."""

    @property
    def valid(self) -> bool:
        return self.error is None


_ARGUMENT = {"search": "query", "answer": "answer", "task": "sub-question"}
"""What each tool call holds, for the error that names a placeholder argument."""


def _tool_hint(role: str) -> str:
    a, b = ROLE_TOOLS[role]
    return (
        f"write exactly one <{a}>...</{a}> or <{b}>...</{b}> (optionally after <think>...</think> "
        "and <refine>...</refine>)"
    )


def parse_action(
    text: str, role: str = "agent", max_chars: int = 16384, max_argument_chars: int = 1024
) -> ParsedAction:
    """Parse one action of `role` (agent, planner or executor).

    Args:
        text: the model's turn, as generated.
        role: whose turn it is; decides the allowed tool tags.
        max_chars: longer actions are invalid (nothing is parsed).
        max_argument_chars: longer tool arguments (queries, answers, tasks) are invalid.
    """
    if role not in ROLE_TOOLS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLE_TOOLS)}")
    if not isinstance(text, str):
        raise TypeError(f"an action is a str, got {type(text).__name__}")
    if len(text) > max_chars:
        return ParsedAction(
            None, "", (), frozenset(), frozenset(), f"action is {len(text)} characters, over the limit of {max_chars}"
        )

    blocks: list[tuple[str, str]] = []
    malformed: set[str] = set()
    errors: list[str] = []
    open_tag: tuple[str, int] | None = None  # the tag being read and where its content starts
    for match in _TAG.finditer(text):
        closing, name = match.group(1) == "/", match.group(2).lower()
        if not closing:
            if open_tag is not None:
                malformed.update((name, open_tag[0]))
                errors.append(f"<{name}> opened inside <{open_tag[0]}>; tags cannot be nested")
                open_tag = None  # resynchronise: drop the outer block
                continue
            open_tag = (name, match.end())
        elif open_tag is not None and open_tag[0] == name:
            blocks.append((name, text[open_tag[1] : match.start()]))
            open_tag = None
        else:
            malformed.add(name)
            errors.append(f"</{name}> closes nothing")
    if open_tag is not None:
        malformed.add(open_tag[0])
        errors.append(f"<{open_tag[0]}> is never closed")

    tools = ROLE_TOOLS[role]
    used = {name for name, _ in blocks}
    refines = tuple(body.strip() for name, body in blocks if name == "refine")
    for name in used:
        if name in ENV_TAGS:
            malformed.add(name)
            errors.append(f"<{name}> is written by the environment, not by you")
        elif name not in tools and name not in ("think", "refine"):
            malformed.add(name)
            errors.append(f"<{name}> is not available to the {role}")
    calls = [(name, body.strip()) for name, body in blocks if name in tools]
    if not errors:
        if not calls:
            errors.append("no tool call")
        elif len(calls) > 1:
            errors.append(f"{len(calls)} tool calls in one turn; one per turn")
        elif not calls[0][1]:
            errors.append(f"empty <{calls[0][0]}>")
        elif not any(ch.isalnum() for ch in calls[0][1]):  # "...", copied from the hint below, is no answer
            errors.append(f"<{calls[0][0]}> holds no letter or digit: write the {_ARGUMENT[calls[0][0]]} itself")
        elif len(calls[0][1]) > max_argument_chars:
            errors.append(f"<{calls[0][0]}> content is {len(calls[0][1])} characters, over {max_argument_chars}")
    used_ok = frozenset(used - malformed)
    if errors:
        distinct = list(dict.fromkeys(errors))  # a long action can repeat one mistake many times: say it once
        if len(distinct) > _MAX_ERRORS:
            distinct = [*distinct[:_MAX_ERRORS], f"and {len(distinct) - _MAX_ERRORS} more"]
        return ParsedAction(
            None, "", refines, used_ok, frozenset(malformed), "; ".join(distinct) + f": {_tool_hint(role)}"
        )
    tool, argument = calls[0]
    return ParsedAction(tool, argument, refines, used_ok, frozenset(malformed), None)


FLAT_INSTRUCTIONS = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> every time you get new "
    "information. If you lack some knowledge, call a search engine with <search> query </search> and it returns "
    "the top results between <information> and </information>. You can search as many times as you want. You may "
    "summarize the evidence you found inside <refine> and </refine>. When no further knowledge is needed, give the "
    "answer inside <answer> and </answer> without explanation, for example <answer> Beijing </answer>. "
    "Write one <search> or one <answer> per turn."
)
PLANNER_INSTRUCTIONS = (
    "You are a planner answering a multi-hop question. Break it into simple sub-questions and delegate one per "
    "turn with <task> sub-question </task>; a worker searches for it and returns its answer between <result> and "
    "</result>. Think inside <think> and </think>. When you can answer the question, give the answer inside "
    "<answer> and </answer> without explanation. Write one <task> or one <answer> per turn."
)
EXECUTOR_INSTRUCTIONS = (
    "You are a search worker solving one sub-question. Call a search engine with <search> query </search>; it "
    "returns results between <information> and </information>. Summarize the evidence inside <refine> and "
    "</refine>, then give a short answer to the sub-question inside <answer> and </answer>. "
    "Write one <search> or one <answer> per turn."
)
INSTRUCTIONS = {"agent": FLAT_INSTRUCTIONS, "planner": PLANNER_INSTRUCTIONS, "executor": EXECUTOR_INSTRUCTIONS}
"""The default ("search-r1") instructions: the flat one is Search-R1's prompt with <refine> added."""

SHORT_INSTRUCTIONS = {
    "agent": (
        "Answer the question. Search with <search> query </search>; results come back in <information> "
        "</information>. Quote the evidence in <refine> </refine>, then answer in <answer> </answer>. "
        "Write one <search> or one <answer> per turn."
    ),
    "planner": (
        "Answer the multi-hop question. Delegate one sub-question per turn with <task> sub-question </task>; a "
        "worker answers it in <result> </result>. When you can, answer in <answer> </answer>. "
        "Write one <task> or one <answer> per turn."
    ),
    "executor": (
        "Answer the sub-question. Search with <search> query </search>; results come back in <information> "
        "</information>. Quote the evidence in <refine> </refine>, then answer in <answer> </answer>. "
        "Write one <search> or one <answer> per turn."
    ),
}
"""The "short" instructions: the same protocol in about half the tokens (SmolLM2: 59/62/61 tokens against 126/94/80).
Every context starts with them, so on a CPU they are tokens the trainer does not spend on instructions."""

INSTRUCTION_STYLES = {"search-r1": INSTRUCTIONS, "short": SHORT_INSTRUCTIONS}


def user_message(role: str, text: str) -> str:
    """The first user message of a context: the question (agent, planner) or the task (executor)."""
    return f"Task: {text}" if role == "executor" else f"Question: {text}"


OBSERVATION_FORMATS = ("redcoda", "search_r1")
"""How search results are shown: ours (`format_passages`) or Search-R1's trainer's (`format_passages_search_r1`)."""


def format_passages(passages, max_words: int) -> str:
    """Search results as the model sees them: `<information>Doc 1 (Title: "..") text ...</information>`."""
    if not passages:
        return "<information>No results.</information>"
    docs = [f'Doc {i} (Title: "{p.title}") {_shorten(p.text, max_words)}' for i, p in enumerate(passages, 1)]
    return "<information>" + "\n".join(docs) + "</information>"


@functools.lru_cache(maxsize=1 << 13)
def _shorten(text: str, max_words: int) -> str:
    """`text` as a search result shows it: its first `max_words` words one space apart, " ..." when it had more.

    Remembered for the last 8,192 paragraphs (about 4 MB): the G episodes of a question retrieve the same paragraphs,
    and splitting one into words was the largest part of the env's own work in a search step.
    """
    words = text.split(None, max_words)  # at most max_words + 1 pieces: the rest stays unsplit
    return " ".join(words[:max_words]) + (" ..." if len(words) > max_words else "")


def format_passages_search_r1(passages) -> str:
    """Search results exactly as Search-R1's trainer shows them, so a model it trained sees what it was trained on.

    Each passage becomes its corpus ``contents`` (``"Title"\\ntext``); its first line is the title and the rest the
    text, written ``Doc 1(Title: "..") text`` (no space before the parenthesis, the whole text), one line per
    passage, the block stripped and wrapped in ``<information>``. An empty result is an empty block.
    """
    docs = []
    for i, passage in enumerate(passages, 1):
        title, _, text = passage.contents.partition("\n")
        docs.append(f"Doc {i}(Title: {title}) {text}\n")
    return "<information>" + "".join(docs).strip() + "</information>"
