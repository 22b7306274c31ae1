"""The import contract of the source tree: one-way layers and no import circle.

The layers, lowest first, are ``retrievers < envs < agents < algos < benchmarks``: a module imports only from its
own layer or a lower one, so nothing below ``benchmarks/`` (scripts) imports it, and training never depends on a
benchmark script. Every import counts for the layers: module-level and function-level ones, ``import x``,
``from x import y``, relative imports, and imports under ``if TYPE_CHECKING:`` (a type is a dependency too).

A circle is a cycle in the graph of module-to-module imports (``from package import module`` is an edge to the
module). Among the imports that run when a module is imported (outside any function body, not under ``if
TYPE_CHECKING:``), a cycle makes what a module sees depend on which module was imported first; and a cycle that
goes through an import inside a function is still a circle of dependencies, only deferred, so it is refused too.
Imports under ``if TYPE_CHECKING:`` never run and are left out of both graphs.

The checks read the files with `ast` and import nothing, so they see every file, optional dependencies or not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("retrievers", "envs", "agents", "algos", "benchmarks")
"""The layered packages, lowest first: each may import its own and the ones before it."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, as a module of the tree."""

    importer: str
    """The importing module (dotted name)."""
    target: str
    """The imported module (dotted name; a ``from m import name`` of a non-module name targets ``m``)."""
    line: int
    """Line of the statement in the importer."""
    in_function: bool
    """The statement is inside a function body: it runs when the function is called, not at the module's import."""
    type_only: bool
    """The statement is under ``if TYPE_CHECKING:``: it never runs."""


def module_name(path: Path, root: Path) -> str:
    """The dotted module name of the file at `path` under `root` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path) -> dict[str, Path]:
    """Every module of the layered packages under `root`, by dotted name."""
    files = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            files[module_name(path, root)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


_Found = tuple[ast.Import | ast.ImportFrom, bool, bool]


def _import_nodes(tree: ast.AST) -> Iterator[_Found]:
    """Each import statement of `tree`, whether it is inside a function, and whether it is under TYPE_CHECKING."""

    def walk(nodes: list[ast.AST], in_function: bool, type_only: bool) -> Iterator[_Found]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, in_function, type_only
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(list(ast.iter_child_nodes(node)), True, type_only)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, in_function, True)
                yield from walk(node.orelse, in_function, type_only)
            else:
                yield from walk(list(ast.iter_child_nodes(node)), in_function, type_only)

    yield from walk([tree], False, False)


def _resolve(name: str, modules: set[str]) -> str:
    """`name` or its longest prefix that is a module of the tree (an attribute import targets its module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return name


def imports(root: Path) -> list[Import]:
    """Every import, by any module of the layered packages under `root`, of a module of those packages."""
    files = source_files(root)
    modules = set(files)
    found = []
    for importer, path in files.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, in_function, type_only in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: the importer's package, one level up per extra dot
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    stem = ".".join([*base, node.module] if node.module else base)
                else:
                    stem = node.module or ""
                # `from package import module` targets the module, `from module import name` the module itself
                targets = [
                    f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names
                ]
            for target in targets:
                if target.split(".")[0] in LAYERS:
                    found.append(Import(importer, _resolve(target, modules), node.lineno, in_function, type_only))
    return found


def layer_violations(root: Path) -> list[str]:
    """Each import of a higher layer by a lower one, as ``importer:line imports target (low < high)``."""
    rank = {package: i for i, package in enumerate(LAYERS)}
    out = []
    for imp in imports(root):
        low, high = imp.importer.split(".")[0], imp.target.split(".")[0]
        if rank[high] > rank[low]:
            out.append(f"{imp.importer}:{imp.line} imports {imp.target} ({low} < {high})")
    return sorted(set(out))


def import_cycles(root: Path, *, in_functions: bool = False, type_only: bool = False) -> list[list[str]]:
    """The cycles among the imports under `root` that run, each as the modules around it (first one repeated).

    Args:
        root: the source tree.
        in_functions: also follow the imports inside function bodies (False: module-level imports only).
        type_only: also follow the imports under ``if TYPE_CHECKING:`` (a type is a dependency too).

    A depth-first search reports a cycle at each edge back to a module still on the stack, each cycle once,
    rotated to start at its smallest module; every strongly connected group of modules yields at least one.
    """
    graph: dict[str, set[str]] = {}
    for imp in imports(root):
        if (type_only or not imp.type_only) and (in_functions or not imp.in_function) and imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    cycles: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :]
                start = cycle.index(min(cycle))
                cycles.add(tuple(cycle[start:] + cycle[:start]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return [[*cycle, cycle[0]] for cycle in sorted(cycles)]


def test_imports_follow_the_layers() -> None:
    violations = layer_violations(ROOT)
    assert not violations, "imports against the layers " + " < ".join(LAYERS) + ":\n" + "\n".join(violations)


def test_no_import_circle() -> None:
    cycles = import_cycles(ROOT)
    assert not cycles, "module-level import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_import_circle_through_function_bodies() -> None:
    cycles = import_cycles(ROOT, in_functions=True)
    assert not cycles, "import circles (through function-level imports):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_no_import_circle_through_type_checking() -> None:
    """A circle that only type hints close is still two modules that cannot be understood apart."""
    cycles = import_cycles(ROOT, in_functions=True, type_only=True)
    assert not cycles, "import circles (through TYPE_CHECKING imports):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_the_checks_see_every_kind_of_import(tmp_path: Path) -> None:
    """A small tree with one import of each kind: the checks find exactly the violations and the circles in it."""
    files = {
        "retrievers/__init__.py": "",
        "retrievers/a.py": "from . import b\n",
        "retrievers/b.py": "from .c import thing\n",
        "retrievers/c.py": "import retrievers.a\n",
        "retrievers/d.py": "def f():\n    from envs import x\n",
        "envs/__init__.py": "",
        "envs/x.py": (
            "from typing import TYPE_CHECKING\nimport retrievers.b\nif TYPE_CHECKING:\n    from agents.y import Agent\n"
        ),
        "agents/__init__.py": "",
        "agents/y.py": "def g():\n    import envs.x\n",
        "algos/__init__.py": "",
        "algos/z.py": "def h():\n    from benchmarks.s import run\n",
        "benchmarks/__init__.py": "",
        "benchmarks/s.py": "from algos import z\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(tmp_path) == [
        "algos.z:2 imports benchmarks.s (algos < benchmarks)",
        "envs.x:4 imports agents.y (envs < agents)",
        "retrievers.d:2 imports envs.x (retrievers < envs)",
    ]
    # module-level imports make one circle; agents.y -> envs.x (in a function) and envs.x -> agents.y (type only)
    # do not, and algos.z -> benchmarks.s (in a function) and benchmarks.s -> algos.z make one through a function
    assert import_cycles(tmp_path) == [["retrievers.a", "retrievers.b", "retrievers.c", "retrievers.a"]]
    assert import_cycles(tmp_path, in_functions=True) == [
        ["algos.z", "benchmarks.s", "algos.z"],
        ["retrievers.a", "retrievers.b", "retrievers.c", "retrievers.a"],
    ]
