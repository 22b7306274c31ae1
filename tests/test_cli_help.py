"""`--help` lays the flags out in `FLAG_GROUPS`' groups and leaves out what the entry point fixes."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from algos.config import FLAG_GROUPS, Config


def test_every_field_is_in_exactly_one_group():
    grouped = Counter(name for names in FLAG_GROUPS.values() for name in names)
    fields = {field.name for field in dataclasses.fields(Config)}
    assert {name for name, count in grouped.items() if count > 1} == set()
    assert set(grouped) == fields


@pytest.mark.parametrize("entry", ["red_grpo", "grpo", "grpo_sft", "grpo_expert", "sft", "ppo", "archer"])
def test_help_shows_the_groups_without_the_fixed_algo(entry, capsys):
    import importlib

    module = importlib.import_module(f"algos.{entry}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--preset", "tiny", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for title in FLAG_GROUPS:
        assert f"\n{title}:\n" in text, title
    assert "--algo" not in text
    assert "--lr FLOAT" in text and "--resume, --no-resume" in text
    assert "--adam-betas FLOAT FLOAT" in text and "FLOAT FLOAT FLOAT" not in text  # tyro's metavars, as they are
