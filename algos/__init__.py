"""The trainers (needs the `train` extra): the registered algorithms (`registry`: the GRPO family, SFT, PPO, ArCHer,
RLOO, REINFORCE++, Dr. GRPO, GSPO and any another package registers), the pieces a researcher swaps in the RL term
(`objectives`: estimators, policy losses, aggregations), the SFT weighting rules (`weighting`), the learners and the
run around them (`run`)."""

import importlib.util

_MISSING = [
    name for name in ("torch", "transformers", "tensordict", "torchrl") if importlib.util.find_spec(name) is None
]
if _MISSING:
    # One hint here instead of a bare ModuleNotFoundError from whichever trainer module imports torch first.
    raise ImportError(f"algos needs the train extra ({', '.join(_MISSING)} missing): pip install 'redcoda[train]'")
