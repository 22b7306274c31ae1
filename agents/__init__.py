"""Samplers, the flat and CoDA agents, the oracle teacher and the rollout collector (needs the `train` extra)."""

import importlib.util

_MISSING = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
if _MISSING:
    # One hint here instead of a bare ModuleNotFoundError from whichever agent module imports torch first.
    raise ImportError(f"agents need the train extra ({', '.join(_MISSING)} missing): pip install 'redcoda[train]'")
