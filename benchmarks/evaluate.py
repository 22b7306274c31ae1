"""Evaluate an agent on a QA split: EM, F1, format, searches and invalid actions, each with a 95% CI.

    python -m benchmarks.evaluate --agent {direct,rag,search_r1,coda,oracle} [--model smollm2-135m] \\
        [--split dev] [--limit N] [--eval-batch-size 32] [--seed 0] [--temperature 0] [--out FILE.jsonl]
    python -m benchmarks.evaluate --agent search_r1 --model runs/red_grpo/final --data-path my_dev.jsonl \\
        --corpus-path my_corpus.jsonl --top-k 5 --max-passage-words 120 --max-search-turns 4 --max-context-tokens 8192
    python -m benchmarks.evaluate --run-dir runs/red_grpo-cpu-seed0 [--limit 200] [--top-k 5]

The command line of `agents.evaluation.evaluate`, which has the agents, the per-question metrics and their
intervals (the harness is there, below the trainers, because a training run ends with it; this script only reads
flags and prints).

Every env setting the trainer takes is a flag here too, with the trainer's name and meaning (data and corpus
files, retriever or server URL, top_k, passage words, --max-search-turns, --max-planner-turns, protocol,
instructions, observation format, --question-after-results, the agent's context length, --eval-batch-size), so
a model can be scored on a user's own data. ``--run-dir DIR`` (or ``--config DIR/redcoda_config.json``) reads a
trained run's saved config and scores its final/ model in exactly the env it trained in (`Config.env_id`,
`Config.env_kwargs`, on its held-out split), as the run's own evaluation did; env flags given with it replace
single settings. The names of earlier versions (``--batch``, ``--max-turns``: turns per episode,
``--max-executor-turns``) still work.

Agents act greedily unless ``--temperature`` is set. ``--model`` is None or "smollm2-135m" (the bundled
SmolLM2-135M-Instruct), a local directory (e.g. a trained checkpoint) or a Hugging Face id. It prints each
metric's mean and 95% interval over questions (Wilson's for the 0/1 rates EM and valid answers, Student's t for
the rest); ``--out`` writes one JSON line per question.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.evaluation import AGENTS, METRICS, env_settings, evaluate
from envs.stats import Interval


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
)
"""The env flags that are `algos.config.Config` fields of the same name."""


def run_settings(config_file: str | os.PathLike[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """A trained run's held-out evaluation settings (`algos.evaluation.held_out_settings`), with `overrides`.

    Args:
        config_file: a run's saved config (``redcoda_config.json``) or any YAML/JSON file of `Config` fields.
        overrides: `Config` field values that replace the file's (the env flags given on the command line).

    Returns:
        agent, env_id, env_kwargs, questions, max_new_tokens, max_context_tokens, eval_batch_size and eval_split:
        the env exactly as `Config.env_id` and `Config.env_kwargs` build it, on the held-out split.
    """
    import dataclasses

    from algos.config import Config, load_config_file
    from algos.evaluation import held_out_settings

    config = dataclasses.replace(Config(), **{**load_config_file(config_file), **overrides})
    settings = held_out_settings(config)
    settings.update(env_id=config.env_id, eval_batch_size=config.eval_batch_size, eval_split=config.eval_split)
    return settings


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default: all)")
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
    parser.add_argument("--out", default=None, help="write per-question predictions here (JSON lines)")
    parser.add_argument(
        "--result", default=None, help="write the whole result here (JSON), as benchmarks.first_search reads it"
    )
    args = parser.parse_args(argv)
    if args.max_turns is not None and args.max_search_turns is not None:
        parser.error("give --max-search-turns (the trainer's) or --max-turns (turns per episode), not both")
    if args.first and args.limit is None:
        parser.error("--first needs --limit (how many questions from there)")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    config_file = args.config or (Path(args.run_dir) / "redcoda_config.json" if args.run_dir else None)
    flags = {name: getattr(args, name) for name in ENV_FLAGS if getattr(args, name) is not None}
    if config_file is not None:
        if args.max_turns is not None or args.max_executor_turns is not None:
            parser.error("with a run's config, set turns with --max-search-turns and --max-planner-turns")
        try:
            settings = run_settings(config_file, flags)
        except (OSError, ValueError) as err:
            parser.error(f"{config_file}: {err}")
        agent = args.agent or settings["agent"]
        split = args.split or settings["eval_split"]
        env_id, env_kwargs = settings["env_id"], {**settings["env_kwargs"], "split": split}
        batch = args.eval_batch_size or settings["eval_batch_size"]
        max_new_tokens = args.max_new_tokens or settings["max_new_tokens"]
        max_context_tokens = args.max_context_tokens or settings["max_context_tokens"]
        model = args.model or (str(Path(args.run_dir) / "final") if args.run_dir else "smollm2-135m")
        max_turns = 4  # unused: the env is the run's
    else:
        if args.agent is None:
            parser.error("--agent is required (or --run-dir / --config of a trained run)")
        agent, split = args.agent, args.split or "dev"
        batch, model = args.eval_batch_size or 32, args.model or "smollm2-135m"
        max_new_tokens, max_context_tokens = args.max_new_tokens or 128, args.max_context_tokens or 4096
        env_id = flags.pop("env", None)
        searches = flags.pop("max_search_turns", None)
        max_turns = searches + 1 if searches is not None else args.max_turns or 4
        if searches is not None:  # the trainer's limits: flat episodes and executor tasks alike get searches + 1
            flags["max_executor_turns"] = searches + 1
        if args.max_executor_turns is not None:
            flags["max_executor_turns"] = args.max_executor_turns
        env_kwargs = flags
        if env_id is not None:
            env_kwargs = {**env_settings(agent, args.dataset, split, max_turns)[1], **flags}
    model = None if model in ("None", "none") else model
    result = evaluate(
        agent,
        model,
        split,
        args.limit,
        dataset=args.dataset,
        batch=batch,
        seed=args.seed,
        temperature=args.temperature,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        env_kwargs=env_kwargs,
        env_id=env_id,
        max_context_tokens=max_context_tokens,
        out=args.out,
        device=args.device,
        sampler=args.sampler,
        sampler_url=args.sampler_url,
        served_model=args.served_model,
        indices=range(args.first, args.first + args.limit) if args.first else None,
    )
    print(
        f"{agent} | model {result['model']} | {result['dataset']} {result['split']} | n={result['n']} "
        f"| seed {args.seed} | temperature {args.temperature} | wall {result['wall_s']:.1f} s"
    )
    for name in METRICS:
        interval = Interval(**result["metrics"][name])
        print(f"  {name:<16} {interval.format(3)}")
    if args.out:
        print(f"wrote {result['n']} predictions to {args.out}")
    if args.result:
        settings = {"agent": agent, "env_kwargs": env_kwargs, "max_new_tokens": max_new_tokens, "seed": args.seed}
        Path(args.result).write_text(json.dumps({**result, "settings": settings}, default=str))
        print(f"wrote the result to {args.result}")
    return result


if __name__ == "__main__":
    main()
