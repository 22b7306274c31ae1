"""RedCoda's env where other trainers already look for environments: OpenEnv, verifiers and SkyRL-gym.

Each adapter lives in its own module and needs its own extra; nothing here is imported by `import envs`:

    python -m envs.frameworks.openenv_server --protocol coda   # OpenEnv server (`pip install 'redcoda[openenv]'`)
    from envs.frameworks.openenv_client import RedCodaEnv, RedCodaAction          # its client, openenv-core's style
    from envs.frameworks.verifiers_env import load_environment  # verifiers (`redcoda[verifiers]`)
    import envs.frameworks.skyrl                               # registers "redcoda" in skyrl_gym (`redcoda[skyrl]`)

Every adapter plays a real RAGEnv (the same reward, info and protocols as `gym.make`): the adapters translate types,
never rules. Importing an adapter without its extra raises `gymnasium.error.DependencyNotInstalled` with one line
that names the extra; run as a command (``python -m``), it prints that line and exits.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from gymnasium.error import DependencyNotInstalled

EXTRAS = {"openenv": "openenv-core", "verifiers": "verifiers", "skyrl": "skyrl-gym"}
"""The extra of each adapter and the package it installs."""


def require(module: str, extra: str, caller: str = "") -> ModuleType:
    """Import `module` (a package of `extra`), or fail with one line that names the extra.

    Args:
        module: The module to import (``"openenv"``, ``"verifiers"``, ``"skyrl_gym"``).
        extra: The extra that installs it (a key of `EXTRAS`).
        caller: The importing module's ``__name__``: as ``"__main__"`` (a command) the line is printed and the
            process exits with status 1 instead of raising.

    Raises:
        DependencyNotInstalled: The package is missing.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        line = f"{EXTRAS[extra]} is not installed: pip install 'redcoda[{extra}]'"
        if caller == "__main__":
            sys.exit(f"error: {line}")
        raise DependencyNotInstalled(line) from err


def jsonable(value: Any) -> Any:
    """`value` as JSON carries it: dicts with str keys, lists for tuples and sets (sorted), plain numbers; a
    non-finite float becomes None (JSON has no NaN), anything else its ``str``. What every adapter puts in its info."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


def json_roundtrip(value: Any) -> Any:
    """`value` after a trip through JSON text (what a client on the other side of a socket reads)."""
    return json.loads(json.dumps(jsonable(value)))


__all__ = ["EXTRAS", "json_roundtrip", "jsonable", "require"]
