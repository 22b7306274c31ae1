"""The oracle teacher: demonstrations built from supporting facts, played through the real env.

The oracle knows the gold answer and titles, but acts only as a model could learn to from its own context:

- its first query is the question itself (a copy of what the model reads);
- a later query is a gold title still missing, and only one that appears in the question or in a passage
  already shown (the bridge entity named in the second query); a missing title that appears nowhere is
  not searched;
- it answers as soon as the answer can be read from what the env showed (the passages as cut by the env's
  ``max_passage_words``), quoting that evidence first: ``<refine>`` holds the one sentence (at most
  ``quote_words`` words around the answer) the answer is read from, then ``<answer>`` the gold answer;
  yes/no answers quote the opening words of each gold passage seen and conclude. With ``quote_words=0`` it
  answers without a quote (the evidence still decides when it answers and whether the episode is grounded).

The number of searches therefore varies (one when the first results already hold the answer); the options
(`OracleAgent`) change that. An episode is *grounded* (``info["oracle_grounded"]``) when every query was copyable
and the answer was read from shown evidence (yes/no: both gold passages shown); `algos.sft_data` trains on grounded
episodes only. CoDA: the planner delegates the question as its first task (later tasks: a missing gold title that
the results name), each executor plays the flat policy on its task, and the planner answers from its <result>s.
Every action goes through the real env and retriever; episodes are recorded in the LLM agents' token layout.

    python -m agents.oracle --split train --out oracle_train.jsonl [--protocol flat|coda] [--limit N] [--data-path F]

Output: one JSON object per episode (the chat format documented in `demonstration_record`). Bad input ends the
command at start with one line, ``error: ...``, and exit status 2, before the tokenizer loads or a retriever starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.records import Completion, SamplingParams, Trajectory
from agents.search_agents import ContextAgent, _Slot
from envs.data import BUNDLED_SPLITS, DATASETS, QAExample
from envs.protocol import ENV_TAGS, MODEL_TAGS
from envs.rewards import is_yes_no, normalize_answer
from retrievers.files import OneLineParser, atomic_file, output_problem

_DOC = re.compile(r'^Doc \d+ ?\(Title: "(.*?)"\) (.*)', re.MULTILINE)
"""One passage of a results block (the text inside ``<information>``), from the start of a line to its end, in either
observation format: ours (``Doc 1 (Title: "..") text``) or Search-R1's (``Doc 1(Title: "..") text``: the title as the
corpus line has it, quoted in the bundled corpus and in Search-R1's)."""
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_PROTOCOL_TAG = re.compile(r"</?\s*(?:" + "|".join(MODEL_TAGS + ENV_TAGS) + r")\s*>", re.IGNORECASE)
"""A protocol tag as the env's parser reads one (any case, spaces before the ">"), and with spaces after the "<" too."""


def as_data(text: str) -> str:
    """`text` with every protocol tag removed and its spaces collapsed: passage text safe to quote in an action.

    Removing (rather than escaping) keeps the quote's words as the model read them, and leaves nothing that the
    env's parser, or a model trained on the quote, could take for a tool call or an env block.
    """
    return " ".join(_PROTOCOL_TAG.sub(" ", text).split())


@dataclass
class _Plan:
    """What the oracle has seen and done in one episode (flat) or one executor task / planner (coda)."""

    example: QAExample
    shown: dict[str, str] = field(default_factory=dict)
    """Passages the env showed, title -> text as shown (cut to the env's passage length)."""
    queried: set[str] = field(default_factory=set)
    searches: int = 0
    copyable_queries: bool = True
    grounded: bool = False
    tasks: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)


def mentions(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text` as whole words, after answer normalization."""
    phrase = normalize_answer(phrase)
    return bool(phrase) and f" {phrase} " in f" {normalize_answer(text)} "


def base_title(title: str) -> str:
    """A Wikipedia title without its disambiguation: "Alan Campbell (actor)" -> "Alan Campbell"."""
    return re.sub(r"\s*\([^)]*\)$", "", title) or title


def _quote(text: str, answer: str, max_words: int) -> str | None:
    """The sentence of `text` that holds `answer`, cut to `max_words` words around it; None if absent.

    The cut is centred on the answer's own words (not on the first word that merely looks like its first word), and
    keeps all of them even when the answer alone is longer than `max_words`.
    """
    target = normalize_answer(answer).split()
    for sentence in _SENTENCE_END.split(text):
        if not mentions(sentence, answer):
            continue
        words = sentence.replace(" ...", "").split()
        if len(words) <= max_words:
            return " ".join(words)
        kept = [(i, n) for i, w in enumerate(words) for n in normalize_answer(w).split()]  # articles vanish
        starts = [j for j in range(len(kept) - len(target) + 1) if [n for _, n in kept[j : j + len(target)]] == target]
        if not starts:  # the answer spans a word boundary the split cannot see: the sentence as it is
            return " ".join(words)
        first, last = kept[starts[0]][0], kept[starts[0] + len(target) - 1][0]
        width = max(max_words, last - first + 1)
        lo = max(0, min(first - (width - (last - first + 1)) // 2, len(words) - width))
        return " ".join(words[lo : lo + width])
    return None


class OracleAgent(ContextAgent):
    """Acts from the gold evidence, in either protocol, as described in the module docstring.

    With ``follow_bridge`` it searches a missing gold title that the question or the results name even when the
    answer is already shown (not for yes/no questions, whose evidence rule already asks for both gold passages), so
    the second query names the bridge entity wherever it can, up to ``max_searches``. With ``restate_question`` every
    answering turn first copies the question it answers (the executor's: its task) into ``<think>``, so the answer is
    written right after the words that say what is asked. With ``min_searches`` 2 it searches a second time before
    answering even when the first results already show the answer (a missing gold title named in what it read, else
    the named gold title that holds the answer): every episode then has the same shape, so the second search is the
    model's most likely move after the first results, not a choice it must learn. With ``results_queries`` a later
    query prefers a gold title that the results name and the question does not (the bridge entity, read off the
    passages); a second search that ``min_searches`` adds after the answer already shows is made only with such a
    title, so no demonstration searches again for a name it could copy from its own question.

    Passage text is data, never protocol. The oracle reads passages only from the results of its own searches and
    the <result> of a task only when the env hands control back to the planner, so tags inside a passage
    (``</information>``, ``<result>..</result>``, ``<answer>..</answer>``, ...) neither end a block nor forge a
    result; what it quotes of a passage has every protocol tag removed (`as_data`: the words between stay), so a
    quote cannot open a tool call or an env block in the demonstration; and the planner's turns hold only its tasks,
    the executors' answers and the gold answer, never a passage (it never sees one).

    Args:
        tokenizer: the tokenizer of the model the demonstrations are for.
        seed: seeds the oracle's random choices (none are random today; kept for the record format).
        max_searches: searches per episode (flat) or per task (coda) before the oracle answers anyway.
        max_tasks: coda: tasks the planner delegates at most.
        quote_words: longest evidence quote, in words; 0 answers without a ``<refine>`` quote.
        follow_bridge: search a missing gold title that is named where the oracle can read it even when the
            answer is already shown (see the module docstring).
        restate_question: answering turns open with ``<think>`` and the question they answer (see the module
            docstring).
        min_searches: searches per episode (flat) or per task (coda) before the oracle answers, where a query it
            can copy remains (see the module docstring).
        results_queries: later queries name a gold title the results name and the question does not, first (see
            above).
    """

    def __init__(
        self,
        tokenizer: Any,
        seed: int = 0,
        max_searches: int = 2,
        max_tasks: int = 2,
        quote_words: int = 12,
        follow_bridge: bool = False,
        restate_question: bool = False,
        min_searches: int = 1,
        results_queries: bool = False,
    ) -> None:
        if quote_words < 0:
            raise ValueError(f"quote_words must be >= 0 (0: no quote), got {quote_words}")
        if min_searches < 1:
            raise ValueError(f"min_searches must be >= 1, got {min_searches}")
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.max_searches = max_searches
        self.max_tasks = max_tasks
        self.quote_words = quote_words
        self.follow_bridge = follow_bridge
        self.restate_question = restate_question
        self.min_searches = min_searches
        self.results_queries = results_queries
        self.max_context_tokens = 1 << 30
        self.params = self.executor_params = SamplingParams(max_new_tokens=0)
        self._plans: dict[tuple[int, str], _Plan] = {}

    def _check_env(self, env: Any) -> None:
        if not env.unwrapped.examples[0].answers:
            raise ValueError("the oracle needs gold answers")

    def _tokenizer(self, role: str) -> Any:
        return self.tokenizer

    def _plan(self, slot: _Slot) -> _Plan:
        key = (id(slot), "planner" if slot.context.role == "planner" else "searcher")
        if key not in self._plans:
            self._plans[key] = _Plan(slot.env.unwrapped.examples[slot.index])
        return self._plans[key]

    def _act(self, live: list[_Slot], seed: int | None) -> list[Completion]:
        out = []
        for slot in live:
            text = self._next_action(slot, self._plan(slot))
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
        plan = self._plan(slot)
        acting = slot.context.role
        super()._apply(slot, completion)
        if slot.done:
            slot.info = {**slot.info, "oracle_grounded": plan.grounded and plan.copyable_queries}
            return
        if acting == "executor" and slot.context.role == "planner":  # the task ended: the env's <result> block
            planner = self._plans[(id(slot), "planner")]
            obs = slot.last_obs.strip()
            planner.results.append(obs.removeprefix("<result>").removesuffix("</result>").strip())
            planner.copyable_queries &= plan.copyable_queries and plan.grounded  # a grounded episode: every task too
            self._plans.pop((id(slot), "searcher"), None)  # the next task starts a fresh executor plan
        elif acting != "planner" and "<search>" in completion.text:  # the results of the oracle's own search
            for title, text in shown_passages(slot.last_obs):
                plan.shown.setdefault(title, text)

    # -- the policy -------------------------------------------------------------------------------------
    def _next_action(self, slot: _Slot, plan: _Plan) -> str:
        role, example = slot.context.role, plan.example
        if role == "planner":
            return self._plan_next(plan, example)
        question = example.question if role == "agent" else self._plans[(id(slot), "planner")].tasks[-1]
        return self._search_or_answer(plan, example, question)

    def _plan_next(self, plan: _Plan, example: QAExample) -> str:
        evidence = " ".join(plan.results)
        if plan.results and mentions(evidence, example.answer) or len(plan.tasks) >= self.max_tasks:
            plan.grounded = mentions(evidence, example.answer) or is_yes_no(example.answer)
            return self._written_answer(evidence, example.answer, example.question)
        if not plan.tasks:
            task = example.question
        else:
            named = [t for t in example.gold_titles if mentions(evidence, t)] or list(example.gold_titles[-1:])
            plan.copyable_queries &= bool(named) and mentions(evidence, named[0])
            task = f"What is known about {named[0]}?"
        plan.tasks.append(task)
        return f"<think>I will ask a worker.</think>\n<task>{task}</task>"

    def _search_or_answer(self, plan: _Plan, example: QAExample, question: str) -> str:
        answer = example.answer
        missing = [t for t in example.gold_titles if t not in plan.shown and t not in plan.queried]
        seen = question + " " + " ".join(plan.shown.values())
        copyable = [base_title(t) for t in missing if mentions(seen, base_title(t))]
        quote = self._evidence(plan, example)
        follow = self.follow_bridge and copyable and plan.searches > 0 and not is_yes_no(answer)
        again = [] if plan.searches >= self.min_searches else copyable or self._named_golds(plan, example, seen)
        if self.results_queries:
            body = " ".join(plan.shown.values())
            copyable = self._read_off(copyable, body, question) + [t for t in copyable if mentions(question, t)]
            if again and quote is not None:
                again = self._read_off(copyable, body, question) or self._read_off(
                    self._named_golds(plan, example, seen), body, question
                )
        if (quote is None or follow or again) and plan.searches < self.max_searches:
            if plan.searches == 0:
                query = question
            elif again and quote is not None:  # answer shown: search on (a missing gold, else the one holding it)
                query = again[0]
                plan.queried.update(t for t in example.gold_titles if base_title(t) == query)
            else:
                if not missing:
                    return self._answer(plan, answer, None, question)
                query = (copyable or missing)[0]
                plan.copyable_queries &= bool(copyable)
                plan.queried.update(t for t in missing if base_title(t) == query or t == query)
            plan.searches += 1
            return f"<think>I need to search.</think>\n<search>{query}</search>"
        return self._answer(plan, answer, quote, question)

    @staticmethod
    def _read_off(titles: list[str], body: str, question: str) -> list[str]:
        """The titles that the shown passages name and the question does not."""
        return [t for t in titles if mentions(body, t) and not mentions(question, t)]

    @staticmethod
    def _named_golds(plan: _Plan, example: QAExample, seen: str) -> list[str]:
        """Gold titles (without disambiguation) not yet queried that `seen` names, the one holding the answer first."""
        holds = [any(mentions(plan.shown.get(t, ""), a) for a in example.answers) for t in example.gold_titles]
        ordered = [t for t, h in zip(example.gold_titles, holds, strict=True) if h]
        ordered += [t for t, h in zip(example.gold_titles, holds, strict=True) if not h]
        return [base_title(t) for t in ordered if t not in plan.queried and mentions(seen, base_title(t))]

    def _answer(self, plan: _Plan, answer: str, quote: str | None, question: str) -> str:
        plan.grounded = quote is not None
        evidence = quote or " ".join(plan.shown.values())[: 40 * 8] or "I found nothing."
        return self._written_answer(evidence, answer, question)

    def _written_answer(self, evidence: str, answer: str, question: str) -> str:
        restated = f"<think>{question.strip()}</think>\n" if self.restate_question else ""
        if self.quote_words == 0:
            return f"{restated}<answer>{answer}</answer>"
        return f"{restated}<refine>{as_data(evidence) or 'I found nothing.'}</refine>\n<answer>{answer}</answer>"

    def _evidence(self, plan: _Plan, example: QAExample) -> str | None:
        """The quote the answer is read from, or None while the shown passages do not hold it."""
        if is_yes_no(example.answer):  # a comparison: quote the opening of each gold passage
            golds = [t for t in example.gold_titles if t in plan.shown]
            if not golds or (len(golds) < len(example.gold_titles) and plan.searches < self.max_searches):
                return None
            openings = " ".join(" ".join(plan.shown[t].split()[:12]) for t in golds)
            return f"{openings} So the answer is {example.answer}."
        for text in plan.shown.values():
            for answer in example.answers:
                quote = _quote(text, answer, self.quote_words)
                if quote is not None:
                    return quote
        return None


def shown_passages(obs: str) -> list[tuple[str, str]]:
    """(title, text as shown) of each passage of a search's results, in either observation format.

    Only the block between the first ``<information>`` and the last ``</information>`` is read (a question line may
    follow it), and a passage runs to the end of its line, so its own tags, ``</information>`` included, stay text.
    """
    start, end = obs.find("<information>"), obs.rfind("</information>")
    if start < 0 or end < start:
        return []
    return [m.groups() for m in _DOC.finditer(obs[start + len("<information>") : end])]


def demonstration_record(trajectory: Trajectory, tokenizer: Any, env: Any) -> dict[str, Any]:
    """One episode as a JSON-ready chat record.

    Format: `{"id", "index", "protocol", "reward", "f1", "grounded", "contexts": [{"role", "messages": [...]}]}`
    where each context's messages are `{"role": "assistant"|"observation", "content"}`: the assistant messages are the
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
        "grounded": bool(trajectory.info.get("oracle_grounded", True)),
        "contexts": contexts,
    }


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m agents.oracle", description="Write oracle demonstrations (SFT data).")
    parser.add_argument("--split", default="train", help="bundled split (hotpotqa: train, dev)")
    parser.add_argument("--dataset", default="hotpotqa", choices=DATASETS)
    parser.add_argument("--data-path", default=None, help="read the questions from this file instead of the split")
    parser.add_argument("--protocol", choices=("flat", "coda"), default="flat")
    parser.add_argument("--out", required=True, help="output file, JSON lines (its directories are created)")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32, help="episodes played at once")
    parser.add_argument("--quote-words", type=int, default=12, help="words of the evidence quote (0: no quote)")
    return parser


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the command line unusable, checked before the tokenizer loads or a retriever starts."""
    if args.data_path is None and args.split not in BUNDLED_SPLITS[args.dataset]:
        bundled = ", ".join(BUNDLED_SPLITS[args.dataset])
        return f"--split {args.split!r}: {args.dataset} has no bundled split of that name; bundled: {bundled}"
    if args.data_path is not None and not os.path.isfile(args.data_path):
        return f"--data-path {args.data_path!r}: no such file"
    if args.limit is not None and args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    if args.batch < 1:
        return f"--batch must be >= 1, got {args.batch}"
    if args.quote_words < 0:
        return f"--quote-words must be >= 0 (0: no quote), got {args.quote_words}"
    if not 0 <= args.seed < 2**32:
        return f"--seed must be in [0, 2**32) (NumPy's seeds), got {args.seed}"
    return output_problem("--out", args.out)


def main(argv: Sequence[str] | None = None) -> None:
    """Play the oracle over a split and write its demonstrations; bad input ends it in one line, exit status 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem is not None:
        parser.error(problem)

    import gymnasium as gym
    from tqdm.auto import tqdm

    import envs  # noqa: F401
    from agents.models import smollm2_tokenizer
    from envs.data import DataError

    env_kwargs = {
        "dataset": args.dataset,
        "split": args.split,
        "data_path": args.data_path,
        "protocol": args.protocol,
        "max_turns": 6,
        "max_planner_turns": 6,
        "max_executor_turns": 4,
    }
    try:  # the questions load here: a malformed data file names its line
        first = gym.make("RedCoda-HotpotQA-v0", **env_kwargs)
    except DataError as err:
        parser.error(str(err))
    tokenizer = smollm2_tokenizer()
    n = min(args.limit or first.unwrapped.num_examples, first.unwrapped.num_examples)
    envs_ = [first] + [gym.make("RedCoda-HotpotQA-v0", **env_kwargs) for _ in range(min(args.batch, n) - 1)]
    agent = OracleAgent(tokenizer, seed=args.seed, quote_words=args.quote_words)
    f1s = []
    bar = tqdm(total=n, desc="oracle", unit="q")
    with atomic_file(args.out) as partial, open(partial, "w", encoding="utf-8") as out, bar:  # no partial file left
        for lo in range(0, n, args.batch):
            indices = list(range(lo, min(lo + args.batch, n)))
            for trajectory in agent.rollout(envs_[: len(indices)], indices, seed=args.seed + lo):
                out.write(json.dumps(demonstration_record(trajectory, tokenizer, envs_[0]), ensure_ascii=False) + "\n")
                f1s.append(trajectory.info.get("f1", 0.0))
            bar.update(len(indices))
    print(f"wrote {len(f1s)} demonstrations to {args.out}; mean F1 {np.mean(f1s):.3f}")


if __name__ == "__main__":
    main()
