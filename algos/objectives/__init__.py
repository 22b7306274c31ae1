"""What a researcher swaps in the RL term: advantage estimators, policy losses and loss aggregations, registered by
name (`registry`), the built-in ones (`advantages`, `policy_losses`), and which settings a run honours (`honours`).

    from algos.objectives import Advantages, Estimator, StepInput, register_advantage
"""

from algos.objectives.registry import (
    Aggregation,
    Estimator,
    PolicyLoss,
    register_advantage,
    register_aggregation,
    register_policy_loss,
)

__all__ = [
    "Advantages",
    "Aggregation",
    "Estimator",
    "PolicyLoss",
    "StepInput",
    "register_advantage",
    "register_aggregation",
    "register_policy_loss",
]


def __getattr__(name: str) -> object:
    """`StepInput` and `Advantages` import torch: only when asked for, so that reading the tables stays light."""
    if name in ("StepInput", "Advantages"):
        from algos.objectives import advantages

        return getattr(advantages, name)
    raise AttributeError(f"module 'algos.objectives' has no attribute {name!r}")
