"""The evaluation harness: an agent's episodes on a QA split, scored with EM, F1, format, searches and invalid
actions, each with a 95% CI.

`evaluate` plays an agent greedily (unless a temperature is given) over the questions of a split and scores them:
the held-out evaluation that ends a training run (`algos.run.evaluation`), the algorithm comparison
(`benchmarks.compare`) and the command line (`python -m benchmarks.evaluate`) all call it. It lives below the
trainers because training needs it; it uses only the env (`envs`), the agents and their samplers.

Agents (`AGENTS`): ``direct`` (the model answers from the question alone, inside <answer></answer>; a reply
without the tags is taken whole), ``rag`` (the same with the top-3 BM25 passages in the prompt), ``search_r1``
(`SearchR1Agent`, flat env), ``coda`` (`CodaAgent`, planner/executor env) and ``oracle`` (`OracleAgent`, gold
evidence: an upper bound and a check of the pipeline).

A model is None or "smollm2-135m" (the bundled SmolLM2-135M-Instruct), a local directory, a Hugging Face id or a
loaded ``(model, tokenizer)`` pair. Scores come from `envs.rewards` only. Per question: ``em``, ``f1``,
``answered`` (the episode ended with a valid <answer>), ``format``, ``num_searches`` and ``invalid_actions`` (the
share of the question's actions that were invalid; for direct and rag, 1 when the reply is not a valid <answer>).
`metric_intervals` gives each one's mean and 95% interval over questions (`envs.stats`, `interval_method`: Wilson's for
the 0/1 rates EM and valid answers, a seeded BCa bootstrap for the scores in [0, 1], t clipped at 0 for the counts;
`interval_caption` says so under a table).

    from agents.evaluation import evaluate
    result = evaluate("search_r1", "runs/red_grpo/final", "dev", limit=200)
    result["metrics"]["f1"]          # {"mean": ..., "low": ..., "high": ..., "n": 200}
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from envs.stats import Interval, mean_ci

AGENTS = ("direct", "rag", "search_r1", "coda", "oracle")
"""Agent names `evaluate` accepts."""
METRICS = ("em", "f1", "answered", "format", "num_searches", "invalid_actions")
"""Per-question metrics, in table order."""
RATES = frozenset({"em", "answered"})
"""The metrics that are 0 or 1 per question (their intervals are Wilson's)."""
COUNTS = frozenset({"num_searches", "num_tasks"})
"""The metrics that are counts per question, unbounded above (their intervals are Student's t, clipped at 0)."""


def interval_method(name: str) -> str:
    """The interval a metric's mean gets: "wilson" for `RATES`, "t" for `COUNTS`, "bootstrap" for a score in [0, 1]."""
    return "wilson" if name in RATES else "t" if name in COUNTS else "bootstrap"


def metric_intervals(predictions: list[dict[str, Any]], names: Sequence[str] = METRICS) -> dict[str, Interval]:
    """Each metric's mean over the per-question `predictions` with its 95% interval (`interval_method`)."""
    return {name: mean_ci([p[name] for p in predictions], method=interval_method(name)) for name in names}


def interval_caption() -> str:
    """The sentence under a table of `metric_intervals`: which interval each column has."""
    return (
        "95% intervals over questions: Wilson's for EM and valid answers; a seeded BCa bootstrap (scipy.stats) for "
        "F1, format and invalid actions; Student's t, clipped at 0, for searches and tasks per question. A column "
        "constant over every question gets the rule-of-three bound (a count: the exact Poisson interval), never a "
        "zero-width one."
    )


MAX_ERROR_RATE = 0.05
"""The share of episodes whose sampler or retriever may fail before an evaluation fails instead of scoring them."""


class EvaluationFailed(RuntimeError):
    """The sampler or the retriever failed on more than the allowed share of an evaluation's episodes."""


def error_counts(predictions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many episodes met a sampler or a retriever error: ``{"episodes", "n", "sampler", "retriever", "first"}``
    (episodes: with either; first: the first error's message, or None)."""
    sampler = [p for p in predictions if p.get("sampler_errors", 0) > 0]
    retriever = [p for p in predictions if p.get("retrieval_errors", 0) > 0]
    errored = [p for p in predictions if p.get("sampler_errors", 0) > 0 or p.get("retrieval_errors", 0) > 0]
    first = next((p.get("error") for p in errored if p.get("error")), None)
    counts = {"episodes": len(errored), "n": len(predictions), "sampler": len(sampler), "retriever": len(retriever)}
    return {**counts, "first": first}


def check_errors(errors: dict[str, Any], max_error_rate: float = MAX_ERROR_RATE) -> None:
    """Raise `EvaluationFailed` (one line: the cause, the count, the first error) when more than `max_error_rate` of
    the episodes errored: a dead server scores zero on every question, which is no measurement of the model."""
    n, k = errors["n"], errors["episodes"]
    if n == 0 or k / n <= max_error_rate:
        return
    causes = " and ".join(f"the {name} in {errors[name]}" for name in ("sampler", "retriever") if errors[name])
    raise EvaluationFailed(
        f"the evaluation failed: {k} of {n} episodes ({k / n:.0%}) met errors, more than the {max_error_rate:.0%} "
        f"allowed ({causes}); the first: {errors['first'] or 'no message'}"
    )


def errors_line(results: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> str:
    """The line under a table that says how many episodes met sampler or retriever errors, per result (a result
    without ``errors``, read from an older file, is counted from its predictions)."""
    parts = []
    for i, result in enumerate(results):
        c = result.get("errors") or error_counts(result.get("predictions", ()))
        causes = f" (sampler {c['sampler']}, retriever {c['retriever']})" if c["episodes"] else ""
        parts.append(f"{labels[i] + ' ' if labels else ''}{c['episodes']} of {c['n']}{causes}")
    return f"Episodes with sampler or retriever errors: {', '.join(parts)}."


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
    sampler_timeout: float = 120.0,
    sampler_retries: int = 3,
    max_error_rate: float | None = MAX_ERROR_RATE,
) -> dict[str, Any]:
    """Run one agent over the first `limit` questions of a split (or its `indices`) and score it.

    Args:
        agent_name: one of `AGENTS`.
        model: None or "smollm2-135m" (bundled), a directory, a hub id, or a loaded `(model, tokenizer)` pair.
        split, limit, dataset, max_turns: the bundled questions to play (`env_settings`) when `env_id` is None.
        batch: episodes (or prompts) per batched rollout.
        seed, temperature: seed the sampler and the rollouts; sample at `temperature` (0: greedy).
        max_new_tokens: tokens per model turn (per reply for direct and rag).
        env_kwargs: more RAGEnv arguments over the ones built from `dataset`, `split` and `max_turns`; rag uses
            their questions, retriever, top_k and max_passage_words too.
        env_id: a registered env id: then the env is exactly ``gym.make(env_id, **env_kwargs)``, as a trainer builds
            it (`algos.run.evaluation` scores a model in exactly the env it trained in).
        max_context_tokens: the agent's (and sampler's) context length, as in training.
        indices: question indices to evaluate instead of the first `limit` (a held-out slice).
        out, progress, device: a JSON-lines file for the predictions, a progress bar, the model's torch device.
        sampler, sampler_url, served_model, sampler_timeout, sampler_retries: what samples (`agents.samplers`): hf,
            vllm (over `model`) or openai (`served_model` at `sampler_url`; a question whose request is not answered
            in `sampler_timeout` s, `sampler_retries` retries included, counts as errored).
        max_error_rate: raise `EvaluationFailed` (`check_errors`, after writing `out`) when more than this share of
            the episodes met a sampler or retriever error; None: never (the caller checks a pooled count).

    Returns:
        `{"agent", "model", "dataset", "split", "n", "seed", "temperature", "wall_s", "metrics", "errors", "env",
        "predictions"}`: `metrics[name]` is `Interval.as_dict()` for each of `METRICS`, `errors` the `error_counts`,
        `env` the env played (``{"id", "kwargs"}``), `predictions` the per-question records (also written to `out`).
    """
    _check_arguments(agent_name, batch)
    if env_id is None:
        env_id, env_kwargs = env_settings(agent_name, dataset, split, max_turns, **(env_kwargs or {}))
    make_env, env_list, examples, indices = _questions(env_id, env_kwargs or {}, limit, indices)
    first = env_list[0].unwrapped
    dataset, split = getattr(first, "dataset", dataset), getattr(first, "split", split)
    served = dict(url=sampler_url, served_model=served_model, timeout_s=sampler_timeout, retries=sampler_retries)
    load = functools.partial(_load, device=device, kind=sampler, **served)
    play = (temperature, max_new_tokens, progress, load)
    start = time.perf_counter()
    if agent_name in ("direct", "rag"):
        predictions = _answer_directly(agent_name, model, [examples[i] for i in indices], first, batch, seed, *play)
    else:
        env_list += [make_env() for _ in range(min(batch, len(indices)) - 1)]
        predictions = _run_agent(agent_name, model, env_list, indices, batch, seed, *play, max_context_tokens)
    for env in env_list:
        env.close()
    wall = time.perf_counter() - start  # the episodes' time: the model, the envs and their searches
    _write_and_check(out, predictions, max_error_rate)
    return {
        **{"agent": agent_name, "model": _model_name(model), "dataset": dataset, "split": split, "n": len(indices)},
        **{"seed": seed, "temperature": temperature, "wall_s": wall},
        "metrics": {name: interval.as_dict() for name, interval in metric_intervals(predictions).items()},
        "errors": error_counts(predictions),
        "env": {"id": env_id, "kwargs": {k: v if _plain(v) else repr(v) for k, v in (env_kwargs or {}).items()}},
        "predictions": predictions,
    }


def _check_arguments(agent_name: str, batch: int) -> None:
    if agent_name not in AGENTS:
        raise ValueError(f"unknown agent {agent_name!r}; choose one of {', '.join(AGENTS)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")


def _write_and_check(out: str | os.PathLike | None, predictions: list[dict[str, Any]], max_rate: float | None) -> None:
    """Write the predictions to `out` (if given), then fail when too many episodes errored (see them in `out`)."""
    if out is not None:
        _write_lines(Path(out), predictions)
    if max_rate is not None:
        check_errors(error_counts(predictions), max_rate)


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _questions(
    env_id: str, env_kwargs: dict[str, Any], limit: int | None, indices: Sequence[int] | None
) -> tuple[Callable[[], Any], list[Any], Sequence[Any], list[int]]:
    """The evaluation's env maker, its first env, the env's questions and the indices to play (checked)."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the ids)

    make_env = functools.partial(gym.make, env_id, disable_env_checker=True, **env_kwargs)
    env = make_env()
    examples = env.unwrapped.examples
    if indices is None:
        indices = range(len(examples) if limit is None else min(limit, len(examples)))
    indices = [int(i) for i in indices]
    if any(not 0 <= i < len(examples) for i in indices):
        raise ValueError(f"question indices must lie in [0, {len(examples)}) for {env_id} {env_kwargs}")
    return make_env, [env], examples, indices


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
    timeout_s: float = 120.0,
    retries: int = 3,
    batch: int = 64,
) -> Any:
    """A sampler of `kind` over `model` (a name, a path or a loaded `(model, tokenizer)` pair); a transformers
    sampler runs up to `batch` rows (the episodes of one batched rollout) in one pass, 64 at least."""
    from agents.models import ensure_smollm2_cache, load_model, smollm2_tokenizer
    from agents.samplers import HFSampler
    from agents.samplers.factory import make_sampler

    bundled = model in (None, "None", "none", "smollm2-135m")
    if kind == "hf":
        lm, tokenizer = model if isinstance(model, tuple) else load_model(None if bundled else model, device=device)
        return HFSampler(lm, tokenizer, seed=seed, max_context=max_context, max_batch_size=max(64, batch))
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
        timeout_s=timeout_s,
        retries=retries,
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

    sampler = load(model, seed, batch=batch)
    retriever = env.retriever if agent_name == "rag" else None
    top_k, max_passage_words = env.top_k, env.max_passage_words
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=("</answer>",), seed=seed)
    predictions = []
    with _bar(len(examples), agent_name, progress) as bar:
        for lo in range(0, len(examples), batch):
            chunk = examples[lo : lo + batch]
            prompts, contexts, failures = [], [], {}
            for example in chunk:
                if retriever is None:
                    system, user = DIRECT_INSTRUCTIONS, f"Question: {example.question}"
                    titles: list[str] = []
                else:
                    passages, failure = _search(retriever, example.question, top_k)
                    failures[len(contexts)] = failure
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
                        "sampler_errors": int(completion.finish_reason == "error"),
                        "retrieval_errors": int(failures.get(i) is not None),
                        "error": completion.error or failures.get(i),
                    }
                )
            bar.update(len(chunk))
    return predictions


def _search(retriever: Any, query: str, k: int) -> tuple[list[Any], str | None]:
    """The passages for `query`, or none and the failure's message (a dead server counts as an errored episode)."""
    try:
        return retriever.search(query, k), None
    except Exception as err:
        return [], f"{type(err).__name__}: {err}"


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

        sampler = load(model, seed, max_context_tokens, batch=batch)
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
                        "error": info.get("sampler_error") or info.get("retrieval_error"),
                        "context_overflow": bool(info.get("context_overflow", False)),
                        "actions": list(trajectory.actions),
                    }
                )
            bar.update(len(indices))
    return predictions


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per result of `evaluate`, mean [95% CI] per metric, and wall time; under it which
    interval each column has and how many episodes met sampler or retriever errors."""
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
    return "\n".join([*lines, "", interval_caption(), errors_line(results)])
