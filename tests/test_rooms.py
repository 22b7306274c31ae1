"""Rooms of a livable size: every source file of the layered packages stays readable in one sitting.

No file over 600 lines, no function or method over 80 (from its ``def`` line to its last line), and module docstrings
of at most 25 lines (measurements live in docs/results, not in docstrings). The checks read the files with `ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("retrievers", "envs", "agents", "algos", "benchmarks")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_DOCSTRING_LINES = 600, 80, 25
SOURCES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_source_file_is_a_room_of_livable_size(path: Path):
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: split it into cohesive modules"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"
    docstring = ast.get_docstring(tree) or ""
    assert len(docstring.splitlines()) <= MAX_DOCSTRING_LINES, f"{path.name}: module docstring too long"


def test_the_checks_see_the_tree():
    assert len(SOURCES) > 50 and any(p.name == "trainer.py" for p in SOURCES)
