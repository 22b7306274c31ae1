"""Reading or searching? Split an evaluation by whether the question-as-query search already shows the answer.

    python -m benchmarks.first_search runs/red/eval.json [benchmarks/results/compare-cpu-flat/evals/*.json ...]

The main job writes the split of its trained model under its before/after table (`algos.run.evaluation.before_after`).

A trained agent's first query is the question itself (as the oracle's demonstrations teach). For each held-out
question this replays that one search in the evaluation's own env settings (retriever, top-k, passage words) and
asks whether a gold answer stands in the passages it shows (as whole words after answer normalization: an upper
bound, since the words can stand there about something else, e.g. "American" said of another author). The
questions whose answer is yes or no are set aside (their answer never stands in a passage). Then, per evaluation:

- *shown*: the first search shows the answer, so the question is one of reading the right span; F1 there measures
  reading;
- *not shown*: a later search has to find it (the bridge entity named in a second query), so F1 there measures
  searching;

with the share of episodes that searched more than once in each part, and, where the first search missed the
answer, the share whose own later queries (replayed the same way) showed it. A second table splits F1 by the
dataset's question type (`KINDS`): bridge questions; comparisons whose answer is one of the two entities the question
names ("Who is older, A or B?": picking either scores 0.5 on average); other comparisons ("What type of plant are A
and B?"); yes/no. An evaluation is a main job's ``eval.json``
(its ``after`` and ``before`` results) or one result written by `benchmarks.evaluate` / `benchmarks.compare`
(``evals/<run>.json``). Retrieval only: no model is loaded, and nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.rewards import is_yes_no, normalize_answer
from envs.stats import mean_ci

_SEARCH = re.compile(r"<search>(.*?)</search>", re.S)


def results_in(path: Path) -> dict[str, dict[str, Any]]:
    """The evaluation results a file holds, by name: a main job's eval.json gives its after and before results."""
    data = json.loads(path.read_text())
    if "after" in data:
        return {f"{path.parent.name} (trained)": data["after"], f"{path.parent.name} (start)": data["before"]}
    return {path.stem: data}


def shows_answer(observation: str, answers: Sequence[str]) -> bool:
    """Whether a gold answer stands in `observation` as whole words after answer normalization."""
    text = f" {normalize_answer(observation)} "
    return any(f" {normalize_answer(answer)} " in text for answer in answers)


def searches_show(result: dict[str, Any]) -> tuple[dict[int, bool], dict[int, bool]]:
    """Per question of `result` (by dataset index): does the question-as-query search show a gold answer, and does
    one of the agent's own later queries (its second search on) show one?"""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the env ids)

    kwargs = {**result["settings"]["env_kwargs"], "protocol": "flat"}  # the executor's searches are the flat agent's
    env = gym.make("RedCoda-HotpotQA-v0", **kwargs)

    def shows(index: int, query: str) -> bool:
        env.reset(options={"index": index})  # each query on its own: the turn limit never cuts a replay short
        observation, *_ = env.step(f"<search>{query}</search>")
        return shows_answer(observation, env.unwrapped.examples[index].answers)

    first, later = {}, {}
    for prediction in result["predictions"]:
        index = prediction["index"]
        queries = [q for action in prediction.get("actions", []) for q in _SEARCH.findall(action)]
        first[index] = shows(index, env.unwrapped.examples[index].question)
        later[index] = any(shows(index, query) for query in queries[1:])
    env.close()
    return first, later


def split(result: dict[str, Any], shown: dict[int, bool], later: dict[int, bool]) -> dict[str, dict[str, float]]:
    """F1 (mean and 95% CI), questions, the share that searched more than once and the share whose later search
    showed the answer, per part of `result`."""
    parts: dict[str, list[dict[str, Any]]] = {"shown": [], "not shown": [], "yes/no": []}
    for p in result["predictions"]:
        yes_no = is_yes_no(p["gold_answers"][0])
        parts["yes/no" if yes_no else "shown" if shown[p["index"]] else "not shown"].append(p)
    out = {}
    for name, predictions in parts.items():
        if not predictions:  # a small evaluation can leave a part empty
            out[name] = {"n": 0, "f1": None, "low": None, "high": None, "searched_again": 0.0, "found_later": 0.0}
            continue
        f1 = mean_ci([p["f1"] for p in predictions])
        searched_again = sum(p["num_searches"] >= 2 for p in predictions) / max(1, len(predictions))
        found_later = sum(later[p["index"]] for p in predictions) / max(1, len(predictions))
        out[name] = {
            "n": len(predictions),
            "f1": f1.mean,
            "low": f1.low,
            "high": f1.high,
            "searched_again": searched_again,
            "found_later": found_later,
        }
    return out


KINDS = ("bridge", "comparison: one of the two named", "comparison: other", "yes/no")
"""The parts of `by_kind`: HotpotQA's question types, its comparisons split by whether the answer is one of the
entities the question names (picking one of two: a coin flip scores 0.5) and yes/no set apart."""


def question_kinds(result: dict[str, Any]) -> dict[int, str]:
    """Per question of `result` (by dataset index), its part of `KINDS`, from the dataset's own question type."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the env ids)

    env = gym.make("RedCoda-HotpotQA-v0", **{**result["settings"]["env_kwargs"], "protocol": "flat"})
    examples = env.unwrapped.examples
    env.close()
    kinds = {}
    for prediction in result["predictions"]:
        example = examples[prediction["index"]]
        if example.kind == "yes/no":
            kinds[prediction["index"]] = "yes/no"
        elif example.kind != "comparison":
            kinds[prediction["index"]] = "bridge"
        else:
            named = f" {normalize_answer(example.answer)} " in f" {normalize_answer(example.question)} "
            kinds[prediction["index"]] = KINDS[1] if named else KINDS[2]
    return kinds


def by_kind(result: dict[str, Any], kinds: dict[int, str]) -> dict[str, dict[str, float]]:
    """F1 (mean and 95% CI) and questions per part of `KINDS` (parts without a question are left out)."""
    out = {}
    for kind in KINDS:
        f1s = [p["f1"] for p in result["predictions"] if kinds[p["index"]] == kind]
        if f1s:
            f1 = mean_ci(f1s)
            out[kind] = {"n": len(f1s), "f1": f1.mean, "low": f1.low, "high": f1.high}
    return out


def kinds_table(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one line per evaluation; per question kind n and F1 [95% CI]."""
    lines = ["| evaluation | " + " | ".join(f"{kind}: n, F1 [95% CI]" for kind in KINDS) + " |", "|---" * 5 + "|"]
    for name, parts in rows.items():
        cells = [
            f"{p['n']}, {p['f1']:.3f} [{p['low']:.3f}, {p['high']:.3f}]" if (p := parts.get(kind)) else "-"
            for kind in KINDS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one line per evaluation; per part n, F1 [95% CI], the shares that searched again, found it later."""
    lines = [
        "| evaluation | answer shown by the first search: n, F1 [95% CI], searched again | not shown: n, F1 [95% CI],"
        " searched again, a later search of its own showed it | yes/no: n, F1 |",
        "|---|---|---|---|",
    ]
    for name, parts in rows.items():
        shown, hidden, yes_no = parts["shown"], parts["not shown"], parts["yes/no"]
        cells = [
            f"{p['n']}, {p['f1']:.3f} [{p['low']:.3f}, {p['high']:.3f}], {p['searched_again']:.2f}" if p["n"] else "0"
            for p in (shown, hidden)
        ]
        hidden_cell = f"{cells[1]}, {hidden['found_later']:.2f}" if hidden["n"] else "0"
        yes_no_cell = f"{yes_no['n']}, {yes_no['f1']:.3f}" if yes_no["n"] else "0"
        lines.append(f"| {name} | {cells[0]} | {hidden_cell} | {yes_no_cell} |")
    return "\n".join(lines)


def split_tables(results: dict[str, dict[str, Any]]) -> tuple[str, dict[str, dict[str, Any]]]:
    """Both tables (reading or searching, then question kinds) of the evaluations `results` holds by name, in
    Markdown, and the numbers behind them: per name the parts of `split` and ``"by kind"``, those of `by_kind`."""
    rows, kinds = {}, {}
    for name, result in results.items():
        rows[name] = split(result, *searches_show(result))
        kinds[name] = by_kind(result, question_kinds(result))
    numbers = {name: {**parts, "by kind": kinds[name]} for name, parts in rows.items()}
    return f"{table(rows)}\n\n{kinds_table(kinds)}", numbers


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("evaluations", nargs="+", type=Path, help="eval.json of a main job, or evaluation results")
    args = parser.parse_args(argv)
    results = {name: result for path in args.evaluations for name, result in results_in(path).items()}
    tables, numbers = split_tables(results)
    print(tables)
    return numbers


if __name__ == "__main__":
    main()
