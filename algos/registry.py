"""The algorithms a run can train, by name: one table that the entry points, the settings, the run, the model card
and `benchmarks.compare` all read.

An algorithm is its learner (the class that trains it), its SFT weighting rule, its settings class and defaults,
and its label. The built-in ones are registered below; one from another package is a `register_algorithm` call, run
when its module is imported, or an entry point of the ``redcoda.algorithms`` group naming an `Algorithm` (or a
function that registers one), which is loaded the first time a name is looked up:

    # my_algo.py                                 # pyproject.toml of the package holding it:
    register_algorithm(Algorithm(                # [project.entry-points."redcoda.algorithms"]
        "rloo", learner=RLOOTrainer,             # rloo = "my_algo:RLOO"
        label="RLOO"))
    python -m algos.train --algo rloo --preset tiny
    python -m benchmarks.compare --algos rloo red_grpo --budget tiny

Learners, settings classes and defaults may be named as ``"module:attribute"``, imported when first used, so that
reading the table (a name check, a label) imports no trainer. Settings follow one rule (`Algorithm.defaults_for`):
the command line over a ``--config`` file over the algorithm's defaults for the preset over its defaults over the
preset over the dataclasses' own.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

__all__ = [
    "ENTRY_POINT_GROUP",
    "Algorithm",
    "UnknownAlgorithm",
    "algorithm",
    "algorithm_names",
    "entry_command",
    "load_entry_points",
    "register_algorithm",
    "resolve",
]

ENTRY_POINT_GROUP = "redcoda.algorithms"
"""The entry point group another package registers its algorithms under."""

WEIGHTING_RULES = ("none", "fixed", "red")
"""The SFT weighting rules an algorithm names: none (no SFT term), fixed (sft_coef), red
(`algos.objectives.weighting.RED`)."""

Ref = str | Any
"""An object, or where to import it from as ``"module:attribute"``."""


class UnknownAlgorithm(ValueError):
    """A name no algorithm is registered under; the message lists the registered ones."""


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: what trains it, with which SFT term and settings, under which label.

    Args:
        name: Its name on the command line (``--algo``), in run names and in `benchmarks.compare` (a word of
            lowercase letters, digits and underscores).
        learner: The class that trains it: an `algos.run.learner.Learner` subclass, built by the run from the run
            itself (`algos.learners.trainer.Trainer` for the GRPO family), or ``"module:Class"``.
        label: How the model card and reports name it ("GRPO + RED ...").
        sft_weighting: The weight of the SFT term on oracle demonstrations each step: "none", "fixed" (sft_coef),
            "red" (`algos.objectives.weighting.RED`), or a function of the `Config` that builds an
            `algos.objectives.weighting.SFTWeighting`.
        config: The settings class its command line parses: `algos.config.Config` or a subclass with settings of
            its own (read as ``config.gamma``), or ``"module:Class"``.
        defaults: Its settings over every preset's, by flat name (``{"group_size": 1}``), or ``"module:NAME"``.
        preset_defaults: Its settings over those defaults, by preset (``{"cpu": {"lr": 2e-6}}``), or ``"module:NAME"``.
        step: "rl" (rollouts and the learner's `train_step`) or "sft" (its `sft_step`: demonstrations only).
        advantage: Its advantage estimator when ``--advantage`` is unset (`algos.objectives`; "group" becomes
            "tree" under ``--rollout tree``).
        advantage_inputs: What its learner computes for an estimator beyond the episodes: None, "values" (a value
            head) or "turn_values" (a turn critic); it can use the estimators that need exactly that.
        single_process: Why it cannot run data-parallel under torchrun; None: it can.
        honours: Settings its learner reads beyond those of its pieces and its own settings class (the expert learner
            plays the demonstrations' oracle).
        refuses: Settings its learner cannot honour although its pieces would, by flat name, each with why. Settings
            are opt-in: what an algorithm honours is its pieces' (`algos.objectives.honours`), less these.
        module: The module of its own entry point (``python -m algos.red_grpo``); None: ``python -m algos.train
            --algo NAME``.
    """

    name: str
    learner: Ref
    label: str = ""
    sft_weighting: Literal["none", "fixed", "red"] | Callable[[Any], Any] = "none"
    config: Ref = "algos.config:Config"
    defaults: Mapping[str, object] | str = field(default_factory=dict)
    preset_defaults: Mapping[str, Mapping[str, object]] | str = field(default_factory=dict)
    step: Literal["rl", "sft"] = "rl"
    advantage: str = "group"
    advantage_inputs: Literal["values", "turn_values"] | None = None
    single_process: str | None = None
    honours: frozenset[str] = frozenset()
    refuses: Mapping[str, str] = field(default_factory=dict)
    module: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not all(c.islower() or c.isdigit() or c == "_" for c in self.name):
            raise ValueError(f"an algorithm's name is lowercase letters, digits and _, got {self.name!r}")
        if isinstance(self.sft_weighting, str) and self.sft_weighting not in WEIGHTING_RULES:
            raise ValueError(
                f"algorithm {self.name!r}: sft_weighting must be one of {', '.join(WEIGHTING_RULES)} or a function "
                f"of the config, got {self.sft_weighting!r}"
            )
        if self.step not in ("rl", "sft"):
            raise ValueError(f"algorithm {self.name!r}: step must be 'rl' or 'sft', got {self.step!r}")

    @property
    def title(self) -> str:
        """Its label, or its name where it has none."""
        return self.label or self.name

    def learner_class(self) -> type:
        """The learner class (imported on first use when named as a string)."""
        return resolve(self.learner, f"algorithm {self.name!r}: learner")

    def config_class(self) -> type:
        """Its settings class, `algos.config.Config` or a subclass (imported on first use when named as a string).

        The registry imports neither the settings nor the learners (both read it): they are named, not typed, here.
        """
        return resolve(self.config, f"algorithm {self.name!r}: config")

    def defaults_for(self, preset: str) -> dict[str, object]:
        """Its settings over `preset`'s, by flat name: its defaults, then its defaults for that preset.

        This is the one precedence rule of every entry point (`algos.run.cli.parse_config` applies it): the
        dataclasses' defaults < the preset < these < a ``--config`` file < the command line's flags.
        """
        defaults = dict(resolve(self.defaults, f"algorithm {self.name!r}: defaults"))
        by_preset = resolve(self.preset_defaults, f"algorithm {self.name!r}: preset_defaults")
        return {**defaults, **by_preset.get(preset, {})}

    def command(self) -> list[str]:
        """The arguments after ``python`` that start its entry point: ``-m algos.red_grpo``."""
        if self.module is not None:
            return ["-m", self.module]
        return ["-m", "algos.train", "--algo", self.name]


def entry_command(name: str) -> str:
    """How a person starts algorithm `name` from a shell: ``python -m algos.red_grpo``, or ``python -m algos.train
    --algo NAME`` for one without a module of its own or not registered in this process (another package's)."""
    entry = _REGISTRY.get(name)
    return "python " + " ".join(entry.command() if entry is not None else ["-m", "algos.train", "--algo", name])


_REGISTRY: dict[str, Algorithm] = {}
_LOCK = threading.Lock()
_LOADED_ENTRY_POINTS = False


def register_algorithm(algo: Algorithm, *, replace: bool = False) -> Algorithm:
    """Add `algo` to the table under its name (and return it).

    Raises:
        ValueError: the name is taken (by another algorithm; `replace` allows it).
    """
    with _LOCK:
        held = _REGISTRY.get(algo.name)
        if held is not None and held != algo and not replace:
            raise ValueError(f"an algorithm named {algo.name!r} is already registered (pass replace=True to replace)")
        _REGISTRY[algo.name] = algo
    return algo


def algorithm(name: str) -> Algorithm:
    """The algorithm registered under `name`, loading other packages' entry points on the first unknown name.

    Raises:
        UnknownAlgorithm: no algorithm has that name; the message lists those that do.
    """
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownAlgorithm(f"unknown algorithm {name!r}; registered: {', '.join(algorithm_names())}") from None


def algorithm_names() -> list[str]:
    """The registered names, the built-in ones first, in registration order."""
    _load_entry_points()
    return list(_REGISTRY)


def _load_entry_points() -> None:
    """Register what the installed packages' ``redcoda.algorithms`` entry points name (once a process).

    An entry point names an `Algorithm` (registered under its own name) or a function that registers one or more;
    one that fails to load is an error naming it, not a silently missing algorithm.
    """
    global _LOADED_ENTRY_POINTS
    if _LOADED_ENTRY_POINTS:
        return
    _LOADED_ENTRY_POINTS = True
    for target in load_entry_points(ENTRY_POINT_GROUP, "an Algorithm or a function that registers one"):
        if isinstance(target, Algorithm):
            register_algorithm(target)
        else:
            target()


def load_entry_points(group: str, wanted: str) -> list[Any]:
    """What each installed entry point of `group` names, loaded; one that fails to load, or names neither a callable
    nor what the group wants (`wanted`, said in the error), is an error naming it."""
    found = []
    for point in metadata.entry_points(group=group):
        try:
            target = point.load()
        except Exception as err:
            raise ImportError(f"entry point {point.name} = {point.value!r} ({group}): {err}") from err
        if not (callable(target) or isinstance(target, Algorithm)):
            raise TypeError(
                f"entry point {point.name} = {point.value!r} ({group}) names neither {wanted}, but a "
                f"{type(target).__name__}"
            )
        found.append(target)
    return found


def resolve(ref: Ref, what: str) -> Any:
    """`ref`, or the object ``"module:attribute"`` names."""
    if not isinstance(ref, str):
        return ref
    module, colon, attribute = ref.partition(":")
    if not colon:
        raise ValueError(f"{what}: {ref!r} is not 'module:attribute'")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


# --- the built-in algorithms --------------------------------------------------------------------------------------
_TRAINER = "algos.learners.trainer:Trainer"

for _builtin in (
    Algorithm("grpo", _TRAINER, "GRPO", module="algos.grpo"),
    Algorithm("grpo_sft", _TRAINER, "GRPO + fixed SFT", sft_weighting="fixed", module="algos.grpo_sft"),
    Algorithm(
        "red_grpo",
        _TRAINER,
        "GRPO + RED (RED-inspired dynamic SFT weighting)",
        sft_weighting="red",
        module="algos.red_grpo",
    ),
    Algorithm(
        "grpo_expert",
        "algos.learners.expert:ExpertTrainer",
        "GRPO with oracle episodes inside its groups",
        config="algos.learners.expert:ExpertConfig",
        honours=frozenset({"quote_words", "follow_bridge", "min_searches", "results_queries", "restate_question"}),
        refuses={
            "search_credit": "an expert's group shares the episode's advantage over all its tokens",
            "loss_agg": "its expert term and its policy term are one token mean over every token",
        },
        module="algos.grpo_expert",
    ),
    Algorithm(
        "sft",
        _TRAINER,
        "SFT on oracle demonstrations",
        sft_weighting="fixed",
        preset_defaults="algos.sft:SFT_PRESETS",
        step="sft",
        module="algos.sft",
    ),
    Algorithm(
        "ppo",
        "algos.learners.ppo:PPOTrainer",
        "PPO",
        config="algos.learners.ppo:PPOConfig",
        defaults="algos.learners.ppo:PPO_DEFAULTS",
        preset_defaults="algos.learners.ppo:PPO_PRESETS",
        advantage="gae",
        advantage_inputs="values",
        module="algos.ppo",
    ),
    Algorithm(
        "archer",
        "algos.learners.archer:ArCHerTrainer",
        "ArCHer",
        config="algos.learners.archer:ArCHerConfig",
        defaults="algos.learners.archer:ARCHER_DEFAULTS",
        preset_defaults="algos.learners.archer:ARCHER_PRESETS",
        advantage="q_minus_v",
        advantage_inputs="turn_values",
        single_process="its critic and replay buffer would train on each rank's turns alone and drift apart",
        module="algos.archer",
    ),
    # GRPO's learner with another registered estimator or loss (`algos.objectives`), under the field's names
    Algorithm("rloo", _TRAINER, "RLOO (leave-one-out baseline)", advantage="rloo"),
    Algorithm("reinforce_pp", _TRAINER, "REINFORCE++ (batch-whitened returns)", advantage="reinforce_pp"),
    Algorithm(
        "dr_grpo",
        _TRAINER,
        "Dr. GRPO (no std division, token sums over contexts)",
        advantage="dr_grpo",
        defaults={"loss_agg": "seq-mean-token-sum"},
    ),
    Algorithm(
        "gspo",
        _TRAINER,
        "GSPO (sequence-level ratio)",
        defaults={"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "clip_eps": 3e-4, "clip_eps_high": 4e-4},
    ),
):
    register_algorithm(_builtin)
