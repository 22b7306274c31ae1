"""Print the lower bound of every requirement of the core and the given extras as a pin (``name==version``).

    python .ci/floors.py lucene dense server train dev > floors.txt

`.ci/floors` installs the project with these pins as constraints and runs a slice of the tests on them: a floor
the code outgrew fails there, not on a user's machine. CI does not run it (a second torch install of several GB);
run it when a dependency or a floor changes (docs/install.md, "Version floors").
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def floors(extras: list[str]) -> dict[str, str]:
    """Lower bounds (``>=``) of the core requirements and of `extras`, by package name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    out = {}
    for requirement in requirements:
        found = re.match(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)", requirement)
        if found and found[1] != project["name"]:
            name, version = found[1].lower(), found[2]
            out[name] = max(out.get(name, version), version, key=_key)
    return out


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


if __name__ == "__main__":
    for name, version in sorted(floors(sys.argv[1:]).items()):
        print(f"{name}=={version}")
