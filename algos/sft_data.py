"""Oracle demonstrations for the SFT term of GRPO + SFT and RED: built once, cached, loaded as `Generation`s.

The demonstrations are `agents.oracle.OracleAgent` episodes played through the same env as the RL
rollouts (same protocol, retriever, top_k, passage length and turn limits), so the SFT contexts look
exactly like the ones the policy samples in, token for token (loss mask 1 on the oracle's turns).
Only episodes the oracle answered correctly (F1 > 0) and that it could have played from its own context
(``oracle_grounded``: copyable queries, the answer read from shown evidence) are kept, and yes/no answers
are balanced (the larger class is cut to the size of the smaller), so the model learns neither a
default answer nor queries it could not write. With ``sft_mix="questions"`` the episodes are further cut to
the shares the question kinds (bridge, comparison, yes/no) have in the training split (`mix_like_questions`).

Where they come from, in order:

- ``sft_data=FILE.jsonl``: a file of either format below.
- the cache ``cache_root()/sft/<key>.jsonl``, keyed by the env settings, the tokenizer and the oracle's seed.
- otherwise the oracle runs now (tens of seconds for the bundled train split) and fills the cache.

Formats (JSON lines): this module's own, one context per line,
``{"token_ids": [...], "loss_mask": [...], "role": "agent", "index": 3, "f1": 1.0}``; or one episode per
line as written by ``python -m agents.oracle --out FILE.jsonl``, ``{"f1", "contexts": [{"role",
"messages": [{"role": "assistant"|"observation", "content"}]}]}``, re-tokenized message by message.

    demos = load_demonstrations(config, tokenizer, max_tokens=2048)   # list[Generation]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Container, Iterable, Sequence
from pathlib import Path
from typing import Any

from agents.records import Generation, Trajectory
from algos.config import Config
from algos.settings import SFTSettings
from envs.data import DataError
from retrievers.files import atomic_file

logger = logging.getLogger(__name__)

ORACLE_VERSION = "grounded-9"  # 9: passage text is data (tags in a passage are never parsed, nor quoted)
"""Changes whenever the oracle's policy changes, so cached demonstrations of an older oracle are rebuilt."""

__all__ = [
    "build_oracle_demonstrations",
    "oracle_agent",
    "demonstrations_cache_path",
    "load_demonstrations",
    "mix_like_questions",
    "question_kinds",
    "read_demonstrations",
]


def demonstrations_cache_path(config: Config, tokenizer: Any) -> Path:
    """Cache file of the demonstrations that `config` asks for, keyed by everything that changes them."""
    from retrievers.corpus import cache_root

    key = {
        "env_id": config.env.env_id,
        **config.env_kwargs,
        "num_demos": config.sft.sft_num_demos,
        "oracle": ORACLE_VERSION,
        **(
            {"quote_words": config.sft.quote_words} if config.sft.quote_words != SFTSettings.quote_words else {}
        ),  # default: old key
        **({"follow_bridge": True} if config.sft.follow_bridge else {}),
        **({"restate_question": True} if config.sft.restate_question else {}),
        **({"min_searches": config.sft.min_searches} if config.sft.min_searches != 1 else {}),
        **({"results_queries": True} if config.sft.results_queries else {}),
        "seed": config.run.seed,
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "vocab": len(tokenizer),
        "chat_template": hashlib.sha256(str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest()[:16],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "sft" / f"oracle-{config.env.protocol}-{config.env.split}-{digest}.jsonl"


def build_oracle_demonstrations(config: Config, tokenizer: Any, *, batch_size: int = 32) -> list[Trajectory]:
    """Play the oracle on the split's first ``sft_num_demos`` questions (all when None) through the real env.

    Args:
        config: Supplies the env settings, the number of episodes and the seed.
        tokenizer: Tokenizer of the model the demonstrations are for.
        batch_size: Envs played at once.

    Returns:
        One trajectory per question, in question order.
    """
    import gymnasium as gym
    from tqdm.auto import tqdm

    import envs  # noqa: F401  (registers the ids)

    env_fns = [gym.make(config.env.env_id, disable_env_checker=True, **config.env_kwargs) for _ in range(batch_size)]
    num_examples = env_fns[0].unwrapped.num_examples
    n = num_examples if config.sft.sft_num_demos is None else min(config.sft.sft_num_demos, num_examples)
    agent = oracle_agent(config, tokenizer)
    trajectories: list[Trajectory] = []
    with tqdm(total=n, desc="oracle demonstrations", unit="q", disable=not config.run.progress) as bar:
        for lo in range(0, n, batch_size):
            indices = list(range(lo, min(lo + batch_size, n)))
            trajectories += agent.rollout(env_fns[: len(indices)], indices, seed=config.run.seed + lo)
            bar.update(len(indices))
    for env in env_fns:
        env.close()
    return trajectories


def _write_atomic(path: Path, lines: Iterable[str]) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line + "\n")


def _generation_record(generation: Generation, trajectory: Trajectory) -> str:
    return json.dumps(
        {
            "token_ids": list(generation.token_ids),
            "loss_mask": list(generation.loss_mask),
            "role": generation.role,
            "index": trajectory.example_index,
            "f1": float(trajectory.info.get("f1", 0.0)),
            "grounded": bool(trajectory.info.get("oracle_grounded", True)),
            "answer": str(trajectory.info.get("answer") or ""),
        }
    )


def read_demonstrations(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    question_kinds: Sequence[str] | None = None,
    exclude: Container[int] = (),
) -> list[Generation]:
    """Read demonstrations of either format (see the module docstring), keeping only correct (F1 > 0) and
    grounded ones, with yes/no answers balanced (episodes are kept whole; see the module docstring).

    Args:
        path: JSON-lines file.
        tokenizer: Tokenizes the chat format's messages; its vocabulary bounds the token format's ids.
        question_kinds: Each question's kind by its index in the split (`question_kinds`); given, the episodes
            are cut to the kinds' shares among these questions (`mix_like_questions`).
        exclude: Question indices whose episodes are dropped (the validation questions, held out of training).

    Returns:
        The demonstrations' contexts; their ``sample_logprobs`` are 0 (they are not sampled).

    Raises:
        DataError: a line that is not a demonstration of either format, naming the file, the line and the fault
            (bad JSON, not an object, missing or mistyped fields, token ids outside the tokenizer's vocabulary).
    """
    vocab = len(tokenizer)
    episodes: dict[object, list[Generation]] = {}
    answers: dict[object, str] = {}
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg}, column {err.colno})") from err
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object (one demonstration), got a {type(record).__name__}")
            try:
                if float(record.get("f1", 1.0)) <= 0 or not record.get("grounded", True):
                    continue
                key = record.get("index", f"line{line_no}")
                if isinstance(key, int) and key in exclude:
                    continue
                if "token_ids" in record:
                    ids, mask = record["token_ids"], record["loss_mask"]
                    generation = Generation(tuple(ids), tuple(mask), (0.0,) * len(ids), record.get("role", "agent"))
                    _check_ids(generation, vocab)
                    episodes.setdefault(key, []).append(generation)
                elif "contexts" in record:
                    contexts = [_from_messages(context, tokenizer) for context in record["contexts"]]
                    episodes.setdefault(key, []).extend(contexts)
                else:
                    raise DataError("neither token_ids/loss_mask nor contexts/messages")
                answers[key] = str(record.get("answer", "")).strip().lower()
            except KeyError as err:
                raise DataError(f"{where}: the demonstration has no {err.args[0]!r} field") from err
            except (DataError, TypeError, ValueError, AttributeError) as err:
                raise DataError(f"{where}: {err}") from err
    by_answer = {a: [k for k in episodes if answers[k] == a] for a in ("yes", "no")}
    keep = min(len(keys) for keys in by_answer.values())
    dropped = {k for keys in by_answer.values() for k in keys[keep:]}
    kept = [key for key in episodes if key not in dropped]
    if question_kinds is not None:
        kept = mix_like_questions(kept, question_kinds, answers)
    return [g for key in kept for g in episodes[key]]


def question_kinds(config: Config) -> list[str] | None:
    """The kind of each question of the training split: ``yes/no`` where the gold answer is yes or no, else the
    dataset's type (HotpotQA: bridge or comparison); None when the dataset labels no types."""
    from envs import ENV_IDS
    from envs.data import load_examples

    spec = ENV_IDS.get(config.env.env_id)
    if spec is None:
        return None
    examples = load_examples(spec["dataset"], config.env.split, config.env.data_path)
    if not any(example.type for example in examples):
        return None
    return [example.kind for example in examples]


def mix_like_questions(keys: Sequence[object], kinds: Sequence[str], answers: dict[object, str]) -> list[object]:
    """The largest subset of the episodes `keys` (question indices, in order) whose kinds stand in the shares they
    have among all the questions (`kinds`), keeping each kind's first episodes and yes/no balanced.

    The oracle grounds almost every comparison (its answer is one of the entities the question names, so it stands
    in the passages) but only some bridge questions, so its kept episodes over-represent answers copied from the
    question. Keys that are not question indices (demonstration files without them) leave `keys` as they are.
    """
    if not all(isinstance(key, int) and 0 <= key < len(kinds) for key in keys):
        logger.warning("demonstrations without question indices: not mixed like the questions")
        return list(keys)
    by_kind: dict[str, list[object]] = {}
    for key in keys:
        by_kind.setdefault(kinds[key], []).append(key)
    share = {kind: sum(k == kind for k in kinds) / len(kinds) for kind in by_kind}
    scale = min(len(members) / share[kind] for kind, members in by_kind.items())
    wanted = {kind: int(scale * share[kind] + 1e-9) for kind in by_kind}
    chosen: set[object] = set()
    for kind, members in by_kind.items():
        if kind == "yes/no":  # half each, first come, as the balance above left them
            half = wanted[kind] // 2
            chosen.update([k for k in members if answers[k] == "yes"][:half])
            chosen.update([k for k in members if answers[k] == "no"][:half])
        else:
            chosen.update(members[: wanted[kind]])
    return [key for key in keys if key in chosen]


def _check_ids(generation: Generation, vocab: int) -> None:
    ids = generation.token_ids  # their count matches loss_mask's: Generation checks that
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DataError("token_ids must be integers")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise DataError(f"token id {bad[0]} is outside the tokenizer's vocabulary of {vocab} ({len(bad)} such ids)")


def _from_messages(context: dict[str, Any], tokenizer: Any) -> Generation:
    ids: list[int] = []
    mask: list[int] = []
    for message in context["messages"]:
        piece = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(message["role"] == "assistant")] * len(piece)
    return Generation(tuple(ids), tuple(mask), (0.0,) * len(ids), context.get("role", "agent"))


def load_demonstrations(
    config: Config, tokenizer: Any, *, max_tokens: int | None = None, exclude: Container[int] = ()
) -> list[Generation]:
    """The SFT demonstrations for `config`: from ``config.sft.sft_data``, the cache, or a fresh oracle run.

    Args:
        config: Training config (env settings, ``sft_data``, ``sft_num_demos``, seed).
        tokenizer: The policy's tokenizer.
        max_tokens: Drop contexts longer than this (the model's context); None keeps all.
        exclude: Question indices whose episodes are dropped (`read_demonstrations`).

    Returns:
        Demonstration contexts (every context of every kept episode).

    Raises:
        DataError: No demonstration survives the filters (none correct and grounded, or all longer than
            `max_tokens`: the message gives the context length that would keep one).
    """
    kinds = question_kinds(config) if config.sft.sft_mix == "questions" else None
    if config.sft.sft_data is not None:
        demos = read_demonstrations(config.sft.sft_data, tokenizer, question_kinds=kinds, exclude=exclude)
        source = config.sft.sft_data
    else:
        path = demonstrations_cache_path(config, tokenizer)
        if not path.is_file():
            trajectories = build_oracle_demonstrations(config, tokenizer)
            _write_atomic(path, (_generation_record(g, t) for t in trajectories for g in t.generations))
            correct = sum(float(t.info.get("f1", 0.0)) > 0 for t in trajectories)
            logger.info("oracle: %d of %d episodes correct; cached at %s", correct, len(trajectories), path)
        demos = read_demonstrations(path, tokenizer, question_kinds=kinds, exclude=exclude)
        source = str(path)
    logger.info("%d demonstration contexts from %s (%s)", len(demos), source, config.sft.sft_mix)
    kept = [d for d in demos if max_tokens is None or len(d.token_ids) <= max_tokens]
    if len(kept) < len(demos):
        logger.warning(
            "dropped %d of %d demonstrations longer than %s tokens", len(demos) - len(kept), len(demos), max_tokens
        )
    if not kept and demos:
        shortest = min(len(d.token_ids) for d in demos)
        raise DataError(
            f"--max-context-tokens {max_tokens} is shorter than every demonstration in {source} (the shortest is "
            f"{shortest} tokens): give --max-context-tokens {shortest} or more"
        )
    if not kept:
        raise DataError(
            f"no usable demonstrations in {source}: none answers correctly (F1 > 0) from evidence it was shown "
            "(oracle demonstrations: does the corpus hold the questions' gold paragraphs?)"
        )
    return kept


def sample_indices(
    num_demos: int,
    batch_size: int,
    seed: int,
    step: int,
    *,
    roles: Sequence[str] | None = None,
    planner_share: float | None = None,
) -> Sequence[int]:
    """Indices of one step's SFT minibatch: a function of (seed, step) only, so a resumed run draws the same ones.

    With `roles` (each demonstration's) and `planner_share`, ``round(batch_size * planner_share)`` of the
    minibatch comes from the planner's contexts and the rest from the others (CoDA's executors), as far as each
    kind has demonstrations; otherwise (also when no demonstration is a planner's) it is drawn from all alike.
    """
    import numpy as np

    rng = np.random.default_rng([seed, step, 0x5F7])
    if roles is not None and len(roles) != num_demos:
        raise ValueError(f"{len(roles)} roles for {num_demos} demonstrations")
    if roles is None or planner_share is None or "planner" not in roles:  # flat: the draw as without a share
        return rng.choice(num_demos, size=min(batch_size, num_demos), replace=False).tolist()
    planners = [i for i, role in enumerate(roles) if role == "planner"]
    others = [i for i, role in enumerate(roles) if role != "planner"]
    wanted = min(round(batch_size * planner_share), len(planners))
    wanted = max(wanted, batch_size - len(others))  # too few of the others: planners fill the minibatch
    picks = rng.choice(planners, size=min(wanted, len(planners)), replace=False).tolist()
    picks += rng.choice(others, size=min(batch_size - len(picks), len(others)), replace=False).tolist()
    return picks


def oracle_agent(config: Any, tokenizer: Any) -> Any:
    """The oracle that plays the run's demonstrations, with the run's settings (the SFT data and the expert group
    members of `algos.learners.expert` both come from it)."""
    from agents.oracle import OracleAgent

    return OracleAgent(
        tokenizer,
        seed=config.run.seed,
        max_searches=config.env.max_search_turns,
        quote_words=config.sft.quote_words,
        follow_bridge=config.sft.follow_bridge,
        restate_question=config.sft.restate_question,
        min_searches=config.sft.min_searches,
        results_queries=config.sft.results_queries,
    )
