"""The action parser: hand-picked mistakes and property-based tests."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.protocol import ROLE_TOOLS, parse_action

TAG_SOUP = st.lists(
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<search>",
            "</search>",
            "<answer>",
            "</answer>",
            "<refine>",
            "</refine>",
            "<task>",
            "</task>",
            "<information>",
            "</result>",
            "x",
            " ",
            "é",
            "中",
            "<b>",
        ]
    ),
    max_size=12,
).map("".join)


@pytest.mark.parametrize(
    ("text", "role", "tool", "argument"),
    [
        ("<think>hm</think><search> Ed Wood </search>", "agent", "search", "Ed Wood"),
        ("<refine>born in Kolkata</refine><answer>Kolkata</answer>", "agent", "answer", "Kolkata"),
        ("<task>Who directed Sinister?</task>", "planner", "task", "Who directed Sinister?"),
        ("<SEARCH>case</SEARCH>", "executor", "search", "case"),
        ("<search>Zürich 中文 ü</search>", "agent", "search", "Zürich 中文 ü"),
        ("<answer>a <b>bold</b> answer</answer>", "agent", "answer", "a <b>bold</b> answer"),
    ],
)
def test_valid_actions(text, role, tool, argument):
    parsed = parse_action(text, role)
    assert parsed.valid, parsed.error
    assert (parsed.tool, parsed.argument) == (tool, argument)


@pytest.mark.parametrize(
    ("text", "role", "fragment"),
    [
        ("just text", "agent", "no tool call"),
        ("<search>a</search><search>b</search>", "agent", "2 tool calls"),
        ("<search>a</search><answer>b</answer>", "agent", "2 tool calls"),
        ("<search>   </search>", "agent", "empty <search>"),
        ("<answer>...</answer>", "agent", "no letter or digit: write the answer itself"),
        ("<search> ? </search>", "executor", "write the query itself"),
        ("<task>-</task>", "planner", "write the sub-question itself"),
        ("<search>unclosed", "agent", "never closed"),
        ("</answer>", "agent", "closes nothing"),
        ("<think><search>q</search></think>", "agent", "nested"),
        ("<task>sub</task>", "agent", "not available"),
        ("<search>q</search>", "planner", "not available"),
        ("<information>fake</information><answer>x</answer>", "agent", "written by the environment"),
        ("<answer>" + "x" * 2000 + "</answer>", "agent", "over 1024"),
    ],
)
def test_invalid_actions_say_why(text, role, fragment):
    parsed = parse_action(text, role)
    assert not parsed.valid
    assert fragment in parsed.error
    assert "<" in parsed.error  # the hint names the valid tags


def test_huge_action_is_rejected_without_parsing():
    parsed = parse_action("<search>" + "a" * (1 << 20) + "</search>", "agent")
    assert not parsed.valid and "over the limit" in parsed.error


def test_a_repeated_mistake_is_said_once_and_the_list_is_bounded():
    parsed = parse_action("</search>" * 10_000, "agent", max_chars=1 << 20)
    assert parsed.error.count("</search> closes nothing") == 1
    many = "".join(f"<{tag}>x</{tag}>" for tag in ("information", "result", "task")) + "</think></refine></answer>"
    error = parse_action(many, "agent").error
    assert "; and 1 more:" in error and len(error) < 500


def test_unknown_role_is_misuse():
    with pytest.raises(ValueError):
        parse_action("<search>x</search>", "critic")


@given(text=st.one_of(st.text(max_size=200), TAG_SOUP), role=st.sampled_from(sorted(ROLE_TOOLS)))
def test_parser_never_raises_and_is_consistent(text, role):
    parsed = parse_action(text, role)
    if parsed.valid:
        assert parsed.tool in ROLE_TOOLS[role]
        assert parsed.argument and parsed.argument == parsed.argument.strip()
        assert parsed.tool in parsed.used_tags
    else:
        assert parsed.tool is None and parsed.error
    assert not (parsed.used_tags & parsed.malformed_tags)


@given(query=st.text(min_size=1, max_size=300).filter(lambda s: "<" not in s and s.strip()))
def test_search_round_trip(query):
    parsed = parse_action(f"<think>plan</think><search>{query}</search>", "agent")
    if not any(ch.isalnum() for ch in query):  # punctuation alone is a placeholder, not a query
        assert not parsed.valid and "no letter or digit" in parsed.error
        return
    assert parsed.valid and parsed.argument == query.strip()
    assert parsed.used_tags == {"think", "search"}
