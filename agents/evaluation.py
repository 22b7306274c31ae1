"""Evaluate an agent on a QA split: EM, F1, format, searches and invalid actions, each with a 95% CI.

    python -m benchmarks.evaluate --agent {direct,rag,search_r1,coda,oracle} [--model smollm2-135m] \\
        [--split dev] [--limit N] [--eval-batch-size 32] [--seed 0] [--temperature 0] [--out FILE.jsonl]
    python -m benchmarks.evaluate --agent search_r1 --model runs/red_grpo/final --data-path my_dev.jsonl \\
        --corpus-path my_corpus.jsonl --top-k 5 --max-passage-words 120 --max-search-turns 4 --max-context-tokens 8192
    python -m benchmarks.evaluate --run-dir runs/red_grpo-cpu-seed0 [--limit 200] [--top-k 5]

Every env setting the trainer takes is a flag here too, with the trainer's name and meaning (data and corpus
files, retriever or server URL, top_k, passage words, --max-search-turns, --max-planner-turns, protocol,
instructions, observation format, --question-after-results, the agent's context length, --eval-batch-size), so
a model can be scored on a user's own data. ``--run-dir DIR`` (or ``--config DIR/redcoda_config.json``) reads a
trained run's saved config and scores its final/ model in exactly the env it trained in (`Config.env_id`,
`Config.env_kwargs`, on its held-out split), as the run's own evaluation did; env flags given with it replace
single settings. The names of earlier versions (``--batch``, ``--max-turns``: turns per episode,
``--max-executor-turns``) still work.

Agents:
* ``direct``: the model answers from the question alone (a chat prompt asking for a short answer inside
  <answer></answer>; a reply without the tags is taken whole).
* ``rag``: the same, with the top-3 BM25 passages for the question in the prompt (one retrieval).
* ``search_r1``: `SearchR1Agent` in the flat env (RedCoda-HotpotQA-v0).
* ``coda``: `CodaAgent` in the planner/executor env (RedCoda-HotpotQA-CoDA-v0).
* ``oracle``: `OracleAgent` (gold evidence) in the flat env: an upper bound and a check of the pipeline.

Agents act greedily unless ``--temperature`` is set. ``--model`` is None or "smollm2-135m" (the bundled
SmolLM2-135M-Instruct), a local directory (e.g. a trained checkpoint) or a Hugging Face id. Scores come
from `envs.rewards` only: the env's terminal info for env agents, the same functions for direct and rag.

Per question: ``em``, ``f1``, ``answered`` (1 when the episode ended with a valid <answer>: the
valid-answer rate), ``format`` (graduated format score), ``num_searches`` (retrieval calls) and
``invalid_actions`` (the share of the question's actions that were invalid; for direct and rag, 1 when the
reply is not a valid <answer>). The table gives each one's mean and 95% interval over questions (Wilson's for
the 0/1 rates EM and valid answers, Student's t for the rest); ``--out``
writes one JSON line per question. From Python (the algorithm comparison calls this):

    from benchmarks.evaluate import evaluate
    result = evaluate("search_r1", "runs/red_grpo/final", "dev", limit=200)
    result["metrics"]["f1"]          # {"mean": ..., "low": ..., "high": ..., "n": 200}
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import Interval, mean_ci

AGENTS = ("direct", "rag", "search_r1", "coda", "oracle")
"""Agent names `evaluate` accepts."""
METRICS = ("em", "f1", "answered", "format", "num_searches", "invalid_actions")
"""Per-question metrics, in table order."""
RATES = frozenset({"em", "answered"})
"""The metrics that are 0 or 1 per question (their intervals are Wilson's; the others' Student's t)."""


def metric_intervals(predictions: list[dict[str, Any]], names: Sequence[str] = METRICS) -> dict[str, Interval]:
    """Each metric's mean over the per-question `predictions` with its 95% interval (`RATES`: Wilson's, else t)."""
    return {name: mean_ci([p[name] for p in predictions], method="wilson" if name in RATES else "t") for name in names}


DIRECT_INSTRUCTIONS = (
    "Answer the question with a short answer (a name, a date, a number, yes or no), without explanation, "
    "inside <answer> and </answer>, for example <answer> Beijing </answer>."
)
RAG_INSTRUCTIONS = (
    "Answer the question using the documents. Give a short answer (a name, a date, a number, yes or no), "
    "without explanation, inside <answer> and </answer>, for example <answer> Beijing </answer>."
)


def evaluate(
    agent_name: str,
    model: Any = None,
    split: str = "dev",
    limit: int | None = None,
    *,
    dataset: str = "hotpotqa",
    batch: int = 32,
    seed: int = 0,
    temperature: float = 0.0,
    max_new_tokens: int = 128,
    max_turns: int = 4,
    env_kwargs: dict[str, Any] | None = None,
    env_id: str | None = None,
    max_context_tokens: int = 4096,
    indices: Sequence[int] | None = None,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    device: str | None = None,
    sampler: str = "hf",
    sampler_url: str | None = None,
    served_model: str | None = None,
) -> dict[str, Any]:
    """Run one agent over the first `limit` questions of a split and score it.

    Args:
        agent_name: one of `AGENTS`.
        model: None or "smollm2-135m" (bundled), a local directory, a Hugging Face id, or an already
            loaded `(model, tokenizer)` pair. Ignored by the oracle (it only needs the SmolLM2 tokenizer
            unless a pair is given).
        split: dataset split ("dev" has the 200 bundled HotpotQA questions).
        limit: evaluate the first `limit` questions (None: all).
        dataset: bundled dataset (hotpotqa, musique, 2wiki, bamboogle).
        batch: episodes (or prompts) per batched rollout.
        seed: seeds the sampler and the rollouts.
        temperature: sampling temperature; 0 is greedy.
        max_new_tokens: tokens per model turn (per reply for direct and rag).
        max_turns: turns per episode (flat), planner turns (coda); executors get `max_turns - 1`.
        env_kwargs: more RAGEnv arguments (data_path, corpus_path, retriever, top_k, max_passage_words, turn
            limits, observation_format, ...) over the ones built from `dataset`, `split` and `max_turns`; rag
            uses their questions, retriever, top_k and max_passage_words too.
        env_id: a registered env id: then the env is exactly ``gym.make(env_id, **env_kwargs)``, as a trainer
            builds it (`algos.evaluation` passes a run's `Config.env_id` and `Config.env_kwargs`, so a model is
            scored in exactly the env it trained in), and `dataset`, `split` and `max_turns` are not used.
        max_context_tokens: the agent's (and sampler's) context length, as in training.
        indices: question indices to evaluate instead of the first `limit` (a held-out slice).
        out: write one JSON line per question here.
        progress: show a progress bar.
        device: torch device for the model (None: CUDA when available).
        sampler: what samples the replies (`agents.samplers.factory`): hf (transformers), vllm (a vLLM engine
            over `model`, a directory or hub id), or openai (a served model at `sampler_url`).
        sampler_url: openai: the server's API root, e.g. http://127.0.0.1:8000/v1.
        served_model: openai: the model name the server expects (None: `model`).

    Returns:
        `{"agent", "model", "dataset", "split", "n", "seed", "temperature", "wall_s", "metrics", "env",
        "predictions"}` where `metrics[name]` is `{"mean", "low", "high", "n"}` (95% interval, `metric_intervals`:
        Wilson's for the 0/1 rates, t for the rest) for each of `METRICS`, `env` the env played (``{"id",
        "kwargs"}``, objects as their repr), and `predictions` the per-question records written to `out`.
    """
    import gymnasium as gym

    import envs  # noqa: F401  (registers the ids)

    if agent_name not in AGENTS:
        raise ValueError(f"unknown agent {agent_name!r}; choose one of {', '.join(AGENTS)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if env_id is None:
        env_id, env_kwargs = env_settings(agent_name, dataset, split, max_turns, **(env_kwargs or {}))
    make_env = functools.partial(gym.make, env_id, disable_env_checker=True, **(env_kwargs or {}))
    env_list = [make_env()]
    examples = env_list[0].unwrapped.examples
    if indices is None:
        indices = range(len(examples) if limit is None else min(limit, len(examples)))
    indices = [int(i) for i in indices]
    if any(not 0 <= i < len(examples) for i in indices):
        raise ValueError(f"question indices must lie in [0, {len(examples)}) for {env_id} {env_kwargs}")
    n = len(indices)
    dataset, split = getattr(env_list[0].unwrapped, "dataset", dataset), getattr(env_list[0].unwrapped, "split", split)
    load = functools.partial(_load, device=device, kind=sampler, url=sampler_url, served_model=served_model)
    start = time.perf_counter()
    if agent_name in ("direct", "rag"):
        predictions = _answer_directly(
            agent_name,
            model,
            [examples[i] for i in indices],
            env_list[0].unwrapped,
            batch,
            seed,
            temperature,
            max_new_tokens,
            progress,
            load,
        )
    else:
        env_list += [make_env() for _ in range(min(batch, n) - 1)]
        predictions = _run_agent(
            agent_name,
            model,
            env_list,
            indices,
            batch,
            seed,
            temperature,
            max_new_tokens,
            progress,
            load,
            max_context_tokens,
        )
    for env in env_list:
        env.close()
    wall = time.perf_counter() - start
    metrics = metric_intervals(predictions)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for record in predictions:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return {
        "agent": agent_name,
        "model": _model_name(model),
        "dataset": dataset,
        "split": split,
        "n": n,
        "seed": seed,
        "temperature": temperature,
        "wall_s": wall,
        "metrics": {name: interval.as_dict() for name, interval in metrics.items()},
        "env": {"id": env_id, "kwargs": {k: v if _plain(v) else repr(v) for k, v in (env_kwargs or {}).items()}},
        "predictions": predictions,
    }


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def env_settings(
    agent_name: str, dataset: str = "hotpotqa", split: str = "dev", max_turns: int = 4, **env_kwargs: Any
) -> tuple[str, dict[str, Any]]:
    """The env an agent is evaluated in when no trainer's settings are given: ``(env id, gym.make arguments)``.

    The agent's protocol (coda for the coda agent, else flat), `dataset`'s `split`, `max_turns` turns per
    episode (planner turns for coda; an executor task gets ``max_turns - 1``), then `env_kwargs` over them; the
    oracle gets at least 6 turns (it may search three times before answering).
    """
    kwargs = {
        "dataset": dataset,
        "split": split,
        "protocol": "coda" if agent_name == "coda" else "flat",
        "max_turns": max(max_turns, 6) if agent_name == "oracle" else max_turns,
        "max_planner_turns": max_turns,
        "max_executor_turns": max(1, max_turns - 1),
        **env_kwargs,
    }
    return "RedCoda-HotpotQA-v0", kwargs


def _model_name(model: Any) -> str:
    if model is None:
        return "smollm2-135m"
    if isinstance(model, tuple):
        return str(getattr(model[0].config, "name_or_path", "") or type(model[0]).__name__)
    return str(model)


def _load(
    model: Any,
    seed: int,
    max_context: int | None = None,
    *,
    device: str | None = None,
    kind: str = "hf",
    url: str | None = None,
    served_model: str | None = None,
) -> Any:
    """A sampler of `kind` over `model` (a name, a path or a loaded `(model, tokenizer)` pair)."""
    from agents.models import ensure_smollm2_cache, load_model, smollm2_tokenizer
    from agents.samplers import HFSampler
    from agents.samplers.factory import make_sampler

    bundled = model in (None, "None", "none", "smollm2-135m")
    if kind == "hf":
        lm, tokenizer = model if isinstance(model, tuple) else load_model(None if bundled else model, device=device)
        return HFSampler(lm, tokenizer, seed=seed, max_context=max_context)
    if isinstance(model, tuple):
        raise ValueError(f"--sampler {kind} takes a model name or directory, not a loaded model")
    source = str(ensure_smollm2_cache()) if bundled else str(model)
    if kind == "openai":
        from transformers import AutoTokenizer

        tokenizer = smollm2_tokenizer() if bundled else AutoTokenizer.from_pretrained(source)
    else:
        tokenizer = None  # vLLM reads the tokenizer at source
    return make_sampler(
        kind,
        tokenizer=tokenizer,
        source=source,
        max_context=max_context or 4096,
        seed=seed,
        url=url,
        served_model=served_model,
    )


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="q", disable=not enabled)


def extract_answer(reply: str) -> tuple[str, bool]:
    """The answer in a direct or rag reply, and whether it was a valid <answer> action.

    A valid `<answer>x</answer>` gives x; an opened but unclosed <answer> gives the text after it; a reply
    without the tag is taken whole (stripped).
    """
    from envs.protocol import parse_action

    parsed = parse_action(reply, "agent")
    if parsed.valid and parsed.tool == "answer":
        return parsed.argument, True
    lowered = reply.lower()
    if "<answer>" in lowered:
        reply = reply[lowered.rindex("<answer>") + len("<answer>") :]
    return reply.replace("</answer>", "").strip(), False


def _answer_directly(
    agent_name: str,
    model: Any,
    examples: Sequence[Any],
    env: Any,
    batch: int,
    seed: int,
    temperature: float,
    max_new_tokens: int,
    progress: bool,
    load: Callable[..., Any],
) -> list[dict[str, Any]]:
    """direct and rag: one chat prompt per question, one batched generate call per `batch` questions; rag
    retrieves with the env's retriever, top_k and passage length."""
    from agents.records import SamplingParams
    from agents.samplers import encode_chat
    from envs.protocol import format_passages, parse_action
    from envs.rewards import exact_match, f1_score, format_score

    sampler = load(model, seed)
    retriever = env.retriever if agent_name == "rag" else None
    top_k, max_passage_words = env.top_k, env.max_passage_words
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=("</answer>",), seed=seed)
    predictions = []
    with _bar(len(examples), agent_name, progress) as bar:
        for lo in range(0, len(examples), batch):
            chunk = examples[lo : lo + batch]
            prompts, contexts = [], []
            for example in chunk:
                if retriever is None:
                    system, user = DIRECT_INSTRUCTIONS, f"Question: {example.question}"
                    titles: list[str] = []
                else:
                    passages = retriever.search(example.question, top_k)
                    titles = [p.title for p in passages]
                    system = RAG_INSTRUCTIONS
                    user = f"Documents:\n{format_passages(passages, max_passage_words)}\n\nQuestion: {example.question}"
                contexts.append(titles)
                messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
                prompts.append(encode_chat(sampler.tokenizer, messages))
            params = SamplingParams(**{**params.__dict__, "seed": seed + lo})
            for i, (example, titles, completion) in enumerate(
                zip(chunk, contexts, sampler.generate(prompts, params), strict=True)
            ):
                answer, valid = extract_answer(completion.text)
                parsed = parse_action(completion.text, "agent")
                predictions.append(
                    {
                        "index": lo + i,
                        "id": example.id,
                        "question": example.question,
                        "gold_answers": list(example.answers),
                        "prediction": answer,
                        "em": exact_match(answer, example.answers),
                        "f1": f1_score(answer, example.answers),
                        "format": format_score(parsed.used_tags, parsed.malformed_tags),
                        "answered": float(valid),
                        "num_searches": 0 if retriever is None else 1,
                        "invalid_actions": 0.0 if valid else 1.0,
                        "retrieved_titles": titles,
                        "reply": completion.text,
                        "finish_reason": completion.finish_reason,
                    }
                )
            bar.update(len(chunk))
    return predictions


def _run_agent(
    agent_name: str,
    model: Any,
    env_list: Sequence[Any],
    question_indices: Sequence[int],
    batch: int,
    seed: int,
    temperature: float,
    max_new_tokens: int,
    progress: bool,
    load: Callable[..., Any],
    max_context_tokens: int = 4096,
) -> list[dict[str, Any]]:
    """search_r1, coda and oracle: batched episodes in the real env (`env_list`: one env per episode of a batch)."""
    from agents.records import SamplingParams
    from envs.metrics import episode_metrics

    if agent_name == "oracle":
        from agents.models import smollm2_tokenizer
        from agents.oracle import OracleAgent

        tokenizer = model[1] if isinstance(model, tuple) else smollm2_tokenizer()
        agent: Any = OracleAgent(tokenizer, seed=seed)
    else:
        from agents.search_agents import CodaAgent, SearchR1Agent

        sampler = load(model, seed, max_context_tokens)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        agent = (CodaAgent if agent_name == "coda" else SearchR1Agent)(
            sampler, params, max_context_tokens=max_context_tokens
        )
    n = len(question_indices)
    examples = env_list[0].unwrapped.examples
    predictions = []
    with _bar(n, agent_name, progress) as bar:
        for lo in range(0, n, batch):
            indices = list(question_indices[lo : lo + batch])
            for trajectory in agent.rollout(env_list[: len(indices)], indices, seed=seed + lo):
                info, example = trajectory.info, examples[trajectory.example_index]
                metrics = episode_metrics(info)
                predictions.append(
                    {
                        "index": trajectory.example_index,
                        "id": example.id,
                        "question": example.question,
                        "gold_answers": list(example.answers),
                        "prediction": info.get("answer"),
                        **metrics,
                        "invalid_actions": metrics["invalid_action_share"],  # the table's: a share of the actions
                        "invalid_count": int(metrics["invalid_actions"]),
                        "reward": trajectory.reward,
                        "num_actions": len(trajectory.actions),
                        "sampled_tokens": sum(g.num_sampled for g in trajectory.generations),
                        "sampler_errors": int(info.get("sampler_errors", 0)),
                        "context_overflow": bool(info.get("context_overflow", False)),
                        "actions": list(trajectory.actions),
                    }
                )
            bar.update(len(indices))
    return predictions


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per result of `evaluate`, mean [95% CI] per metric, and wall time."""
    header = "| agent | model | n | " + " | ".join(METRICS) + " | wall (s) |"
    lines = [header, "|" + "---|" * (len(METRICS) + 4)]
    for result in results:
        cells = [
            Interval(**{k: v for k, v in result["metrics"][name].items()}).format(2 if name == "num_searches" else 3)
            for name in METRICS
        ]
        lines.append(
            f"| {result['agent']} | {result['model']} | {result['n']} | "
            + " | ".join(cells)
            + f" | {result['wall_s']:.0f} |"
        )
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    if args.max_turns is not None and args.max_search_turns is not None:
        parser.error("give --max-search-turns (the trainer's) or --max-turns (turns per episode), not both")
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
    return result


if __name__ == "__main__":
    main()
