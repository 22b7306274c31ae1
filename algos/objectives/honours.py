"""Which settings a run honours, and the one-line refusal of any other that is changed.

Settings are opt-in. The run itself honours the env, model, optimisation and run sections for every algorithm (it
builds the env, the model, the optimizer and the evaluation from them), but for `BY_LEARNERS`. The rest is honoured
only where a part of the chosen algorithm reads it (`honoured`):

- an algorithm that plays rollouts (``step="rl"``): `ROLLOUT_SETTINGS`, its estimator's ``honours`` (and
  per-search credit where the estimator yields episode advantages), its policy loss's;
- its SFT weighting rule: `WEIGHTING_SETTINGS` (the rule's settings and the demonstrations');
- its own settings class's fields (``gamma``, ``value_lr``, ...);
- less what the algorithm says it cannot honour (`algos.registry.Algorithm.refuses`, with why).

A setting changed from what the algorithm gets without a ``--config`` file or flags (the preset and the algorithm's
defaults) that is not honoured, or whose condition (`CONDITIONS`) does not hold, is refused before any work, in one
line naming the setting, the algorithm and why (`refusal`). Reading these tables imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from algos.objectives.registry import UnknownPiece, estimator, policy_loss_spec
from algos.registry import Algorithm, algorithm

__all__ = ["BY_LEARNERS", "CONDITIONS", "ROLLOUT_SETTINGS", "WEIGHTING_SETTINGS", "honoured", "refusal"]

BY_LEARNERS = frozenset({"update_epochs", "term_grad_norms"})
"""Settings of the run's sections that only a learner's RL update reads (an SFT step takes one optimizer step)."""

ROLLOUT_SETTINGS = frozenset(
    {
        "questions_per_step",
        "group_size",
        "tie_probe_questions",
        "temperature",
        "top_p",
        "question_draw",
        "recall_reward",
        "old_logp",
        "skip_zero_advantage",
        "tis_cap",
        "kl_coef",
        "kl_estimator",
        "advantage",
        "policy_loss",
        "loss_agg",
        "update_epochs",
        "term_grad_norms",
    }
)
"""What every learner that plays rollouts honours through the shared step (`algos.learners.trainer.Trainer`)."""

CREDIT_SETTINGS = frozenset({"search_credit", "repeat_penalty"})
"""Per-search credit (`algos.objectives.credit`): it adds to episode advantages, so only such estimators take it."""

_DEMOS = frozenset(
    {
        "sft_batch_size",
        "sft_planner_share",
        "sft_mix",
        "sft_data",
        "sft_num_demos",
        "quote_words",
        "follow_bridge",
        "min_searches",
        "results_queries",
        "restate_question",
    }
)
WEIGHTING_SETTINGS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "fixed": _DEMOS | {"sft_coef"},
    "red": _DEMOS | {"sft_coef", "red_max_factor", "red_decay", "red_use_accuracy", "red_window"},
}
"""By SFT weighting rule: the settings of its term and of the demonstrations it draws (a rule given as a function
honours the fixed rule's)."""

_SECTIONS_OF_THE_RUN = ("env", "model", "optim", "run")
_RUN_READS = frozenset({"max_new_tokens"})  # an RL setting the held-out evaluation reads too

CONDITIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "repeat_penalty": (lambda c: c.rl.search_credit > 0, "it is part of the per-search credit: set --search-credit"),
    "tree_roots": (lambda c: c.rl.rollout == "tree", "it shapes tree rollouts: add --rollout tree"),
    "tree_branches": (lambda c: c.rl.rollout == "tree", "it shapes tree rollouts: add --rollout tree"),
    "tree_branch_turns": (lambda c: c.rl.rollout == "tree", "it shapes tree rollouts: add --rollout tree"),
    "kl_estimator": (lambda c: c.rl.kl_coef > 0, "it estimates the KL term, which is off: set --kl-coef"),
    "skip_zero_advantage": (lambda c: c.rl.kl_coef == 0, "with --kl-coef every context runs for its KL term"),
    "recall_reward": (lambda c: not c.env.is_query_rewrite, "the query-rewrite env's reward is its recall@k already"),
    "red_decay": (lambda c: c.sft.red_window == 0, "it is the EMAs' decay, and --red-window tracks a window instead"),
}
"""Settings honoured only beside another: name -> (whether the other is set, why not)."""


def _run_settings(config: Any) -> set[str]:
    from algos.settings import SECTIONS

    names = {spec for section in _SECTIONS_OF_THE_RUN for spec in SECTIONS[section].__dataclass_fields__}
    return (names | _RUN_READS) - BY_LEARNERS


def _own_settings(config: Any) -> set[str]:
    from algos.settings import SECTIONS

    sections = {name for cls in SECTIONS.values() for name in cls.__dataclass_fields__}
    return {name for name in config.flat() if name not in sections}


def honoured(config: Any) -> dict[str, str]:
    """Every setting `config`'s run honours, each with the part that reads it (the run, the rollouts, the
    estimator, the policy loss, credit, the SFT rule, the learner)."""
    algo = algorithm(config.run.algo)
    parts: dict[str, str] = {name: "the run" for name in _run_settings(config)}
    if algo.step == "rl":
        chosen = estimator(config.advantage)
        parts |= {name: "the shared RL step" for name in ROLLOUT_SETTINGS}
        parts |= {name: f"the {chosen.name} estimator" for name in chosen.honours}
        if chosen.per == "episode":
            parts |= {name: "per-search credit" for name in CREDIT_SETTINGS}
        parts |= {name: f"the {config.rl.policy_loss} loss" for name in policy_loss_spec(config.rl.policy_loss).honours}
        rule = algo.sft_weighting if isinstance(algo.sft_weighting, str) else "fixed"
        parts |= {name: f"the {rule} SFT rule" for name in WEIGHTING_SETTINGS[rule]}
    else:  # an SFT step: the demonstrations alone, at weight 1
        parts |= {name: "the SFT step" for name in _DEMOS}
    parts |= {name: f"{algo.name}'s learner" for name in _own_settings(config) | algo.honours}
    return {name: part for name, part in parts.items() if name not in algo.refuses}


def _why_not(algo: Algorithm, config: Any, name: str) -> str:
    if name in algo.refuses:
        return algo.refuses[name]
    if algo.step == "sft":
        return "an SFT step trains on the demonstrations alone, at weight 1, with one optimizer step"
    chosen = estimator(config.advantage)
    if name in CREDIT_SETTINGS:
        return f"credit adds to episode advantages and the {chosen.name} estimator's are per token"
    if name in ("rollout", "tree_roots", "tree_branches", "tree_branch_turns"):
        return f"the {chosen.name} estimator reads no trees (--advantage tree does)"
    if name in ("advantage_std_scale", "max_resample_batches"):
        return f"the {chosen.name} estimator {'never divides by a std' if chosen.groups else 'compares no group'}"
    if name in ("clip_eps", "clip_eps_high"):
        return f"the {config.rl.policy_loss} loss has no clip window"
    if name in WEIGHTING_SETTINGS["red"]:
        rule = algo.sft_weighting if isinstance(algo.sft_weighting, str) else "fixed"
        return "it has no SFT term" if rule == "none" else f"its SFT weight follows the {rule} rule, not RED's"
    return "no part of it reads this setting"


def refusal(config: Any, *baselines: Any) -> str | None:
    """The one-line refusal of the first setting of `config` that differs from every one of `baselines` (what the
    algorithm gets from its preset and defaults alone; the settings classes' own defaults) and that its run does not
    honour; also of an estimator the learner cannot feed. None: every changed setting is honoured."""
    algo = algorithm(config.run.algo)
    try:
        chosen = estimator(config.advantage)
        policy_loss_spec(config.rl.policy_loss)
    except UnknownPiece as err:
        return str(err)
    if algo.step == "rl" and chosen.needs != algo.advantage_inputs:
        what = {None: "the episodes alone", "values": "a value head's values", "turn_values": "a turn critic's Q - V"}
        return (
            f"--advantage {chosen.name} needs {what[chosen.needs]}, and {algo.name}'s learner gives "
            f"{what[algo.advantage_inputs]} (estimators it can use: "
            f"{', '.join(_usable(algo)) or 'none'})"
        )
    parts = honoured(config)
    unchanged = [b.flat() for b in baselines]
    for name, value in config.flat().items():
        if any(name in before and value == before[name] for before in unchanged):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in parts:
            return (
                f"{flag} {value} is not honoured by {algo.name}{_pieces(algo, config)}: {_why_not(algo, config, name)}"
            )
        condition = CONDITIONS.get(name)
        if condition is not None and not condition[0](config):
            return f"{flag} {value} is not honoured by {algo.name} as set: {condition[1]}"
    return None


def _pieces(algo: Algorithm, config: Any) -> str:
    if algo.step != "rl":
        return ""
    return f" (--advantage {config.advantage}, --policy-loss {config.rl.policy_loss})"


def _usable(algo: Algorithm) -> list[str]:
    from algos.objectives.registry import estimator_names

    return [name for name in estimator_names() if estimator(name).needs == algo.advantage_inputs]
