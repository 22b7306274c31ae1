"""How far a perfect second query can go: the share of first-miss questions that one more search can answer.

    python -m benchmarks.investigations.second_query_bound --split dev --first 0 --limit 100   # the main job's report
    python -m benchmarks.investigations.second_query_bound --split dev --first 0 --limit 100 \
        --top-k 5 --passage-words 80

A trained agent's first query is the question itself (`benchmarks.first_search`). For each question that is not
yes/no this replays that search in the env and, where it does not show a gold answer (a *first-miss* question),
asks whether a gold title not yet shown is named in what the agent can read (the question or the passages shown)
and whether searching that title shows the answer. That is the best a second query copied from the agent's own
context can do, so multiplied by the agent's reading F1 on questions whose answer is shown it bounds the F1 a
two-search agent can reach on the first-miss questions in these env settings. Retrieval only: no model is loaded.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from typing import Any

from algos.difficulty import classify, searcher


def bound(env_kwargs: dict[str, Any], indices: Sequence[int]) -> dict[str, Any]:
    """Counts over `indices` of the split `env_kwargs` names: questions that are not yes/no, first-miss ones, those
    with a missing gold title named in the question or the first results, and those whose search of it shows the
    answer; with the indices of each first-miss question's outcome."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the env ids)

    env = gym.make("RedCoda-HotpotQA-v0", **{**env_kwargs, "protocol": "flat"})
    outside = [i for i in indices if not 0 <= i < env.unwrapped.num_examples]
    if outside:
        env.close()
        raise ValueError(f"question {outside[0]} is outside the split's {env.unwrapped.num_examples} questions")
    search = searcher(env)

    counts = {"questions": 0, "first_miss": 0, "named": 0, "found": 0}
    found: list[int] = []
    for index in indices:
        # the agent's own context names the title: one try, the first named gold title
        kind, named = classify(env.unwrapped.examples[index], functools.partial(search, index), tries=1)
        if kind == "yes_no":
            continue
        counts["questions"] += 1
        if kind == "first":
            continue
        counts["first_miss"] += 1
        counts["named"] += named
        if kind == "bridge":
            counts["found"] += 1
            found.append(index)
    env.close()
    return {**counts, "share_found": counts["found"] / max(1, counts["first_miss"]), "found_indices": found}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--first", type=int, default=0, help="the first question's index in the split")
    parser.add_argument("--limit", type=int, default=100, help="questions from --first on")
    parser.add_argument("--top-k", type=int, default=3, help="passages a search shows (the cpu preset's: 3)")
    parser.add_argument("--passage-words", type=int, default=40, help="words a passage shows (the cpu preset's: 40)")
    parser.add_argument("--corpus", default="pooled")
    parser.add_argument("--retriever", default="bm25")
    args = parser.parse_args(argv)
    if args.first < 0 or args.limit < 1:
        parser.error("--first must be >= 0 and --limit >= 1")
    env_kwargs = {
        "split": args.split,
        "corpus": args.corpus,
        "retriever": args.retriever,
        "top_k": args.top_k,
        "max_passage_words": args.passage_words,
    }
    try:
        result = bound(env_kwargs, range(args.first, args.first + args.limit))
    except ValueError as error:
        parser.error(str(error))
    print(
        f"{args.split} {args.first}-{args.first + args.limit - 1}, top {args.top_k} x {args.passage_words} words: "
        f"{result['questions']} not yes/no, {result['first_miss']} first-miss, a missing gold title named in "
        f"{result['named']}, its search shows the answer in {result['found']} ({result['share_found']:.2f} of the "
        "first-miss questions)"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "found_indices"}))
    return result


if __name__ == "__main__":
    main()
