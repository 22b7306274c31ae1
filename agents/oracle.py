"""The oracle teacher: demonstrations built from supporting facts, played through the real env.

The oracle reads the gold evidence of each question (supporting-fact titles and sentences, MuSiQue's
decomposition where there is one) and acts in the env like a good agent would: it searches, looks at
what came back, searches again for the gold titles still missing (naming the bridge entity), quotes the
evidence in <think>/<refine>, and answers. Its first query is the question itself or the first gold
title (seeded), so demonstrations vary in their number of searches. Every action goes through the real
env and retriever, and the episode is recorded in exactly the token layout of the LLM agents
(`Generation`s with the model's turns masked 1), so it is SFT data for GRPO+SFT and RED as it stands.

    python -m agents.oracle --split train --out oracle_train.jsonl [--protocol flat|coda] [--limit N]

Output: one JSON object per episode (the chat format documented in `demonstration_record`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.records import Completion, SamplingParams, Trajectory
from agents.search_agents import ContextAgent, _Slot
from envs.data import QAExample
from envs.rewards import cover_exact_match

_TITLE = re.compile(r'Doc \d+ \(Title: "(.*?)"\)')


@dataclass
class _Plan:
    """What the oracle knows and has seen in one episode."""

    example: QAExample
    first_query_is_question: bool
    seen_titles: set[str] = field(default_factory=set)
    queried: set[str] = field(default_factory=set)
    """Titles already used as queries: a title BM25 did not return once is not searched again."""
    searches: int = 0
    task: int = 0
    results: list[str] = field(default_factory=list)


class OracleAgent(ContextAgent):
    """Acts from the gold evidence, in either protocol.

    Args:
        tokenizer: the tokenizer of the model the demonstrations are for.
        seed: seeds the choice of first query.
        max_searches: searches per (sub-)task before the oracle answers anyway.
    """

    def __init__(self, tokenizer: Any, seed: int = 0, max_searches: int = 2) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.max_searches = max_searches
        self.max_context_tokens = 1 << 30
        self.params = self.executor_params = SamplingParams(max_new_tokens=0)
        self._plans: dict[int, _Plan] = {}

    def _check_env(self, env: Any) -> None:
        if not env.unwrapped.examples[0].answers:
            raise ValueError("the oracle needs gold answers")

    def _tokenizer(self, role: str) -> Any:
        return self.tokenizer

    def _act(self, live: list[_Slot], seed: int | None) -> list[Completion]:
        out = []
        for slot in live:
            plan = self._plans.get(id(slot))
            if plan is None:
                example = slot.env.unwrapped.examples[slot.index]
                plan = self._plans[id(slot)] = _Plan(example, bool(self.rng.random() < 0.5))
            text = self._next_action(slot, plan)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Completion(text, tuple(ids), (0.0,) * len(ids), "stop"))
        return out

    def rollout(self, envs, indices, group_ids=None, seed=None) -> list[Trajectory]:
        self._plans.clear()
        try:
            return super().rollout(envs, indices, group_ids, seed)
        finally:
            self._plans.clear()

    def _apply(self, slot: _Slot, completion: Completion) -> None:
        super()._apply(slot, completion)
        plan = self._plans[id(slot)]
        plan.seen_titles.update(_TITLE.findall(slot.last_obs))
        if "<result>" in slot.last_obs:
            plan.results.append(slot.last_obs.split("<result>", 1)[1].split("</result>", 1)[0])

    # -- the policy -------------------------------------------------------------------------------------
    def _next_action(self, slot: _Slot, plan: _Plan) -> str:
        role, example = slot.context.role, plan.example
        if role == "agent":
            return self._search_or_answer(plan, example.gold_titles, example.question, final=True)
        if role == "executor":
            titles = (
                (example.gold_titles[min(plan.task - 1, len(example.gold_titles) - 1)],) if example.gold_titles else ()
            )
            return self._search_or_answer(plan, titles, self._subquestion(plan, plan.task - 1), final=False)
        # planner
        n_tasks = max(1, len(example.decomposition) or len(example.gold_titles))
        if plan.task < n_tasks:
            plan.task += 1
            plan.searches = 0
            sub = self._subquestion(plan, plan.task - 1)
            known = f" So far I know: {plan.results[-1]}" if plan.results else ""
            return f"<think>I need to answer step {plan.task}: {sub}.{known}</think>\n<task>{sub}</task>"
        evidence = " ".join(plan.results)
        return (
            f"<think>The workers found: {evidence}</think>\n"
            f"<refine>{evidence} Therefore the answer is {example.answer}.</refine>\n<answer>{example.answer}</answer>"
        )

    def _subquestion(self, plan: _Plan, i: int) -> str:
        example = plan.example
        if example.decomposition:
            sub = example.decomposition[min(i, len(example.decomposition) - 1)][0]
            for j, (_, answer) in enumerate(example.decomposition[:i]):
                sub = sub.replace(f"#{j + 1}", answer)
            return sub
        if not example.gold_titles:
            return example.question
        title = example.gold_titles[min(i, len(example.gold_titles) - 1)]
        return f"What does {title} tell us for the question: {example.question}"

    def _search_or_answer(self, plan: _Plan, titles: Sequence[str], question: str, final: bool) -> str:
        example = plan.example
        missing = [t for t in titles if t not in plan.seen_titles and t not in plan.queried]
        if missing and plan.searches < self.max_searches + len(titles) - 1:
            plan.searches += 1
            if plan.searches == 1 and plan.first_query_is_question:
                query, why = question, "Let me search for the question first."
            else:
                query = missing[0]
                plan.queried.add(query)
                why = f"I still need information about {query}."
            return f"<think>{why}</think>\n<search>{query}</search>"
        sentences = [s for t in titles for s in example.supporting_sentences(t)] or [example.question]
        evidence = " ".join(sentences)
        if final:
            return (
                f"<think>The evidence says: {evidence}</think>\n"
                f"<refine>{evidence} So the answer is {example.answer}.</refine>\n<answer>{example.answer}</answer>"
            )
        if example.decomposition:
            sub_answer = example.decomposition[min(plan.task - 1, len(example.decomposition) - 1)][1]
        else:
            sub_answer = sentences[0]
        refine = f"<refine>{evidence}</refine>\n" if cover_exact_match(evidence, example.answers) else ""
        return f"<think>The evidence says: {evidence}</think>\n{refine}<answer>{sub_answer}</answer>"


def demonstration_record(trajectory: Trajectory, tokenizer: Any, env: Any) -> dict[str, Any]:
    """One episode as a JSON-ready chat record.

    Format: `{"id", "index", "protocol", "reward", "f1", "contexts": [{"role", "messages": [...]}]}` where each
    context's messages are `{"role": "assistant"|"observation", "content"}`: the assistant messages are the
    model's turns (trained on), observation messages everything else (not trained on): first the
    chat-template prompt (system and user turns, rendered), then what the env inserted between turns.
    Tokenizing the contents message by message, in order, gives the exact token context the agents use.
    """
    contexts = []
    for generation in trajectory.generations:
        messages: list[dict[str, str]] = []
        run: list[int] = []
        run_mask = None
        for token, mask in zip(generation.token_ids, generation.loss_mask, strict=True):
            if run and mask != run_mask:
                messages.append({"role": "assistant" if run_mask else "observation", "content": tokenizer.decode(run)})
                run = []
            run.append(token)
            run_mask = mask
        if run:
            messages.append({"role": "assistant" if run_mask else "observation", "content": tokenizer.decode(run)})
        contexts.append({"role": generation.role, "messages": messages})
    example = env.unwrapped.examples[trajectory.example_index]
    return {
        "id": example.id,
        "index": trajectory.example_index,
        "protocol": env.unwrapped.protocol,
        "reward": trajectory.reward,
        "f1": trajectory.info.get("f1", 0.0),
        "contexts": contexts,
    }


def main(argv: Sequence[str] | None = None) -> None:
    import gymnasium as gym
    from tqdm.auto import tqdm

    import envs  # noqa: F401
    from agents.models import smollm2_tokenizer

    parser = argparse.ArgumentParser(description="Write oracle demonstrations (SFT data) as JSON lines.")
    parser.add_argument("--split", default="train")
    parser.add_argument("--dataset", default="hotpotqa")
    parser.add_argument("--protocol", choices=("flat", "coda"), default="flat")
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)

    tokenizer = smollm2_tokenizer()
    env_kwargs = {
        "dataset": args.dataset,
        "split": args.split,
        "protocol": args.protocol,
        "max_turns": 6,
        "max_planner_turns": 6,
        "max_executor_turns": 4,
    }
    envs_ = [gym.make("RedCoda-HotpotQA-v0", **env_kwargs) for _ in range(args.batch)]
    n = min(args.limit or envs_[0].unwrapped.num_examples, envs_[0].unwrapped.num_examples)
    agent = OracleAgent(tokenizer, seed=args.seed)
    f1s = []
    with open(args.out, "w", encoding="utf-8") as out, tqdm(total=n, desc="oracle", unit="q") as bar:
        for lo in range(0, n, args.batch):
            indices = list(range(lo, min(lo + args.batch, n)))
            for trajectory in agent.rollout(envs_[: len(indices)], indices, seed=args.seed + lo):
                out.write(json.dumps(demonstration_record(trajectory, tokenizer, envs_[0]), ensure_ascii=False) + "\n")
                f1s.append(trajectory.info.get("f1", 0.0))
            bar.update(len(indices))
    print(f"wrote {len(f1s)} demonstrations to {args.out}; mean F1 {np.mean(f1s):.3f}")


if __name__ == "__main__":
    main()
