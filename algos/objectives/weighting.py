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

__all__ = ["FixedSFT", "NoSFT", "RED", "SFTWeighting", "Trend"]


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
        """Everything needed to resume the rule exactly (floats, lists of floats and None only)."""
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


class Trend:
    """The last ``window`` observations of one quantity, one a step: their mean, slope and the slope's standard error.

    The slope is the least-squares line through the window's values against their step numbers (nats a step for an
    entropy); its standard error is the residuals' spread divided by ``sqrt(sum((t - mean t)^2))``. ``change`` is the
    part of the slope beyond one standard error, ``sign(slope) * max(|slope| - se, 0)``: a change inside the
    estimate's own noise counts as none. Fewer than 3 values give no standard error, so their change counts as 0.

    Args:
        window: How many of the latest observations to keep (>= 3).
    """

    def __init__(self, window: int) -> None:
        if window < 3:
            raise ValueError(f"a trend needs a window of at least 3 steps (a slope and its error), got {window}")
        self.window = int(window)
        self.values: list[float] = []

    def add(self, x: float) -> None:
        """Appends this step's value, dropping the oldest beyond the window."""
        if not math.isfinite(x):
            raise ValueError(f"value must be finite, got {x}")
        self.values = [*self.values, float(x)][-self.window :]

    @property
    def mean(self) -> float:
        """The window's mean (nan while empty)."""
        return sum(self.values) / len(self.values) if self.values else math.nan

    def slope_and_error(self) -> tuple[float, float]:
        """The least-squares slope a step and its standard error; ``(0, nan)`` with fewer than 3 values."""
        n = len(self.values)
        if n < 3:
            return 0.0, math.nan
        t_mean, y_mean = (n - 1) / 2, self.mean
        sxx = sum((t - t_mean) ** 2 for t in range(n))
        slope = sum((t - t_mean) * (y - y_mean) for t, y in enumerate(self.values)) / sxx
        residuals = sum((y - y_mean - slope * (t - t_mean)) ** 2 for t, y in enumerate(self.values))
        return slope, math.sqrt(residuals / (n - 2) / sxx)

    @property
    def change(self) -> float:
        """The slope beyond one standard error (0 inside it, and with fewer than 3 values)."""
        slope, se = self.slope_and_error()
        if not math.isfinite(se):
            return 0.0
        return math.copysign(max(abs(slope) - se, 0.0), slope)


class RED:
    """RED-inspired dynamic SFT weight: Recall-Extend Dynamics (arXiv 2508.16677), adapted to search agents.

    RED was proposed for math reasoning; here it weighs the SFT term on oracle search demonstrations.

    With ``G`` the bound (``max_factor``, 5 by default; unrelated to the GRPO group size):

    - ``H_rl`` tracks the RL batch entropy estimate, updated in `weight`, before the update; ``H_sft`` tracks the
      SFT predictive entropy, updated in `observe_sft_entropy`, after the update. ``dH_rl`` and ``dH_sft`` are
      their changes a step.
    - entropy weight ``= clip(|dH_sft| / (|dH_rl| + 1e-8), 1, G)``: more SFT while SFT still moves the
      model's entropy more than RL does.
    - accuracy factor ``= clip(G ** (1 - 2 * acc), 1/G, G)`` (G at acc 0, 1 at 0.5, 1/G at 1): more SFT
      while the policy rarely finds the answer; 1 when ``use_accuracy`` is False.
    - ``w = clip(entropy weight * accuracy factor, 1, G**2)``.

    How the entropies and the accuracy are tracked:

    - ``window = 0`` (the seed's rule): ``H_rl`` and ``H_sft`` are EMAs with ``decay`` (0.99), ``dH`` the last
      change of each EMA, ``acc`` this step's batch accuracy. The first observation of either entropy sets its
      EMA with change 0, so at step 1 both changes are 0 and at step 2 ``dH_sft`` is still 0: the entropy weight
      sits at 1 until ``H_sft`` has changed once (from step 3 on).
    - ``window = K >= 3``: each entropy is a `Trend` over its last K steps. ``H`` is the window's mean, ``dH``
      the least-squares slope a step beyond one standard error (`Trend.change`), so a change inside the
      estimate's own noise counts as none, and the untrained model's first batch leaves both after K steps.
      ``acc`` is the mean batch accuracy of the last K steps (2-4 episodes a step in the CPU preset, so 16-32
      episodes at K = 8), not one step's coin. Each slope's standard error is logged beside it.

    Should ``dH_rl`` be 0 while ``dH_sft`` is not, the ratio is huge and the weight clips to ``G``, as the
    formula says. ``G = 1`` pins every factor to 1, so RED reduces to `FixedSFT`.

    Args:
        max_factor: ``G``, the bound of each factor; ``w`` lies in ``[1, G**2]``.
        decay: EMA decay of both entropies (``window = 0`` only).
        use_accuracy: Include the accuracy factor.
        window: 0 for the EMAs; K >= 3 to track both entropies and the accuracy over the last K steps.
    """

    uses_sft: ClassVar[bool] = True

    def __init__(
        self, max_factor: float = 5.0, decay: float = 0.99, use_accuracy: bool = True, window: int = 0
    ) -> None:
        if max_factor < 1:
            raise ValueError(f"max_factor (G) must be >= 1, got {max_factor}")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if window != 0 and window < 3:
            raise ValueError(f"window must be 0 (the EMAs) or >= 3 steps, got {window}")
        self.max_factor = float(max_factor)
        self.decay = float(decay)
        self.use_accuracy = use_accuracy
        self.window = int(window)
        self.h_rl: float | None = None
        """``H_rl``: the EMA, or the window's mean; None before the first step."""
        self.h_sft: float | None = None
        """``H_sft``: the EMA, or the window's mean; None before the first observation."""
        self.dh_rl = 0.0
        """``dH_rl``: the EMA's last change, or the window's slope beyond its error."""
        self.dh_sft = 0.0
        """``dH_sft``: as ``dh_rl``, for the SFT entropy."""
        self.trends: dict[str, Trend] = {}
        """With a window: the ``rl`` and ``sft`` entropies' and the ``accuracy``'s trends."""
        if self.window:
            self.trends = {name: Trend(self.window) for name in ("rl", "sft", "accuracy")}
        self._metrics: dict[str, float] = {}

    def _ema(self, ema: float | None, x: float) -> tuple[float, float]:
        """Returns the updated EMA and its change; the first observation sets it, with change 0."""
        if not math.isfinite(x):
            raise ValueError(f"entropy must be finite, got {x}")
        if ema is None:
            return x, 0.0
        new = self.decay * ema + (1.0 - self.decay) * x
        return new, new - ema

    def _track(self, name: str, ema: float | None, x: float) -> tuple[float, float, dict[str, float]]:
        """``(H, dH, metrics)`` after observing entropy ``x`` of ``name`` (``rl`` or ``sft``)."""
        if not self.window:
            h, dh = self._ema(ema, x)
            return h, dh, {}
        trend = self.trends[name]
        trend.add(x)  # refuses a value that is not finite
        return trend.mean, trend.change, self._slope_metrics(name)

    def _slope_metrics(self, name: str) -> dict[str, float]:
        """``name``'s slope and its standard error, once the window holds 3 values (before, neither exists)."""
        slope, se = self.trends[name].slope_and_error()
        return {f"red/dh_{name}_slope": slope, f"red/dh_{name}_se": se} if math.isfinite(se) else {}

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
        self.h_rl, self.dh_rl, trend_metrics = self._track("rl", self.h_rl, float(rl_entropy))
        accuracy = float(batch_accuracy)
        if self.window:
            self.trends["accuracy"].add(accuracy)
            accuracy = self.trends["accuracy"].mean
        entropy_weight = _clip(abs(self.dh_sft) / (abs(self.dh_rl) + 1e-8), 1.0, g)
        accuracy_factor = _clip(g ** (1.0 - 2.0 * accuracy), 1.0 / g, g) if self.use_accuracy else 1.0
        w = _clip(entropy_weight * accuracy_factor, 1.0, g**2)
        self._metrics = {
            "red/entropy_weight": entropy_weight,
            "red/accuracy_factor": accuracy_factor,
            "red/final_weight": w,
            "red/batch_accuracy": float(batch_accuracy),
            "red/accuracy": accuracy,
            "red/h_rl": self.h_rl,
            "red/dh_rl": self.dh_rl,
            "red/dh_sft": self.dh_sft,
            **trend_metrics,
            **self._sft_metrics(),
            "sft/weight": w,
        }
        return w

    def _sft_metrics(self) -> dict[str, float]:
        """The SFT trend's slope and error as of the last observation, which this step's ``dH_sft`` read."""
        return self._slope_metrics("sft") if self.window else {}

    def observe_sft_entropy(self, h: float) -> None:
        """Updates ``H_sft`` with the SFT predictive entropy measured after the update.

        Args:
            h: Mean predictive entropy (nats) on the SFT batch's assistant tokens.
        """
        self.h_sft, self.dh_sft, _ = self._track("sft", self.h_sft, float(h))
        self._metrics["red/h_sft"] = self.h_sft

    def metrics(self) -> dict[str, float]:
        """``red/entropy_weight``, ``red/accuracy_factor``, ``red/final_weight``, ``red/batch_accuracy`` and the
        ``red/accuracy`` the factor read, ``H`` and ``dH`` of both entropies (with a window also each slope and
        its standard error, ``red/dh_*_slope`` and ``red/dh_*_se``, once it holds 3 steps), and ``sft/weight``;
        empty before the first step."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        """``H`` and ``dH`` of both entropies, and with a window the trends' values (the settings live in the
        trainer's config)."""
        state: dict[str, Any] = {"h_rl": self.h_rl, "h_sft": self.h_sft, "dh_rl": self.dh_rl, "dh_sft": self.dh_sft}
        if self.window:
            state["trends"] = {name: list(trend.values) for name, trend in self.trends.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what `state_dict` returned; a state without trends (saved by the EMAs) starts them empty."""
        self.h_rl = None if state["h_rl"] is None else float(state["h_rl"])
        self.h_sft = None if state["h_sft"] is None else float(state["h_sft"])
        self.dh_rl = float(state["dh_rl"])
        self.dh_sft = float(state["dh_sft"])
        for name, values in state.get("trends", {}).items():
            if name in self.trends:
                self.trends[name].values = [float(v) for v in values][-self.window :]
