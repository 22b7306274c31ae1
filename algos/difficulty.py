"""Which training questions the env can reward: a per-question difficulty table made once from BM25 alone.

Each question of the training split falls in one kind, by what the env's own retriever shows (no model runs):

- ``yes_no``: the answer is yes or no (never shown by a search; kept: the agent can answer it from what it reads);
- ``first``: searching the question itself shows a gold answer;
- ``bridge``: it does not, but a gold title not yet shown is named in the question or those results, and searching
  that title shows the answer (one more search of a title the agent can read reaches it);
- ``unreachable``: neither; no search copied from the agent's own context shows the answer.

``--question-draw reachable`` (`algos.run.setup.make_collector`) draws rollouts from every kind but ``unreachable``:
a group on such a question ties at the format reward whatever the policy does, and costs a full rollout. The table
is cached under ``cache_root()/difficulty/``, keyed by the split and the retrieval settings; build or print one with

    python -m algos.difficulty --split train --top-k 3 --max-passage-words 40
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agents.oracle import base_title, mentions, shown_passages
from envs.first_search import shows_answer
from envs.rewards import is_yes_no

__all__ = ["KINDS", "build_table", "classify", "load_table", "reachable", "searcher", "table_path"]

KINDS: tuple[str, ...] = ("first", "bridge", "yes_no", "unreachable")
"""The kinds of question, in the order the table's summary prints them."""

_RETRIEVAL_KEYS = ("split", "data_path", "corpus", "corpus_path", "retriever", "top_k", "max_passage_words")
"""The env settings that change what a search shows (and so the table)."""


def search_settings(env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The env settings of the table: the run's retrieval settings under the flat protocol, with plain observations
    (a question repeated after the results would "show" a comparison question's answer)."""
    return {key: env_kwargs[key] for key in _RETRIEVAL_KEYS if env_kwargs.get(key) is not None} | {"protocol": "flat"}


def table_path(env_id: str, env_kwargs: dict[str, Any]) -> Path:
    """Cache file of the table for this env and its settings."""
    from retrievers.corpus import cache_root

    key = json.dumps({"env_id": env_id, **search_settings(env_kwargs)}, sort_keys=True, default=str)
    return cache_root() / "difficulty" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def searcher(env: Any) -> Callable[[int, str], str]:
    """``search(index, query)``: the observation of `query` searched in a fresh episode of question `index` of `env`
    (each query on its own, so the turn limit never cuts a replay short)."""

    def search(index: int, query: str) -> str:
        env.reset(options={"index": index})
        observation, *_ = env.step(f"<search>{query}</search>")
        return observation

    return search


def classify(example: Any, search: Callable[[str], str], tries: int = 2) -> tuple[str, bool]:
    """The kind (`KINDS`) of `example`, and whether a gold title missing from the first results is named in the
    question or in them (first-miss questions only).

    Args:
        example: A `envs.data.QAExample`.
        search: The observation of a query searched for this question.
        tries: How many of the named titles to search, in the order of the gold titles.
    """
    if is_yes_no(example.answer):
        return "yes_no", False
    first = search(example.question)
    if shows_answer(first, example.answers):
        return "first", False
    shown = dict(shown_passages(first))
    readable = example.question + " " + " ".join(shown.values())
    named = [base_title(t) for t in example.gold_titles if t not in shown and mentions(readable, base_title(t))]
    reached = any(shows_answer(search(title), example.answers) for title in named[:tries])
    return ("bridge" if reached else "unreachable"), bool(named)


def build_table(env_id: str, env_kwargs: dict[str, Any], indices: Sequence[int] | None = None) -> list[str]:
    """The kind (`KINDS`) of each question of the split (or of `indices` only), from the env's own searches."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the env ids)

    env = gym.make(env_id, disable_env_checker=True, **search_settings(env_kwargs))
    search, examples = searcher(env), env.unwrapped.examples
    indices = range(len(examples)) if indices is None else indices
    kinds = [classify(examples[i], functools.partial(search, i))[0] for i in indices]
    env.close()
    return kinds


def load_table(env_id: str, env_kwargs: dict[str, Any]) -> list[str]:
    """The table of this env and its settings: from the cache, or built now (seconds for the bundled train split with
    Lucene) and cached."""
    from retrievers.files import atomic_file

    path = table_path(env_id, env_kwargs)
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))["kinds"]
    kinds = build_table(env_id, env_kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"settings": search_settings(env_kwargs), "kinds": kinds}, default=str))
    return kinds


def reachable(indices: Sequence[int], kinds: Sequence[str]) -> list[int]:
    """The `indices` whose kind is not ``unreachable``; all of them when none would be left."""
    kept = [i for i in indices if kinds[i] != "unreachable"]
    return kept or list(indices)


def main(argv: Sequence[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="RedCoda-HotpotQA-v0")
    parser.add_argument("--split", default="train")
    parser.add_argument("--retriever", default="bm25")
    parser.add_argument("--corpus", default="pooled", choices=("pooled", "distractor"))
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-passage-words", type=int, default=40)
    args = parser.parse_args(argv)
    if args.top_k < 1 or args.max_passage_words < 1:
        parser.error("--top-k and --max-passage-words must be >= 1")
    env_kwargs = {key: getattr(args, key) for key in ("split", "retriever", "corpus", "top_k", "max_passage_words")}
    counts = collections.Counter(load_table(args.env_id, env_kwargs))
    total = sum(counts.values())
    print(", ".join(f"{kind} {counts[kind]} ({counts[kind] / total:.2f})" for kind in KINDS), f"of {total} questions")
    print(f"cached at {table_path(args.env_id, env_kwargs)}")
    return dict(counts)


if __name__ == "__main__":
    main()
