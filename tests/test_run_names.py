"""A run's name becomes one directory (``runs/<run_name>``) and the heading of its model card: a name with a path
separator, a control or format character (a newline, an escape sequence, a zero-width mark), ``.``/``..`` or more than
255 bytes is refused at parse time in one line; what a name may hold is written as text where it is shown."""

from __future__ import annotations

import pytest

from algos.config import preset_config
from algos.run.cli import parse_config
from algos.run.outputs import model_card


@pytest.mark.parametrize(
    "name",
    ["evil\n---\n<script>x</script>", "a/b", "a\\b", "..", ".", "", "red\x1b[31m", "tab\there", "a\u200bb", "é" * 128],
)
def test_a_name_that_cannot_be_one_directory_is_refused_in_one_line(name, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_config(["--preset", "tiny", "--run-name", name], algo="grpo")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --run-name must be a name of at most 255 bytes without path separators")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("name", ["red-grpo_seed.0", "é" * 127, "<b>x & y"])
def test_a_plain_name_names_the_run_directory(name, tmp_path):
    config = parse_config(["--preset", "tiny", "--run-name", name], algo="grpo")
    assert config.run.output_dir.name == name


def test_the_model_card_shows_the_name_as_text():
    card = model_card(preset_config("tiny", algo="grpo", run_name="<b>x & y", eval_questions=0), steps=1)
    assert "\n# &lt;b&gt;x &amp; y\n" in card.content and "<b>" not in card.content
