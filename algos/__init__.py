"""Losses, SFT weighting rules and the GRPO / GRPO+SFT / GRPO+RED trainers (needs the `train` extra)."""

import importlib.util

_MISSING = [
    name for name in ("torch", "transformers", "tensordict", "torchrl") if importlib.util.find_spec(name) is None
]
if _MISSING:
    # One hint here instead of a bare ModuleNotFoundError from whichever trainer module imports torch first.
    raise ImportError(f"algos needs the train extra ({', '.join(_MISSING)} missing): pip install 'redcoda[train]'")
