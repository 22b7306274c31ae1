"""`--help` is tyro's own: one group per section of `Config`, every flag once, without what the entry point fixes."""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections import Counter

import pytest

from algos.config import Config
from algos.settings import SECTION_OF, SECTIONS

ENTRIES = {
    "red_grpo": "algos.config.Config",
    "grpo": "algos.config.Config",
    "grpo_sft": "algos.config.Config",
    "grpo_expert": "algos.learners.expert.ExpertConfig",
    "sft": "algos.config.Config",
    "ppo": "algos.learners.ppo.PPOConfig",
    "archer": "algos.learners.archer.ArCHerConfig",
}
"""Each entry point and the settings class it parses (`algos.run.launch.main`'s ``config_cls``)."""


def test_every_setting_is_in_exactly_one_section():
    named = Counter(field.name for cls in SECTIONS.values() for field in dataclasses.fields(cls))
    assert {name for name, count in named.items() if count > 1} == set()  # flat names stay unique
    assert set(named) == set(SECTION_OF) == set(Config.flat_types())
    assert [field.name for field in dataclasses.fields(Config)] == list(SECTIONS)


def _help_groups(text: str) -> dict[str, list[str]]:
    """The flags of each group of tyro's help, by the group's title (``env options``), in the order shown.

    tyro frames each group on a terminal (its title in the top rule) and writes the title above a rule otherwise. An
    entry's first line starts with its flags (a boolean's ``--x, --no-x``, an alias's ``--env-id ..., --env ...``);
    its help, and the help's wrapped lines, start further in.
    """
    groups: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        bare = line.strip().strip("╭╮─-+ ")
        if re.fullmatch(r"[\w ]*options", bare):
            title = bare
            groups[title] = []
            continue
        entry = re.match(r"(?:[│|] | {0,2})(--[\w-].*)", line)
        if title is not None and entry:
            groups[title] += re.findall(r"(?:^|, )(--[\w-]+)", entry.group(1))
    return groups


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_help_shows_each_section_as_a_group_and_every_flag_once(entry, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # one column of groups (a wide terminal gets several side by side)
    module = importlib.import_module(f"algos.{entry}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--preset", "tiny", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    groups = _help_groups(text)
    where, name = ENTRIES[entry].rsplit(".", 1)
    config_cls = getattr(importlib.import_module(where), name)
    own = [field.name for field in dataclasses.fields(config_cls) if field.name not in SECTIONS]
    assert list(groups) == ["options", *(f"{attr} options" for attr in SECTIONS)]
    for attr, cls in SECTIONS.items():
        expected = {f"--{field.name.replace('_', '-')}" for field in dataclasses.fields(cls)} - {"--algo"}
        assert expected <= set(groups[f"{attr} options"]), attr
    assert {f"--{name.replace('_', '-')}" for name in own} <= set(groups["options"])  # a learner's own settings
    shown = Counter(flag for flags in groups.values() for flag in flags)
    every = {f"--{name.replace('_', '-')}" for name in config_cls.flat_types()} - {"--algo"}
    assert set(every) <= set(shown) and all(shown[flag] == 1 for flag in every)
    assert "--algo" not in text  # fixed by the entry point, so hidden: neither a flag nor a word of the help
    assert "--lr FLOAT" in text and "--resume, --no-resume" in text
    assert "--adam-betas FLOAT FLOAT" in text and "FLOAT FLOAT FLOAT" not in text  # tyro's metavars, as they are


def test_help_shows_the_presets_values_as_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    from algos.presets import PRESETS
    from algos.red_grpo import main

    with pytest.raises(SystemExit):
        main(["--preset", "tiny", "--help"])
    words = " ".join(capsys.readouterr().out.split())  # the help's lines wrap at the terminal's width
    assert re.search(rf"--steps INT Training steps [^-]*\(default: {PRESETS['tiny']['steps']}\)", words)
    assert PRESETS["tiny"]["steps"] != Config().optim.steps


def test_the_fixed_algo_is_no_flag(capsys):
    from algos.grpo import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--algo", "red_grpo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
