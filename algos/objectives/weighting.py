"""How much the SFT term weighs at each step: one small object per rule (none, fixed, RED).

The three trainers share one loop (`algos.learners.trainer`, whose docstring states the step) and differ only in the
rule: the loop asks `SFTWeighting.weight` before the update, hands the SFT batch's entropy to `observe_sft_entropy`
after it, and logs `metrics`.

``rl_entropy`` is the RL batch entropy estimate (`algos.objectives.losses.entropy_estimate`), ``batch_accuracy``
the share of rollouts whose answer has F1 > 0 (`algos.batch.answer_accuracy`), ``h_sft`` the mean
predictive entropy of the model on the SFT batch's assistant tokens (`token_logprobs_and_entropy`
then `masked_mean`). Every rule reports ``sft/weight``, so runs of different rules share a plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = ["FixedSFT", "NoSFT", "RED", "SFTWeighting"]


@runtime_checkable
class SFTWeighting(Protocol):
    """A rule for the SFT term's weight ``w``; the term's coefficient is ``w * sft_coef``."""

    uses_sft: ClassVar[bool]
    """False when the weight is always 0, so the trainer needs no demonstrations at all."""

    def weight(self, *, rl_entropy: float, batch_accuracy: float) -> float:
        """Returns this step's weight; called once per step, before the update."""
        ...

    def observe_sft_entropy(self, h: float) -> None:
        """Records the SFT predictive entropy measured on this step's SFT batch; called after the update."""
        ...

    def metrics(self) -> dict[str, float]:
        """Scalars to log for the last step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the rule exactly (floats and None only)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        ...


class _Constant:
    """A rule whose weight never changes: it ignores the entropies and accuracy, and has no state to keep."""

    value: ClassVar[float]

    def weight(self, *, rl_entropy: float, batch_accuracy: float) -> float:
        return self.value

    def observe_sft_entropy(self, h: float) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"sft/weight": self.value}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class NoSFT(_Constant):
    """Plain GRPO: ``w = 0``."""

    uses_sft: ClassVar[bool] = False
    value: ClassVar[float] = 0.0


class FixedSFT(_Constant):
    """GRPO + SFT with a fixed coefficient: ``w = 1`` (the term weighs ``sft_coef``, 0.1 by default)."""

    uses_sft: ClassVar[bool] = True
    value: ClassVar[float] = 1.0


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


class RED:
    """RED-inspired dynamic SFT weight: Recall-Extend Dynamics (arXiv 2508.16677), adapted to search agents.

    RED was proposed for math reasoning; here it weighs the SFT term on oracle search demonstrations.

    With ``G`` the bound (``max_factor``, 5 by default; unrelated to the GRPO group size):

    - ``H_rl`` = EMA (``decay`` 0.99) of the RL batch entropy estimate, updated in `weight`, before the
      update; ``H_sft`` = EMA (0.99) of the SFT predictive entropy, updated in `observe_sft_entropy`,
      after the update. ``dH_rl`` and ``dH_sft`` are the last changes of these EMAs.
    - entropy weight ``= clip(|dH_sft| / (|dH_rl| + 1e-8), 1, G)``: more SFT while SFT still moves the
      model's entropy more than RL does.
    - accuracy factor ``= clip(G ** (1 - 2 * acc), 1/G, G)`` (G at acc 0, 1 at 0.5, 1/G at 1): more SFT
      while the policy rarely finds the answer; 1 when ``use_accuracy`` is False.
    - ``w = clip(entropy weight * accuracy factor, 1, G**2)``.

    ``G = 1`` pins every factor to 1, so RED reduces to `FixedSFT`.

    First steps. The first observation of either entropy sets its EMA, and that EMA's change counts as 0
    (no history to change from). So at step 1 both changes are 0 and at step 2 ``dH_sft`` is still 0
    (``H_sft`` was observed once, after step 1): the ratio is 0 and the entropy weight sits at its lower
    bound 1, the neutral value, until ``H_sft`` has changed once (from step 3 on). The accuracy factor
    acts from step 1. Should ``dH_rl`` be exactly 0 later while ``dH_sft`` is not, the ratio is huge and
    the weight clips to ``G``, as the formula says.

    Args:
        max_factor: ``G``, the bound of each factor; ``w`` lies in ``[1, G**2]``.
        decay: EMA decay of both entropies.
        use_accuracy: Include the accuracy factor.
    """

    uses_sft: ClassVar[bool] = True

    def __init__(self, max_factor: float = 5.0, decay: float = 0.99, use_accuracy: bool = True) -> None:
        if max_factor < 1:
            raise ValueError(f"max_factor (G) must be >= 1, got {max_factor}")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.max_factor = float(max_factor)
        self.decay = float(decay)
        self.use_accuracy = use_accuracy
        self.h_rl: float | None = None
        """EMA of the RL batch entropy; None before the first step."""
        self.h_sft: float | None = None
        """EMA of the SFT predictive entropy; None before the first observation."""
        self.dh_rl = 0.0
        """Last change of ``h_rl``."""
        self.dh_sft = 0.0
        """Last change of ``h_sft``."""
        self._metrics: dict[str, float] = {}

    def _ema(self, ema: float | None, x: float) -> tuple[float, float]:
        """Returns the updated EMA and its change; the first observation sets it, with change 0."""
        if not math.isfinite(x):
            raise ValueError(f"entropy must be finite, got {x}")
        if ema is None:
            return x, 0.0
        new = self.decay * ema + (1.0 - self.decay) * x
        return new, new - ema

    def weight(self, *, rl_entropy: float, batch_accuracy: float) -> float:
        """Updates ``H_rl`` with this batch's entropy estimate and returns ``w``.

        Args:
            rl_entropy: RL batch entropy estimate (nats), before the update.
            batch_accuracy: Share of this batch's rollouts with answer F1 > 0, in ``[0, 1]``.

        Returns:
            The SFT weight ``w`` in ``[1, G**2]``.
        """
        if not 0.0 <= batch_accuracy <= 1.0:
            raise ValueError(f"batch_accuracy must be in [0, 1], got {batch_accuracy}")
        g = self.max_factor
        self.h_rl, self.dh_rl = self._ema(self.h_rl, float(rl_entropy))
        entropy_weight = _clip(abs(self.dh_sft) / (abs(self.dh_rl) + 1e-8), 1.0, g)
        accuracy_factor = _clip(g ** (1.0 - 2.0 * batch_accuracy), 1.0 / g, g) if self.use_accuracy else 1.0
        w = _clip(entropy_weight * accuracy_factor, 1.0, g**2)
        self._metrics = {
            "red/entropy_weight": entropy_weight,
            "red/accuracy_factor": accuracy_factor,
            "red/final_weight": w,
            "red/batch_accuracy": float(batch_accuracy),
            "red/h_rl": self.h_rl,
            "red/dh_rl": self.dh_rl,
            "red/dh_sft": self.dh_sft,
            "sft/weight": w,
        }
        return w

    def observe_sft_entropy(self, h: float) -> None:
        """Updates ``H_sft`` with the SFT predictive entropy measured after the update.

        Args:
            h: Mean predictive entropy (nats) on the SFT batch's assistant tokens.
        """
        self.h_sft, self.dh_sft = self._ema(self.h_sft, float(h))
        self._metrics["red/h_sft"] = self.h_sft

    def metrics(self) -> dict[str, float]:
        """``red/entropy_weight``, ``red/accuracy_factor``, ``red/final_weight``, ``red/batch_accuracy``,
        the EMAs and their last changes, and ``sft/weight``; empty before the first step."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        """The EMAs and their last changes (the settings live in the trainer's config)."""
        return {"h_rl": self.h_rl, "h_sft": self.h_sft, "dh_rl": self.dh_rl, "dh_sft": self.dh_sft}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the EMAs and their last changes."""
        self.h_rl = None if state["h_rl"] is None else float(state["h_rl"])
        self.h_sft = None if state["h_sft"] is None else float(state["h_sft"])
        self.dh_rl = float(state["dh_rl"])
        self.dh_sft = float(state["dh_sft"])
