"""Training configuration: one frozen dataclass of settings in sections, and its named presets.

`Config` holds one section per ``--help`` group (`algos.settings`: env, model and sampler, optimisation, RL, SFT
weighting, run); every field has a one-line docstring, which tyro turns into the ``--help`` text, so ``--help`` is
the reference (`algos.run.cli` builds the command line). A setting is read by its section, ``config.env.top_k``;
its flag, its preset key and its key in a config file are its own name, ``top_k`` (`Config.with_values`,
`Config.flat`). Derived values (the env's turn limits, the run directory, bf16, where old log-probs come from) are
properties, never fields changed after parsing.

Presets name whole sets of defaults (`algos.presets`: gpu, cpu, tiny); flags given after them override single
fields. With no ``--preset``, the entry points pick ``gpu`` when CUDA is available and ``cpu`` otherwise:

    python -m algos.red_grpo --preset cpu --steps 20 --lr 5e-6
    python -m algos.red_grpo --preset tiny --run-dir /tmp/run --help
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from tyro.conf import OmitArgPrefixes

from algos.objectives.honours import refusal
from algos.objectives.registry import estimator
from algos.presets import PRESETS
from algos.registry import UnknownAlgorithm, algorithm, entry_command
from algos.setting_checks import (
    CONFIG_RULES,
    check_finite,
    check_model,
    check_names,
    check_rules,
    check_sampler,
    instruction_words,
)
from algos.settings import (
    SECTION_OF,
    SECTIONS,
    EnvSettings,
    ModelSettings,
    OptimSettings,
    PresetName,
    RLSettings,
    RunSettings,
    SFTSettings,
)

__all__ = [
    "QUERY_REWRITE_ENV",
    "VALIDATE_ON_INIT",
    "Config",
    "argv_preset",
    "default_preset",
    "preset_config",
]

QUERY_REWRITE_ENV = "RedCoda-QueryRewrite-v0"

RENAMED = {"pg_token_norm": ("loss_agg", lambda v: {"all": "token-mean", "signal": "signal-token-mean"}.get(v, v))}
"""Settings renamed since runs were saved: old flat name -> (new name, old value -> new value)."""


@dataclass(frozen=True)
class Config:
    """Settings of one training run of any registered algorithm (`algos.registry`), in sections.

    The sections' flags carry no prefix (``--top-k``, not ``--env.top-k``): each section is a group of ``--help``.
    A learner's settings class extends this one with fields of its own (`algos.learners.ppo.PPOConfig`), read as
    ``config.gamma`` and listed in ``--help``'s first group.
    """

    env: OmitArgPrefixes[EnvSettings] = EnvSettings()
    """env: the questions, corpus, retriever and turn limits of the episodes."""
    model: OmitArgPrefixes[ModelSettings] = ModelSettings()
    """model and sampler: the policy's weights, their device and dtype, and what samples the rollouts."""
    optim: OmitArgPrefixes[OptimSettings] = OptimSettings()
    """optimisation: the run's length, the optimizer and the forward/backward passes."""
    rl: OmitArgPrefixes[RLSettings] = RLSettings()
    """RL: the rollouts of each step and the policy-gradient loss."""
    sft: OmitArgPrefixes[SFTSettings] = SFTSettings()
    """SFT weighting: the SFT term on oracle demonstrations, its weight (RED) and the demonstrations."""
    run: OmitArgPrefixes[RunSettings] = RunSettings()
    """run: its name, seed, directory, checkpoints, logging and held-out evaluation."""

    # --- flat names --------------------------------------------------------------------------------------
    def with_values(self, **values: object) -> Config:
        """This config with the named settings replaced, each named flat (``top_k=5``, ``lr=1e-5``, ``gamma=0.9``).

        Flat names are how presets, ``--config`` files and saved runs name settings; each goes to its section.

        Raises:
            TypeError: a name that is no setting of this class.
        """
        sections: dict[str, dict[str, object]] = {}
        own: dict[str, object] = {}
        for old, (new, translate) in RENAMED.items():  # a run saved before the rename resumes as it trained
            if old in values:
                values = {k: v for k, v in values.items() if k != old} | {new: translate(values[old])}
        for name, value in values.items():
            if name in SECTION_OF:
                sections.setdefault(SECTION_OF[name], {})[name] = value
            elif name in SECTIONS:  # a section's name is no setting: a whole section is not replaced by one value
                raise TypeError(f"{name!r} names a section of {type(self).__name__}, not a setting")
            else:
                own[name] = value
        replaced = {attr: dataclasses.replace(getattr(self, attr), **named) for attr, named in sections.items()}
        return dataclasses.replace(self, **replaced, **own)

    def flat(self) -> dict[str, object]:
        """Every setting by its flat name, the sections' first and then a learner's own: what a run saves."""
        values: dict[str, object] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name in SECTIONS:
                values.update({field.name: getattr(value, field.name) for field in dataclasses.fields(value)})
            else:
                values[spec.name] = value
        return values

    @classmethod
    def flat_types(cls) -> dict[str, object]:
        """Every setting's flat name and type (without tyro's markers), as `flat` orders them."""
        types: dict[str, object] = {}
        for name, hint in typing.get_type_hints(cls).items():
            if name in SECTIONS:
                types.update(typing.get_type_hints(SECTIONS[name]))
            else:
                types[name] = hint
        return types

    def __post_init__(self) -> None:
        if VALIDATE_ON_INIT.get():
            self.validate()

    def validate(self) -> None:
        """Refuse settings that cannot train (run by the constructor; `parse_config` turns it into a usage error).

        Raises:
            ValueError: naming the first offending setting by its flag, e.g. ``--temperature must be > 0, got 0.0``.
        """
        check_finite(self)
        check_rules(self, CONFIG_RULES)
        self._check_algorithm()  # after the values' own checks: a NaN is refused as a NaN, not as unhonoured
        self._check_env_and_data()
        check_names(self)
        check_model(self)
        names = self.flat_types()
        unknown = [name for name in self.run.resume_changed if name.replace("-", "_") not in names]
        if unknown:
            raise ValueError(f"--resume-changed names no setting: {', '.join(unknown)} (use the flags' names: lr ...)")
        self._check_processes(int(os.environ.get("WORLD_SIZE", "1")))  # data-parallel ranks (torchrun)

    def _check_algorithm(self) -> None:
        """The algorithm is registered (`algos.registry`), and every setting changed from what it gets by its preset
        and defaults is honoured by some part of it (`algos.objectives.honours`)."""
        try:
            algo = algorithm(self.run.algo)
        except UnknownAlgorithm as err:
            raise ValueError(str(err)) from None
        token = VALIDATE_ON_INIT.set(False)
        try:
            names = type(self).flat_types()  # a plain Config of a learner with settings of its own lacks those
            own = {k: v for k, v in algo.defaults_for(self.run.preset).items() if k in names}
            baseline = preset_config(self.run.preset, type(self), **own, algo=algo.name)
            plain = type(self)()
        finally:
            VALIDATE_ON_INIT.reset(token)
        refused = refusal(self, baseline, plain)
        if refused is not None:
            raise ValueError(refused)
        from algos.objectives.registry import aggregation

        try:
            aggregation(self.rl.loss_agg)
        except ValueError as err:
            raise ValueError(str(err)) from None

    def _check_env_and_data(self) -> None:
        """The retriever, the context length, the group size and the held-out questions."""
        from envs import ENV_IDS
        from retrievers.factory import RETRIEVER_KINDS

        if self.env.retriever not in RETRIEVER_KINDS and not self.env.retriever.startswith(("http://", "https://")):
            raise ValueError(
                f"--retriever must be one of {', '.join(RETRIEVER_KINDS)} or a retrieval server's URL "
                f"(http://host:port), got {self.env.retriever!r}"
            )
        if self.env.env_id in ENV_IDS:  # the QA envs, whose first messages are the protocol's instructions
            words = instruction_words(self.env.protocol, self.env.instructions)
            if self.model.max_context_tokens < words + self.rl.max_new_tokens:
                raise ValueError(
                    f"--max-context-tokens must be at least {words + self.rl.max_new_tokens} "
                    f"(the {self.env.instructions} instructions and a one-word question are at least {words} tokens, "
                    f"plus --max-new-tokens {self.rl.max_new_tokens} for a turn), got {self.model.max_context_tokens}"
                )
        if self.rl.rollout == "tree":
            from agents.tree import TreeShape

            try:  # the shape's own arithmetic (`TreeShape.rounds`), said with the flags' names
                TreeShape(self.rl.tree_roots, self.rl.tree_branches).rounds(self.rl.group_size)
            except ValueError:
                raise ValueError(
                    f"--rollout tree: --group-size ({self.rl.group_size}) must be "
                    f"--tree-roots ({self.rl.tree_roots}) x (1 + rounds x --tree-branches ({self.rl.tree_branches})) "
                    f"with at least one round, e.g. {self.rl.tree_roots * (1 + self.rl.tree_branches)}"
                ) from None
        if algorithm(self.run.algo).step == "rl" and estimator(self.advantage).groups and self.rl.group_size < 2:
            raise ValueError(
                f"--group-size must be >= 2 for {self.run.algo} with --advantage {self.advantage}, got "
                f"{self.rl.group_size} (its advantages compare the episodes of a group: with one every advantage is 0)"
            )
        if self.rl.tie_probe_questions is not None and self.rl.tie_probe_questions > self.rl.questions_per_step:
            raise ValueError(
                f"--tie-probe-questions must be <= --questions-per-step ({self.rl.questions_per_step}), "
                f"got {self.rl.tie_probe_questions}"
            )
        if (
            self.run.eval_questions
            and self.env.data_path
            and not self.run.eval_data_path
            and not self.env.is_query_rewrite
        ):
            raise ValueError(
                "--data-path trains on your own questions, so the held-out ones must come from the same source: "
                "give --eval-data-path (a file of questions not in the training file), or --eval-questions 0"
            )
        if self.run.eval_questions and self.run.eval_split == self.env.split:
            raise ValueError(f"--eval-split must differ from --split (held-out questions), both are {self.env.split!r}")
        if self.run.validation_questions and self.optim.weight_average is not None:
            raise ValueError(
                "--validation-questions with --weight-average: choose one (the checkpoints hold the weights, the "
                "average is a different model)"
            )
        if self.rl.question_draw == "reachable" and self.env.is_query_rewrite:
            raise ValueError("--question-draw reachable: the query-rewrite env has no answers for BM25 to show")
        if self.run.validation_questions and self.env.is_query_rewrite:
            raise ValueError("--validation-questions: the query-rewrite env scores no answers to select by")

    def _check_processes(self, ranks: int) -> None:
        """Data parallelism over `ranks` processes (each needs a share of the batch), FSDP, and the sampler."""
        algo = algorithm(self.run.algo)
        if ranks > 1 and algo.single_process is not None:
            raise ValueError(
                f"{algo.name} does not run data-parallel ({ranks} ranks): {algo.single_process}; run it as one "
                f"process ({entry_command(algo.name)})"
            )
        if ranks > 1 and self.rl.max_resample_batches:
            raise ValueError(
                f"--max-resample-batches (dynamic sampling) runs in one process, not {ranks} ranks: the groups kept "
                "could leave a rank without rows; run it as one process or with --max-resample-batches 0"
            )
        if self.run.fsdp and not self.optim.context_grad and ranks > 1:
            raise ValueError(
                "--fsdp with --no-context-grad: not supported (its two passes through the sharded decoder are not "
                "tested under FSDP2); add --context-grad"
            )
        check_sampler(self)
        if self.run.fsdp and self.model.lora:
            raise ValueError(
                "--fsdp with --lora: not supported (the final model's LoRA merge needs the whole model on one "
                "rank); LoRA's optimizer state is small, so train it data-parallel without --fsdp"
            )
        for name, value in (
            ("questions_per_step", self.rl.questions_per_step),
            ("sft_batch_size", self.sft.sft_batch_size),
        ):
            if ranks > 1 and value < ranks:
                raise ValueError(f"--{name.replace('_', '-')} must be >= the {ranks} data-parallel ranks, got {value}")

    # --- derived (across sections) ----------------------------------------------------------------------
    @property
    def env_kwargs(self) -> dict[str, object]:
        """Arguments of `gym.make` besides the id (also the oracle's env, so demos match the RL contexts)."""
        server = {}
        if self.env.retriever.startswith(("http://", "https://")) and (
            self.env.is_query_rewrite or self.env.corpus == "pooled"
        ):
            server = {"retriever_timeout": self.env.retriever_timeout, "retriever_retries": self.env.retriever_retries}
        if self.env.is_query_rewrite:  # recall@k keeps the env's own k (5); top_k is the QA envs' passages per search
            return {
                "split": self.env.split,
                "retriever": self.env.retriever,
                "max_passage_words": self.env.max_passage_words,
                "action_format": self.env.query_action_format,
                **server,
            }
        optional = {  # passed only when set: the settings of existing runs (and their caches' keys) stay as they were
            "protocol": self.env.protocol if self.env.env else None,  # the default env ids fix the protocol already
            "data_path": self.env.data_path,
            "corpus_path": self.env.corpus_path,
            "observation_format": None if self.env.observation_format == "redcoda" else self.env.observation_format,
            "instructions": None if self.env.instructions == "search-r1" else self.env.instructions,
            "question_after_results": self.env.question_after_results or None,
            "reward_weights": {"recall": self.rl.recall_reward} if self.rl.recall_reward else None,
        }
        return {
            "split": self.env.split,
            "corpus": self.env.corpus,
            "retriever": None if self.env.corpus == "distractor" else self.env.retriever,
            "top_k": self.env.top_k,
            "max_passage_words": self.env.max_passage_words,
            "max_turns": self.env.max_turns,
            "max_planner_turns": self.env.max_planner_turns,
            "max_executor_turns": self.env.max_executor_turns,
            **server,
            **{name: value for name, value in optional.items() if value is not None},
        }

    @property
    def advantage(self) -> str:
        """The advantage estimator's name: ``--advantage``, else the algorithm's own ("tree" for "group" under
        ``--rollout tree``)."""
        if self.rl.advantage is not None:
            return self.rl.advantage
        own = algorithm(self.run.algo).advantage
        return "tree" if own == "group" and self.rl.rollout == "tree" else own

    @property
    def recompute_old_logp(self) -> bool:
        """Whether old log-probs are recomputed by the training model rather than taken from the sampler."""
        return self.rl.old_logp == "recompute" or (
            self.rl.old_logp == "auto" and (self.model.use_bf16 or self.model.sampler != "hf")
        )


def preset_config(preset: PresetName, config_cls: type[Config] = Config, **overrides: object) -> Config:
    """The config of a named preset, with `overrides` applied on top.

    Args:
        preset: gpu, cpu or tiny.
        config_cls: `Config`, or a learner's settings class that extends it (`algos.learners.ppo.PPOConfig`, ...).
        **overrides: settings, by flat name (`Config.with_values`), that replace the preset's.

    Returns:
        A `config_cls`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return config_cls().with_values(**{"preset": preset, **PRESETS[preset], **overrides})


def default_preset() -> PresetName:
    """gpu when CUDA is available, else cpu."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def argv_preset(args: Sequence[str]) -> PresetName:
    """The preset a command line names with ``--preset``, else `default_preset()` (other flags are ignored)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=None)
    return pre.parse_known_args(list(args))[0].preset or default_preset()


VALIDATE_ON_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("validate_config", default=True)
"""False while `parse_config` lets tyro build a Config, so that the checks run after, as a one-line usage error."""
