"""The registered pieces of the RL term, by name: advantage estimators, policy losses and loss aggregations.

Each piece is a function with one typed signature (`algos.objectives.advantages.StepInput` -> `Advantages` for an
estimator; `algos.objectives.policy_losses` says the losses' and aggregations') and a record of what it honours:
the settings it reads, by flat name. A run refuses any setting no part of it honours (`algos.objectives.honours`),
so a piece never takes a value and ignores it. Chosen with ``--advantage NAME``, ``--policy-loss NAME`` and
``--loss-agg NAME``. Another package adds one with a call, run when its module is imported, or an entry point of the
``redcoda.objectives`` group naming a function that registers its pieces (loaded on the first unknown name):

    def rloo(step: StepInput) -> Advantages: ...
    register_advantage(Estimator("rloo", rloo, per="episode", groups=True))
    python -m algos.train --algo grpo --advantage rloo

Functions may be named ``"module:function"`` so that reading the table (a settings check) imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from algos.registry import load_entry_points, resolve

__all__ = [
    "ENTRY_POINT_GROUP",
    "Aggregation",
    "Estimator",
    "PolicyLoss",
    "UnknownPiece",
    "aggregation",
    "aggregation_names",
    "estimator",
    "estimator_names",
    "policy_loss_names",
    "policy_loss_spec",
    "register_aggregation",
    "register_advantage",
    "register_policy_loss",
]

ENTRY_POINT_GROUP = "redcoda.objectives"
"""The entry point group another package registers its estimators, losses and aggregations under."""


class UnknownPiece(ValueError):
    """A name no piece of that kind is registered under; the message lists those that are."""


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator.

    Args:
        name: Its name (``--advantage``).
        fn: ``fn(step: StepInput) -> Advantages``, or ``"module:function"``.
        per: What it yields: "episode" (``(B,)``, broadcast to the episode's tokens; per-search credit may add to
            it) or "token" (``(N, T-1)`` in the collated layout).
        groups: It compares a question's episodes: a group needs 2 or more, and dynamic sampling applies.
        needs: The learner's own inputs it reads: None (the episodes alone), "values" (a value head's per-token
            values and per-token rewards: `algos.ppo`), "turn_values" (a turn critic's Q - V: `algos.archer`).
        honours: The settings it reads, by flat name.
        summary: One line for ``--help`` and the docs.
    """

    name: str
    fn: Callable[..., Any] | str
    per: Literal["episode", "token"] = "episode"
    groups: bool = False
    needs: Literal["values", "turn_values"] | None = None
    honours: frozenset[str] = field(default_factory=frozenset)
    summary: str = ""

    def function(self) -> Callable[..., Any]:
        return resolve(self.fn, f"estimator {self.name!r}")


@dataclass(frozen=True)
class PolicyLoss:
    """A policy-gradient loss: ``fn(logp, old_logp, adv, mask, rl) -> (per_token (n, L), metrics)``.

    Args:
        name: Its name (``--policy-loss``).
        fn: The function, or ``"module:function"``; the shared step weighs its per-token values by the truncated
            importance weights (``--tis-cap``) and reduces them with the run's aggregation.
        honours: The settings it reads, by flat name.
        summary: One line.
    """

    name: str
    fn: Callable[..., Any] | str
    honours: frozenset[str] = field(default_factory=frozenset)
    summary: str = ""

    def function(self) -> Callable[..., Any]:
        return resolve(self.fn, f"policy loss {self.name!r}")


@dataclass(frozen=True)
class Aggregation:
    """How per-token loss values become one number: ``fn(values, mask, scale) -> scalar``, where ``scale`` holds
    the whole batch's counts (every rank's, every micro-batch's) that ``rows(batch)`` says count.

    Args:
        name: Its name (``--loss-agg``).
        fn: The reduction, or ``"module:function"``.
        counted: Which rows of the batch its divisors count: "all" or "signal" (those whose advantage is not 0).
        summary: One line.
    """

    name: str
    fn: Callable[..., Any] | str
    counted: Literal["all", "signal"] = "all"
    summary: str = ""

    def function(self) -> Callable[..., Any]:
        return resolve(self.fn, f"loss aggregation {self.name!r}")


_TABLES: dict[str, dict[str, Any]] = {"advantage": {}, "policy_loss": {}, "loss_agg": {}}
_LOCK = threading.Lock()
_LOADED = False


def _register(kind: str, piece: Any, replace: bool) -> Any:
    with _LOCK:
        held = _TABLES[kind].get(piece.name)
        if held is not None and held != piece and not replace:
            raise ValueError(f"a {kind} named {piece.name!r} is already registered (pass replace=True to replace)")
        _TABLES[kind][piece.name] = piece
    return piece


def register_advantage(piece: Estimator, *, replace: bool = False) -> Estimator:
    """Add an estimator to the table under its name (and return it)."""
    return _register("advantage", piece, replace)


def register_policy_loss(piece: PolicyLoss, *, replace: bool = False) -> PolicyLoss:
    """Add a policy loss to the table under its name (and return it)."""
    return _register("policy_loss", piece, replace)


def register_aggregation(piece: Aggregation, *, replace: bool = False) -> Aggregation:
    """Add a loss aggregation to the table under its name (and return it)."""
    return _register("loss_agg", piece, replace)


def _lookup(kind: str, name: str) -> Any:
    if name not in _TABLES[kind]:
        _load_entry_points()
    try:
        return _TABLES[kind][name]
    except KeyError:
        flag = "--" + kind.replace("_", "-")
        raise UnknownPiece(f"{flag}: unknown {name!r}; registered: {', '.join(_names(kind))}") from None


def _names(kind: str) -> list[str]:
    _load_entry_points()
    return list(_TABLES[kind])


def estimator(name: str) -> Estimator:
    """The estimator registered under `name` (`UnknownPiece` lists the others)."""
    return _lookup("advantage", name)


def policy_loss_spec(name: str) -> PolicyLoss:
    """The policy loss registered under `name`."""
    return _lookup("policy_loss", name)


def aggregation(name: str) -> Aggregation:
    """The loss aggregation registered under `name`."""
    return _lookup("loss_agg", name)


def estimator_names() -> list[str]:
    return _names("advantage")


def policy_loss_names() -> list[str]:
    return _names("policy_loss")


def aggregation_names() -> list[str]:
    return _names("loss_agg")


def _load_entry_points() -> None:
    """Call each installed ``redcoda.objectives`` entry point's function once a process (`load_entry_points`)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for register in load_entry_points(ENTRY_POINT_GROUP, "a function that registers pieces"):
        register()


# --- the built-in pieces ------------------------------------------------------------------------------------------
_ADV = "algos.objectives.advantages:"
_LOSS = "algos.objectives.policy_losses:"
_RESAMPLING = frozenset({"max_resample_batches"})
_STD = frozenset({"advantage_std_scale"})
_TREE = frozenset({"rollout", "tree_roots", "tree_branches", "tree_branch_turns"})
_CLIP = frozenset({"clip_eps", "clip_eps_high"})

for _estimator in (
    Estimator("group", _ADV + "group", groups=True, honours=_STD | _RESAMPLING,
              summary="GRPO: reward minus its group's mean, over the group's std (--no-advantage-std-scale: centred)"),
    Estimator("dr_grpo", _ADV + "dr_grpo", groups=True, honours=_RESAMPLING,
              summary="Dr. GRPO: reward minus its group's mean, never scaled"),
    Estimator("rloo", _ADV + "rloo", groups=True, honours=_RESAMPLING,
              summary="RLOO: reward minus the mean of the group's other episodes"),
    Estimator("tree", _ADV + "tree", groups=True, honours=_STD | _TREE | _RESAMPLING,
              summary="Tree-GRPO: the group's term plus the tree's (needs --rollout tree)"),
    Estimator("reinforce_pp", _ADV + "reinforce_pp", per="token",
              summary="REINFORCE++: the episode's reward on its tokens, whitened over the batch's sampled tokens"),
    Estimator("gae", _ADV + "gae", per="token", needs="values",
              honours=frozenset({"gamma", "gae_lambda", "whiten_advantages"}),
              summary="PPO: GAE over the value head's per-token values"),
    Estimator("q_minus_v", _ADV + "q_minus_v", per="token", needs="turn_values",
              honours=frozenset({"gamma", "whiten_advantages"}),
              summary="ArCHer: the turn critic's min(Q1, Q2) - V, on the turn's tokens"),
):  # fmt: skip
    register_advantage(_estimator)

for _loss in (
    PolicyLoss("clip", _LOSS + "clipped_ratio", honours=_CLIP,
               summary="PPO/GRPO's clipped token ratio, DAPO's clip-higher with --clip-eps-high"),
    PolicyLoss("gspo", _LOSS + "sequence_ratio", honours=_CLIP,
               summary="GSPO: the clipped ratio of the context's length-normalised likelihood"),
    PolicyLoss("reinforce", _LOSS + "reinforce", summary="REINFORCE: -advantage x log-prob, no ratio, no clip"),
):  # fmt: skip
    register_policy_loss(_loss)

for _agg in (
    Aggregation("token-mean", _LOSS + "token_mean", summary="over every sampled token of the batch (DAPO)"),
    Aggregation("signal-token-mean", _LOSS + "token_mean", counted="signal",
                summary="over the sampled tokens of the contexts whose advantage is not 0"),
    Aggregation("seq-mean-token-mean", _LOSS + "seq_mean_token_mean",
                summary="each context's token mean, averaged over the contexts (GRPO's paper)"),
    Aggregation("seq-mean-token-sum", _LOSS + "seq_mean_token_sum",
                summary="each context's token sum, averaged over the contexts (Dr. GRPO)"),
):  # fmt: skip
    register_aggregation(_agg)
