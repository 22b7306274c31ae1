"""QueryRewriteEnv: rewrite a question into a search query, rewarded by the recall of its gold paragraphs.

The DeepRetrieval task (Jiang et al. 2025, "DeepRetrieval: Hacking Real Search Engines and Retrievers with
LLMs via RL") as a one-step Gymnasium env: the observation is a question, the action a query, the reward
recall@k of the question's gold paragraphs under the env's retriever.

    import gymnasium as gym, envs
    env = gym.make("RedCoda-QueryRewrite-v0")
    obs, info = env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<query>Jake and the Fatman Joe Penny network</query>")
    info["recall_at_k"], info["mrr"], info["retrieved_ids"]

Own data: a query file of JSON lines ``{"query": str, "relevant_doc_ids": [str, ...]}`` (optional ``"id"``)
and a corpus file of JSON lines ``{"doc_id": str, "text": str}`` (optional ``"title"``; Search-R1's
``{"id", "contents"}`` rows are read too); the env builds its retriever over that corpus:

    env = gym.make("RedCoda-QueryRewrite-v0", data_path="queries.jsonl", corpus_path="corpus.jsonl")
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from envs.data import load_examples
from envs.pickling import BuiltInWorker
from envs.protocol import format_passages
from envs.rag_env import check_limits, question_index
from envs.reward_library import mrr, recall_at_k
from envs.spaces import UnicodeText
from retrievers.base import clean_query

ACTION_FORMATS = ("tag", "raw")
TAG_INSTRUCTIONS = (
    "Rewrite the question below as a search query that finds the documents needed to answer it. The search "
    "engine ranks documents by keyword overlap (BM25) unless told otherwise: name the entities, titles and "
    "distinctive words the documents would contain. You may think first inside <think> and </think>; then write "
    "only the query inside <query> and </query>, for example <query> Scott Derrickson nationality </query>."
)
RAW_INSTRUCTIONS = (
    "Rewrite the question below as a search query that finds the documents needed to answer it. The search "
    "engine ranks documents by keyword overlap (BM25) unless told otherwise: name the entities, titles and "
    "distinctive words the documents would contain. Reply with the query only."
)
_QUERY_TAG = re.compile(r"<(/?)query\s*>", re.IGNORECASE)


@dataclass(frozen=True)
class RewriteExample:
    """One question and the corpus documents that answer it."""

    id: str
    """Identifier of the question (the dataset's id, or the row number of a query file)."""
    question: str
    """The question (or original query) to rewrite."""
    gold_doc_ids: tuple[tuple[str, ...], ...]
    """The gold paragraphs: per paragraph, its doc ids (several when the corpus stores it more than once)."""


@functools.lru_cache(maxsize=8)
def load_corpus_file(path: str):
    """A corpus from JSON lines of ``{"doc_id", "text"}`` (optional ``"title"``) or Search-R1 ``{"id", "contents"}``.

    Cached per process, so every env over one file shares one `Corpus` (and so one index).
    """
    from retrievers.base import split_contents
    from retrievers.corpus import Corpus, open_text

    rows = []
    for line_no, line in enumerate(open_text(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            doc_id = str(row["doc_id"] if "doc_id" in row else row["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{line_no}: not a corpus row with 'doc_id' and 'text' ({err!r})") from err
        if "text" in row:
            title, text = str(row.get("title", "")), str(row["text"])
        elif "contents" in row:
            title, text = split_contents(str(row["contents"]), row.get("title"))
        else:
            raise ValueError(f"{path}:{line_no}: corpus row {doc_id!r} has no 'text'")
        rows.append((doc_id, title, text))
    if not rows:
        raise ValueError(f"corpus file {path} holds no rows")
    return Corpus.from_passages(rows, name=Path(path).name.split(".")[0])


def load_query_file(path: str | os.PathLike) -> tuple[RewriteExample, ...]:
    """Questions from JSON lines of ``{"query": str, "relevant_doc_ids": [str, ...]}`` (optional ``"id"``)."""
    from retrievers.corpus import open_text

    examples = []
    for line_no, line in enumerate(open_text(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            query, relevant = row["query"], row["relevant_doc_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{line_no}: not a row with 'query' and 'relevant_doc_ids' ({err!r})") from err
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"{path}:{line_no}: 'query' must be a non-empty string")
        if isinstance(relevant, str) or not relevant:
            raise ValueError(f"{path}:{line_no}: 'relevant_doc_ids' must be a non-empty list of doc ids")
        gold = tuple(dict.fromkeys((str(doc_id),) for doc_id in relevant))
        examples.append(RewriteExample(str(row.get("id", line_no - 1)), query, gold))
    if not examples:
        raise ValueError(f"query file {path} holds no rows")
    return tuple(examples)


def examples_from_titles(qa_examples: Sequence, corpus) -> tuple[RewriteExample, ...]:
    """RewriteExamples from QA rows whose gold paragraphs are titles (HotpotQA's supporting facts).

    Each gold title maps to every corpus doc id with that exact title.

    Raises:
        ValueError: a gold title is not in the corpus (recall could never reach 1).
    """
    ids_by_title: dict[str, list[str]] = defaultdict(list)
    for doc_id, title in zip(corpus.doc_ids, corpus.titles, strict=True):
        ids_by_title[title].append(doc_id)
    missing = sorted({t for ex in qa_examples for t in ex.gold_titles if t not in ids_by_title})
    if missing:
        raise ValueError(
            f"{len(missing)} gold titles are not titles of corpus {corpus.name!r} (e.g. {missing[:3]}); "
            "use the corpus the questions were built on, or a query file with relevant_doc_ids"
        )
    out = []
    for ex in qa_examples:
        if not ex.gold_titles:
            raise ValueError(f"question {ex.id} has no supporting facts, so it has no gold paragraphs")
        out.append(RewriteExample(ex.id, ex.question, tuple(tuple(ids_by_title[t]) for t in ex.gold_titles)))
    return tuple(out)


def parse_query(
    action: str, action_format: str = "tag", max_chars: int = 16384, max_query_chars: int = 1024
) -> tuple[str | None, str | None]:
    """The query in an action, or why there is none.

    Args:
        action: the agent's text.
        action_format: "tag" (the query is the content of exactly one ``<query>...</query>``; text outside
            it, such as ``<think>`` blocks, is ignored) or "raw" (the whole stripped action is the query).
        max_chars: longer actions are invalid.
        max_query_chars: longer queries are invalid.

    Returns:
        (query, None) when valid, else (None, error message).
    """
    if len(action) > max_chars:
        return None, f"action is {len(action)} characters, over the limit of {max_chars}"
    if action_format == "raw":
        query = action.strip()
    else:
        tags = [m.group(1) for m in _QUERY_TAG.finditer(action)]
        if tags != ["", "/"]:
            found = f"{tags.count('')} <query> and {tags.count('/')} </query>"
            return None, f"write exactly one <query>...</query> (found {found})"
        opening, closing = list(_QUERY_TAG.finditer(action))
        query = action[opening.end() : closing.start()].strip()
    if not query:
        return None, "empty query"
    if len(query) > max_query_chars:
        return None, f"query is {len(query)} characters, over the limit of {max_query_chars}"
    return query, None


class QueryRewriteEnv(BuiltInWorker, gym.Env[str, str]):
    """Rewrite a question as a search query; the reward is the recall@k of its gold paragraphs.

    ## Description
    A one-step task (DeepRetrieval, Jiang et al. 2025). Each episode is one question: the bundled HotpotQA
    rows by default, whose gold paragraphs are the paragraphs of their supporting facts (gold titles mapped to
    the doc ids of the bundled 17,645-paragraph corpus that carry those titles), or the rows of a query file
    with their ``relevant_doc_ids``. The agent writes one query; the env searches its retriever (BM25 over the
    corpus by default) for the top ``k`` documents and scores them.

    ## Action Space
    ``UnicodeText(1_048_576)``: any Unicode string. With ``action_format="tag"`` (default) the query is the
    content of exactly one ``<query>...</query>`` block, and text outside it (``<think>`` reasoning) is
    ignored: a policy model can reason before it commits, and a missing tag is a detectable format error.
    With ``action_format="raw"`` the whole stripped action is the query (for prompted or non-LLM agents).
    Mistakes (no or several ``<query>`` blocks, an empty query, a query over ``max_query_chars`` or an action
    over ``max_action_chars``) end the episode with reward 0, an observation that says what was wrong, and
    ``info["invalid_action"] = True``; the retriever is not called.

    ## Observation Space
    ``UnicodeText(1_048_576)``. The first observation is the instructions and ``Question: ...`` (also in
    ``info`` as ``system_prompt`` and ``user_message`` for chat templates). The last observation holds the
    retrieved documents (``<information>Doc 1 (Title: "..") ...</information>``) or the error.

    ## Rewards
    recall@k: the share of gold paragraphs among the top ``k`` retrieved documents (a paragraph stored under
    several doc ids counts once), in [0, 1]; 0 for an invalid action or a failed search. ``info`` on the step
    holds ``recall_at_k``, ``mrr`` (reciprocal rank of the first gold paragraph within the top k),
    ``retrieved_ids``, ``gold_doc_ids``, ``query``, ``k``, ``invalid_action`` (and ``error`` when invalid,
    ``retrieval_error`` when the retriever failed), ``num_searches`` (1 when the search returned results) and
    ``retrieval_errors`` (1 when the retriever failed: a dead or hung server). Like RAGEnv's, every info holds
    ``role`` ("agent") and ``new_context`` (True on reset), the keys a context-routing agent
    (`agents.search_agents`) reads.

    ## Episode End
    Terminated after the one action. Never truncated.

    ## Arguments
    | argument | default | meaning |
    |---|---|---|
    | dataset | "hotpotqa" | bundled questions: hotpotqa only (others: pass data_path and corpus_path) |
    | split | "train" | bundled split (hotpotqa: train or dev) |
    | data_path | None | a query file (JSON lines of query, relevant_doc_ids) instead of the bundled questions |
    | corpus_path | None | a corpus file (JSON lines of doc_id, text); needed with data_path unless retriever is given |
    | retriever | None | None (BM25), a `retrievers.factory` kind ("bm25", "dense", ...), a URL, or a Retriever |
    | k | 5 | documents retrieved and scored |
    | action_format | "tag" | "tag" (query inside <query>...</query>) or "raw" (the action is the query) |
    | instructions | None | the task instructions; None: the default for the action format |
    | max_query_chars | 1024 | longer queries are invalid |
    | max_action_chars | 16384 | longer actions are invalid |
    | max_passage_words | 80 | words shown of each retrieved document |
    | render_mode | None | None or "ansi" (the episode transcript) |
    | retriever_timeout | 30.0 | server URL only: seconds allowed for each request |
    | retriever_retries | 2 | server URL only: retries of a failed request (a search waits <= timeout x (retries+1)) |

    ## Version History
    * v0: initial release.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        dataset: str = "hotpotqa",
        split: str = "train",
        data_path: str | os.PathLike | None = None,
        corpus_path: str | os.PathLike | None = None,
        retriever: Any = None,
        k: int = 5,
        action_format: str = "tag",
        instructions: str | None = None,
        max_query_chars: int = 1024,
        max_action_chars: int = 16384,
        max_passage_words: int = 80,
        render_mode: str | None = None,
        retriever_timeout: float = 30.0,
        retriever_retries: int = 2,
    ) -> None:
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {ACTION_FORMATS}, got {action_format!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        check_limits(
            retriever_timeout,
            retriever_retries,
            k=k,
            max_query_chars=max_query_chars,
            max_action_chars=max_action_chars,
            max_passage_words=max_passage_words,
        )
        self.k, self.action_format = k, action_format
        self.max_query_chars, self.max_action_chars = max_query_chars, max_action_chars
        self.max_passage_words = max_passage_words
        self.render_mode = render_mode
        self.instructions = instructions or (TAG_INSTRUCTIONS if action_format == "tag" else RAW_INSTRUCTIONS)
        corpus = load_corpus_file(str(Path(corpus_path).resolve())) if corpus_path is not None else None
        if data_path is not None:
            self.examples = load_query_file(data_path)
            if corpus is not None:
                unknown = sorted({i for ex in self.examples for g in ex.gold_doc_ids for i in g} - set(corpus.doc_ids))
                if unknown:
                    raise ValueError(
                        f"{len(unknown)} relevant_doc_ids of {data_path} are not in {corpus_path}: {unknown[:5]}"
                    )
            elif retriever is None or (
                isinstance(retriever, str) and not retriever.startswith(("http://", "https://"))
            ):
                raise ValueError(
                    "data_path needs corpus_path=CORPUS.jsonl (rows of doc_id, text) to build a retriever on"
                )
        else:
            if dataset != "hotpotqa":
                # MuSiQue's and 2Wiki's pooled corpora repeat titles over different paragraphs (and 2Wiki's
                # supporting facts name titles missing from its rows), so titles cannot name their gold paragraphs.
                raise ValueError(
                    f"dataset {dataset!r} has no gold paragraph ids; use dataset='hotpotqa', or a query file "
                    "data_path=QUERIES.jsonl (rows of query, relevant_doc_ids) with corpus_path=CORPUS.jsonl"
                )
            from envs.rag_env import dataset_corpus

            corpus = corpus or dataset_corpus(dataset)
            self.examples = examples_from_titles(load_examples(dataset, split), corpus)
        self.dataset, self.split = dataset, split
        self.retriever = self._resolve_retriever(retriever, corpus, retriever_timeout, retriever_retries)
        self.action_space = UnicodeText(1 << 20)
        self.observation_space = UnicodeText(1 << 20)
        self._example: RewriteExample | None = None
        self._index = -1
        self._done = True
        self._transcript: list[tuple[str, str]] = []

    @staticmethod
    def _resolve_retriever(retriever: Any, corpus, timeout: float, retries: int) -> Any:
        if retriever is None:
            retriever = "bm25"
        if isinstance(retriever, str):
            if retriever.startswith(("http://", "https://")):
                from retrievers.http import HTTPRetriever

                return HTTPRetriever(retriever, timeout=timeout, retries=retries)
            from retrievers.factory import make_retriever

            return make_retriever(retriever, corpus)
        if not (callable(getattr(retriever, "search", None)) and callable(getattr(retriever, "batch_search", None))):
            raise TypeError(f"retriever must implement search() and batch_search(), got {type(retriever).__name__}")
        return retriever

    @property
    def num_examples(self) -> int:
        """Number of questions."""
        return len(self.examples)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on `options["index"]`, or on a question drawn with `self.np_random`."""
        super().reset(seed=seed)
        index = question_index(options, len(self.examples))
        if index is None:
            index = int(self.np_random.integers(len(self.examples)))
        self._index, self._example, self._done = index, self.examples[index], False
        user = f"Question: {self._example.question}"
        obs = f"{self.instructions}\n\n{user}\n"
        self._transcript = [("env", obs)]
        info = {
            "index": self._index,
            "id": self._example.id,
            "question": self._example.question,
            "system_prompt": self.instructions,
            "user_message": user,
            "role": "agent",
            "new_context": True,
        }
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._example is None or self._done:
            raise ResetNeeded("call reset() before step(); every episode is one step")
        if not isinstance(action, str):
            raise TypeError(f"an action is a str, got {type(action).__name__}")
        self._done = True
        self._transcript.append(("agent", action))
        example = self._example
        query, error = parse_query(action, self.action_format, self.max_action_chars, self.max_query_chars)
        info: dict[str, Any] = {
            "index": self._index,
            "id": example.id,
            "query": query,
            "invalid_action": error is not None,
            "k": self.k,
            "retrieved_ids": [],
            "gold_doc_ids": [list(group) for group in example.gold_doc_ids],
            "recall_at_k": 0.0,
            "mrr": 0.0,
            "num_searches": 0,
            "invalid_actions": 0,
            "num_actions": 1,
            "retrieval_errors": 0,
            "role": "agent",
            "new_context": False,
        }
        if error is not None:
            info["error"], info["invalid_actions"] = error, 1
            obs = f"\nInvalid action: {error}.\n"
        else:
            try:
                passages = self.retriever.search(clean_query(query), self.k)[: self.k]
            except Exception as err:  # a dead server must not crash a batch of episodes; the trainer counts these
                info["retrieval_error"] = f"{type(err).__name__}: {err}"
                info["retrieval_errors"] = 1
                passages = None
                obs = f"\n<information>Search failed ({type(err).__name__}).</information>\n"
            if passages is not None:
                info["num_searches"] = 1
                ids = [p.doc_id for p in passages]
                info["retrieved_ids"] = ids
                info["recall_at_k"] = recall_at_k(ids, example.gold_doc_ids, self.k)
                info["mrr"] = mrr(ids, example.gold_doc_ids, self.k)
                obs = "\n" + format_passages(passages, self.max_passage_words) + "\n"
        self._transcript.append(("env", obs))
        return obs, float(info["recall_at_k"]), True, False, info

    def render(self) -> str | None:
        """The episode transcript (render_mode="ansi"); None otherwise."""
        if self.render_mode != "ansi" or not self._transcript:
            return None
        return "".join(f"[{who}] {text.strip()}\n" for who, text in self._transcript)
