"""RAGEnv: multi-hop question answering with a search engine, as a Gymnasium environment.

`RAGEnv`'s docstring is its reference (protocols, spaces, rewards, arguments) and holds a scripted episode. A
retriever named by a string (a kind or a server URL) comes from `retrievers.factory`, shared by every env of the
process.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from envs import protocol
from envs.data import QAExample, bundled_path, load_examples, pooled_passages
from envs.pickling import BuiltInWorker
from envs.protocol import INSTRUCTION_STYLES, OBSERVATION_FORMATS
from envs.rewards import (
    RewardWeights,
    cover_exact_match,
    episode_reward,
    exact_match,
    f1_score,
    format_score,
    normalize_answer,
    refine_score,
    title_recall,
)
from envs.spaces import UnicodeText
from retrievers.base import clean_query
from retrievers.factory import make_retriever, server_retriever

MAX_ERROR_CHARS = 1000
"""Longest error text an observation (and ``info["error"]``) carries; longer ones are cut with "..."."""


def question_index(options: dict[str, Any] | None, num_examples: int) -> int | None:
    """The question an env's ``reset(options={"index": i})`` asks for, checked; None when it names none.

    Python and NumPy integers are accepted; bools, floats and strings are not (``True`` is not question 1).

    Raises:
        TypeError: the index is not an integer.
        IndexError: the index is outside ``[0, num_examples)``.
    """
    index = (options or {}).get("index")
    if index is None:
        return None
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError(f'options["index"] must be an int, got {type(index).__name__} {index!r}')
    if not 0 <= int(index) < num_examples:
        raise IndexError(f"index {int(index)} out of range for {num_examples} questions")
    return int(index)


LIMIT_CAPS = {
    "top_k": 1000,
    "max_passage_words": 100_000,
    "max_turns": 10_000,
    "max_planner_turns": 10_000,
    "max_executor_turns": 10_000,
}
"""The largest value each count setting takes (others: 2**30): beyond it a search asks a retriever for more passages
than any serves, or an episode outlives any context."""


def check_limits(retriever_timeout: float, retriever_retries: int, **limits: int) -> None:
    """Refuse an env's settings that cannot work: a count that is not a whole number in [1, its cap], a timeout
    that is not a finite number > 0 (NaN and inf included), retries that are not a whole number in [0, 100].

    Raises:
        ValueError: naming the first offending argument.
    """
    for name, value in limits.items():
        cap = LIMIT_CAPS.get(name, 1 << 30)
        if not _whole(value) or not 1 <= value <= cap:
            raise ValueError(f"{name} must be a whole number in [1, {cap}], got {value!r}")
    if not (isinstance(retriever_timeout, numbers.Real) and 0 < retriever_timeout < float("inf")):
        raise ValueError(f"retriever_timeout must be a finite number of seconds > 0, got {retriever_timeout!r}")
    if not _whole(retriever_retries) or not 0 <= retriever_retries <= 100:
        raise ValueError(f"retriever_retries must be a whole number in [0, 100], got {retriever_retries!r}")


def _whole(value: Any) -> bool:
    """An integer (numpy's too), not a bool; a float, even 2.0 or NaN, is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _excerpt(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.lru_cache(maxsize=8)
def dataset_corpus(dataset: str, corpus_path: str | None = None):
    """The closed corpus of a dataset: HotpotQA's bundled corpus (or `corpus_path`), or the pooled
    paragraphs of all bundled questions for MuSiQue and 2Wiki. Cached per process.

    Bamboogle ships no paragraphs (its questions were written against web search), so it searches the bundled
    HotpotQA Wikipedia corpus: an env that runs offline, where few answers are found; a server over a full
    Wikipedia (``retriever=URL``) is its real setting.
    """
    from retrievers.corpus import Corpus

    if corpus_path is not None:
        return Corpus.from_jsonl(corpus_path)
    if dataset in ("hotpotqa", "bamboogle"):
        return Corpus.from_jsonl(bundled_path("hotpotqa", "corpus"), name="hotpotqa")
    if dataset in ("musique", "2wiki"):
        return Corpus.from_passages(pooled_passages(load_examples(dataset, "dev"), dataset), name=dataset)
    raise ValueError(
        f"dataset {dataset!r} ships no corpus: pass retriever='http://127.0.0.1:8000' (start one with "
        "`python -m retrievers.server`), a Retriever object, or corpus_path=FILE.jsonl"
    )


@dataclass
class _Episode:
    """Everything the env remembers about the running episode."""

    index: int
    example: QAExample
    role: str
    distractor: Any = None
    actions: int = 0
    turns: int = 0
    planner_turns: int = 0
    executor_turns: int = 0
    num_searches: int = 0
    num_tasks: int = 0
    invalid_actions: int = 0
    retrieval_errors: int = 0
    last_retrieval_error: str | None = None
    used_tags: set[str] = field(default_factory=set)
    malformed_tags: set[str] = field(default_factory=set)
    refines: list[str] = field(default_factory=list)
    gold_titles: frozenset[str] = frozenset()  # the question's, stripped and lower-cased as retrieved ones are compared
    retrieved_titles: set[str] = field(default_factory=set)
    queries: set[str] = field(default_factory=set)
    """Every query the episode searched, normalized (a repeat is flagged in the search step's info)."""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    asked: str = ""
    """The open context's question (an executor's: its task), as its user message shows it."""
    done: bool = False


class RAGEnv(BuiltInWorker, gym.Env[str, str]):
    """Answer multi-hop questions by searching a corpus, in text.

    ## Description
    Each episode is one question (HotpotQA by default). The agent writes text actions in a tag protocol
    and the env answers with text observations. Two protocols share this class:

    * ``flat`` (Search-R1 / AutoRefine): the agent may think in ``<think>``, summarize in ``<refine>``,
      and calls one tool per turn: ``<search>query</search>`` returns ``<information>Doc 1 (Title: "..")
      ...</information>``; ``<answer>text</answer>`` ends the episode.
    * ``coda`` (context-decoupled Planner/Executor): the planner calls ``<task>sub-question</task>``, which
      opens an executor sub-episode in a fresh context (``info["new_context"]``) holding only its task;
      the executor searches, refines and ends with ``<answer>``, whose text returns to the planner as
      ``<result>..</result>``. Raw documents never reach the planner. The planner's ``<answer>`` ends the
      episode. ``info["role"]`` says whose turn is next.

    ## Action Space
    ``UnicodeText(1_048_576)``: any Unicode string. Mistakes (no tool call, two tool calls, unclosed or
    nested tags, empty arguments, over-long actions, env-only tags) are answered with an observation that
    says what was wrong (at most ``MAX_ERROR_CHARS`` characters of it, whatever the action's length) and
    ``info["invalid_action"] = True``; they use up a turn. Lone UTF-16 surrogates in a query are replaced
    before the search (as the in-memory BM25 ignores them), so they never fail a search.

    ## Observation Space
    ``UnicodeText(1_048_576)``. Observations are incremental: what the env says this turn. The first
    observation of a context is the role's instructions and the question (or task); ``info`` also has them
    as ``system_prompt`` and ``user_message`` for chat templates. An observation longer than the space admits
    (whole ``search_r1`` passages of a corpus of huge paragraphs) is cut to fit, ending with a line that says so,
    and ``info["observation_cut"]`` holds its length before the cut.

    ## Rewards
    0 on every step but the last. On the last: ``6*F1 - 3 + 0.1*format + 0.1*refine`` (weights in
    ``reward_weights``): F1 of the official HotpotQA script against the gold answers (0 without an answer),
    the graduated format score (0.25 per protocol tag used and never malformed, capped at 1), and the share
    of ``<refine>`` blocks containing the gold answer. Maximum 3.2. The terminal ``info`` holds every
    component: em, f1, cover_em, format, refine, num_searches (searches that returned results), recall
    (gold titles among retrieved passages), invalid_actions, num_actions, retrieval_errors (searches the
    retriever failed: a dead or hung server; the agent saw "Search failed") with, when there were any,
    retrieval_error (the last failure), answered, answer, gold_answers; `envs.episode_metrics` reads the
    numbers out of it.

    ## Episode End
    Terminated when the agent (flat) or the planner (coda) answers. Truncated when the flat agent used
    ``max_turns`` turns, or the planner ``max_planner_turns`` turns, without answering. An executor that
    uses ``max_executor_turns`` turns without answering returns "no answer" to the planner.

    ## Arguments
    | argument | default | meaning |
    |---|---|---|
    | dataset | "hotpotqa" | hotpotqa, musique, 2wiki or bamboogle |
    | split | "train" | bundled split (hotpotqa train/dev, musique and 2wiki dev, bamboogle test) |
    | protocol | "flat" | flat or coda |
    | retriever | None | None (BM25; pure Python without `lucene`), a `retrievers.factory` kind, a URL, a Retriever |
    | corpus | "pooled" | pooled (search the whole corpus) or distractor (only the question's own paragraphs) |
    | data_path | None | an official data file to use instead of the bundled split |
    | corpus_path | None | a Search-R1-format corpus file instead of the bundled one (bamboogle has none: HotpotQA's) |
    | top_k | 3 | passages per search |
    | max_passage_words | 80 | words kept of each passage |
    | max_turns | 4 | flat: turns (actions) per episode |
    | max_planner_turns | 4 | coda: planner turns per episode |
    | max_executor_turns | 3 | coda: executor turns per task |
    | max_action_chars | 16384 | longer actions are invalid (>= 1) |
    | query_cache | 4096 | LRU cache of query results shared by all envs on a named retriever or URL (0: off) |
    | reward_weights | RewardWeights() | weights of the episode reward (or a dict of them, e.g. {"recall": 1.0}) |
    | render_mode | None | None or "ansi" (the episode transcript) |
    | retriever_timeout | 30.0 | server URL only: seconds allowed for each request |
    | retriever_retries | 2 | server URL only: retries of a failed request (a search waits <= timeout x (retries+1)) |
    | instructions | "search-r1" | system prompts: "search-r1" (Search-R1's + <refine>) or "short" (half as long) |
    | observation_format | "redcoda" | "redcoda" (cut to max_passage_words) or "search_r1" (Search-R1's format) |
    | question_after_results | False | each search's results end with the context's question line again |
    | autoreset_same_question | False | a reset that names no question re-asks the last one named by index |

    An agent that cannot go on (its context is full) ends the running episode with
    ``env.unwrapped.end_episode(reason)``: scored as unanswered, it returns the reward and terminal info a
    truncating `step` would, with ``info["ended_by"] = reason``.

    ## Vector Envs and Autoreset
    ``gym.make_vec(id, num_envs=G, vectorization_mode="sync")`` steps G envs in lockstep; ``reset(options={"index":
    i})`` puts all of them on question i (a GRPO group). Gymnasium's vector envs reset a finished env by
    themselves (autoreset: by default on the ``step`` after the one that ended it) with ``reset()`` and no
    options, so by default that env moves to a question drawn with its ``np_random``, not its group's. With
    ``autoreset_same_question=True`` a reset that names no index asks the last question that a reset named (a
    reset naming one still moves the env), so every episode of the vector env stays on its group's question
    until the next ``reset(options={"index": j})``::

        vec = gym.make_vec("RedCoda-HotpotQA-v0", num_envs=4, vectorization_mode="sync", autoreset_same_question=True)
        vec.reset(options={"index": 5})  # every autoreset re-asks question 5

    ## Example
    A scripted episode on the bundled data (BM25 over the 17,645-paragraph corpus):

    >>> import gymnasium as gym
    >>> import envs
    >>> env = gym.make("RedCoda-HotpotQA-v0")
    >>> obs, info = env.reset(seed=0, options={"index": 3})
    >>> info["question"]
    'Qazi is a Kashmiri singer that won "Fame Gurukul" along with a singer born where?'
    >>> obs, reward, terminated, truncated, info = env.step("<think>Who is Qazi?</think><search>Qazi Touqeer</search>")
    >>> print(obs.strip()[:80])
    <information>Doc 1 (Title: "Qazi Touqeer") Qazi (Kashmiri: قاضی توقیر , born 2 J
    >>> reward, terminated, info["role"]
    (0.0, False, 'agent')
    >>> obs, reward, terminated, truncated, info = env.step("<answer>Kolkata</answer>")
    >>> reward, terminated, info["f1"], info["format"], info["recall"], info["num_searches"]
    (3.075, True, 1.0, 0.75, 1.0, 1)

    ## Version History
    * v0: initial release. Changed since under the same id; none changes the reward of an action sequence the
      release accepted, but the one marked (scores):
      - coda: an executor out of turns returns only its ``<result>``; its last search results no longer reach
        the planner's context.
      - ``retriever="bm25-matrix"`` and ``"bm25-python"`` (batched Lucene ranking, BM25 without a JVM); a
        shared query cache in front of named retrievers.
      - ``reset(options={"index": i})`` takes NumPy integers and refuses bools, floats and strings; error
        observations capped at 1,000 characters; lone UTF-16 surrogates replaced before searching; a failed
        search is an observation counted in ``retrieval_errors``, apart from ``num_searches``;
        ``retriever_timeout`` and ``retriever_retries`` arguments.
      - ``instructions="short"`` and ``question_after_results`` options (off by default).
      - (scores) a tool argument without a letter or digit (``<answer>...</answer>``) is an invalid action that
        says so, instead of an answer scored F1 0.
      - a reward weight on evidence recall (``RewardWeights.recall``, 0 by default); counts, timeouts, retries
        and reward weights that are NaN, infinite, fractional or out of range raise at construction.
      - every registered id makes with no arguments (Bamboogle searches the bundled HotpotQA corpus).
      - a search step's ``info`` holds the titles it returned, how many gold titles no earlier search of the
        episode returned, and whether its query repeated an earlier one.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        dataset: str = "hotpotqa",
        split: str = "train",
        protocol: str = "flat",
        retriever: Any = None,
        corpus: str = "pooled",
        data_path: str | None = None,
        corpus_path: str | None = None,
        top_k: int = 3,
        max_passage_words: int = 80,
        max_turns: int = 4,
        max_planner_turns: int = 4,
        max_executor_turns: int = 3,
        max_action_chars: int = 16384,
        query_cache: int = 4096,
        reward_weights: RewardWeights | Mapping[str, float] = RewardWeights(),
        render_mode: str | None = None,
        retriever_timeout: float = 30.0,
        retriever_retries: int = 2,
        instructions: str = "search-r1",
        observation_format: str = "redcoda",
        question_after_results: bool = False,
        autoreset_same_question: bool = False,
    ) -> None:
        if protocol not in ("flat", "coda"):
            raise ValueError(f"protocol must be 'flat' or 'coda', got {protocol!r}")
        if corpus not in ("pooled", "distractor"):
            raise ValueError(f"corpus must be 'pooled' or 'distractor', got {corpus!r}")
        if instructions not in INSTRUCTION_STYLES:
            raise ValueError(f"instructions must be one of {sorted(INSTRUCTION_STYLES)}, got {instructions!r}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(f"observation_format must be one of {OBSERVATION_FORMATS}, got {observation_format!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        check_limits(
            retriever_timeout,
            retriever_retries,
            top_k=top_k,
            max_passage_words=max_passage_words,
            max_turns=max_turns,
            max_planner_turns=max_planner_turns,
            max_executor_turns=max_executor_turns,
            max_action_chars=max_action_chars,
        )
        self.retriever_timeout, self.retriever_retries = retriever_timeout, retriever_retries
        self.examples = load_examples(dataset, split, data_path)
        self.data_file = str(data_path) if data_path is not None else str(bundled_path(dataset, split))
        """The file the questions come from (the bundled split's, or data_path)."""
        self.dataset, self.split, self.protocol, self.corpus_setting = dataset, split, protocol, corpus
        self.top_k, self.max_passage_words = top_k, max_passage_words
        self.max_turns, self.max_planner_turns, self.max_executor_turns = (
            max_turns,
            max_planner_turns,
            max_executor_turns,
        )
        self.max_action_chars = max_action_chars
        self.instructions = INSTRUCTION_STYLES[instructions]
        self.observation_format = observation_format
        self.question_after_results = bool(question_after_results)
        """Repeat the question (an executor's task) after each search's results: the answer is then written right
        after the words that say what is asked, not a block of passages away from them, for no generated token."""
        self.autoreset_same_question = bool(autoreset_same_question)
        """Whether a reset that names no question re-asks the last question a reset named."""
        self._named_index: int | None = None
        if not isinstance(reward_weights, RewardWeights):  # a dict: JSON-ready run configs pass the weights so
            reward_weights = RewardWeights(**reward_weights)
        self.reward_weights = reward_weights
        self.render_mode = render_mode
        self.query_cache = query_cache
        self.retriever = self._resolve_retriever(retriever, corpus_path)
        self.action_space = UnicodeText(1 << 20)
        self.observation_space = UnicodeText(1 << 20)
        self._episode: _Episode | None = None

    def _resolve_retriever(self, retriever: Any, corpus_path: str | None) -> Any:
        if self.corpus_setting == "distractor":
            if retriever is not None:
                raise ValueError("corpus='distractor' searches each question's own paragraphs; do not pass a retriever")
            if not self.examples[0].context:
                raise ValueError(f"{self.dataset} rows carry no paragraphs, so corpus='distractor' is impossible")
            return None
        if retriever is None:
            retriever = "bm25"
        if isinstance(retriever, str):
            if retriever.startswith(("http://", "https://")):
                return server_retriever(retriever, self.retriever_timeout, self.retriever_retries, self.query_cache)
            return make_retriever(retriever, dataset_corpus(self.dataset, corpus_path), self.query_cache)
        if not (callable(getattr(retriever, "search", None)) and callable(getattr(retriever, "batch_search", None))):
            raise TypeError(f"retriever must implement search() and batch_search(), got {type(retriever).__name__}")
        return retriever

    @property
    def num_examples(self) -> int:
        """Number of questions in the split."""
        return len(self.examples)

    @property
    def first_role(self) -> str:
        """The role that acts first: agent (flat) or planner (coda)."""
        return "agent" if self.protocol == "flat" else "planner"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on `options["index"]`, or on a question drawn with `self.np_random` (with
        `autoreset_same_question`, on the last question a reset named, once one has)."""
        super().reset(seed=seed)
        index = question_index(options, len(self.examples))
        if index is not None:
            self._named_index = index
        elif self.autoreset_same_question and self._named_index is not None:
            index = self._named_index
        else:
            index = int(self.np_random.integers(len(self.examples)))
        example = self.examples[index]
        gold = frozenset(t.strip().lower() for t in example.gold_titles)
        episode = _Episode(index=index, example=example, role=self.first_role, gold_titles=gold)
        if self.corpus_setting == "distractor":
            from retrievers.inmemory import InMemoryBM25

            own = [(f"{example.id}-{i}", title, text) for i, (title, text) in enumerate(example.paragraphs)]
            episode.distractor = InMemoryBM25(own)
        self._episode = episode
        obs, info = self._open_context(episode.role, example.question)
        info.update(index=index, question=example.question, id=example.id)
        return self._fit(obs, info), info

    def _fit(self, obs: str, info: dict[str, Any]) -> str:
        """`obs`, cut to the observation space's length with a closing note when longer (its length in `info`)."""
        bound = self.observation_space.max_length
        if len(obs) <= bound:
            return obs
        note = f"\n[observation cut from {len(obs)} to {bound} characters]\n"
        info["observation_cut"] = len(obs)
        return obs[: bound - len(note)] + note

    def _open_context(self, role: str, text: str) -> tuple[str, dict[str, Any]]:
        system, user = self.instructions[role], protocol.user_message(role, text)
        self._episode.asked = user
        obs = f"{system}\n\n{user}\n"
        self._episode.transcript.append(("env", obs))
        return obs, {"role": role, "new_context": True, "system_prompt": system, "user_message": user}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Act for the role whose turn it is: parse the action, run its tool, and score the episode if it ended.

        Args:
            action: The model's text for this turn (see the class docstring for the protocols).

        Returns:
            ``(obs, reward, terminated, truncated, info)``: the env's reply this turn (search results, an
            executor's fresh context, a ``<result>``, or what was wrong with the action); the episode reward on
            its last step, else 0; terminated when the agent or planner answered, truncated when a turn limit
            ended it; ``info["role"]`` (whose turn is next), ``info["new_context"]``, ``info["invalid_action"]``,
            and on the last step every reward component (see Rewards).

        Raises:
            ResetNeeded: No episode is running.
            TypeError: The action is not a str.
        """
        episode = self._episode
        if episode is None:
            raise ResetNeeded("call reset() before step()")
        if episode.done:
            raise ResetNeeded("the episode has ended; call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"an action is a str, got {type(action).__name__}")
        role = episode.role
        episode.actions += 1
        episode.transcript.append((role, action))
        parsed = protocol.parse_action(action, role, max_chars=self.max_action_chars)
        episode.used_tags |= parsed.used_tags
        episode.malformed_tags |= parsed.malformed_tags
        episode.refines.extend(parsed.refines)
        info: dict[str, Any] = {"invalid_action": not parsed.valid, "acted_role": role}
        obs, new_context, answer = self._run_tool(parsed, role, info)
        obs = self._fit(self._count_turn(role, obs, info), info)

        terminated = answer is not None
        truncated = not terminated and (
            (role == "agent" and episode.turns >= self.max_turns)
            or (episode.role == "planner" and episode.planner_turns >= self.max_planner_turns)
        )
        reward = 0.0
        if terminated or truncated:
            episode.done = True
            reward = self._finish(answer, info)
        if not new_context:
            episode.transcript.append(("env", obs))
        info.setdefault("role", episode.role)
        info.setdefault("new_context", new_context)
        return obs, reward, terminated, truncated, info

    def _run_tool(self, parsed: protocol.ParsedAction, role: str, info: dict[str, Any]) -> tuple[str, bool, str | None]:
        """Carry out `role`'s parsed action: ``(obs, whether it opened a new context, the final answer or None)``."""
        episode = self._episode
        answer: str | None = None
        obs, new_context = "", False
        if not parsed.valid:
            episode.invalid_actions += 1
            info["error"] = _excerpt(parsed.error)
            obs = f"\nInvalid action: {info['error']}.\n"
        elif parsed.tool == "search":
            obs = "\n\n" + self._search(parsed.argument, info) + "\n\n"
            if self.question_after_results:
                obs += episode.asked + "\n\n"
        elif parsed.tool == "task":
            episode.num_tasks += 1
            episode.role, episode.executor_turns = "executor", 0
            obs, context_info = self._open_context("executor", parsed.argument)
            info.update(context_info, task=parsed.argument)
            new_context = True
        elif role == "executor":  # its <answer> goes back to the planner
            obs = f"\n<result>{parsed.argument}</result>\n"
            episode.role = "planner"
            info["sub_answer"] = parsed.argument
        else:
            answer = parsed.argument
        return obs, new_context, answer

    def _count_turn(self, role: str, obs: str, info: dict[str, Any]) -> str:
        """Count the turn `role` just took; an executor out of turns hands control back (its reply replaces `obs`)."""
        episode = self._episode
        if role == "agent":
            episode.turns += 1
        elif role == "planner":
            episode.planner_turns += 1
        elif role == "executor" and episode.role == "executor":
            episode.executor_turns += 1
            if episode.executor_turns >= self.max_executor_turns:
                # control returns to the planner, whose context never holds raw documents: the executor's
                # last search results go with its closed context, only the <result> is observed
                obs = f"\n<result>no answer: the worker used its {self.max_executor_turns} turns</result>\n"
                episode.role = "planner"
                info["executor_truncated"] = True
        return obs

    def search_request(self, action: str) -> tuple[Any, str, int] | None:
        """The search `step(action)` would send now, as ``(retriever, query, k)``; None when it would send none.

        Reads the action without acting on it (the episode is unchanged), so whoever steps many envs at once can
        send their searches to a shared retriever in one batch first (`envs.batching.prefetch_searches`).
        """
        episode = self._episode
        if episode is None or episode.done or not isinstance(action, str) or episode.distractor is not None:
            return None
        parsed = protocol.parse_action(action, episode.role, max_chars=self.max_action_chars)
        if not parsed.valid or parsed.tool != "search":
            return None
        return self.retriever, clean_query(parsed.argument), self.top_k

    def _search(self, query: str, info: dict[str, Any]) -> str:
        episode = self._episode
        retriever = episode.distractor or self.retriever
        try:
            passages = retriever.search(clean_query(query), self.top_k)
        except Exception as err:  # a dead server must not crash a batch of episodes; the trainer counts these
            episode.retrieval_errors += 1
            episode.last_retrieval_error = info["retrieval_error"] = _excerpt(f"{type(err).__name__}: {err}")
            return f"<information>Search failed ({type(err).__name__}); try again.</information>"
        episode.num_searches += 1
        # what this search brought that the episode had not seen: the per-search credit of a trainer (StepSearch's
        # information gain, David-GRPO's repeated-query rule) reads it here, so the env stays the one judge of evidence
        info["doc_ids"] = [p.doc_id for p in passages]
        info["titles"] = titles = [p.title for p in passages]
        found = {t.strip().lower() for t in titles}
        normalized = normalize_answer(query)  # its words one space apart
        info["new_gold_titles"] = len(found & episode.gold_titles - episode.retrieved_titles)
        info["gold_titles_total"] = len(episode.gold_titles)
        info["repeated_query"] = normalized in episode.queries
        episode.queries.add(normalized)
        episode.retrieved_titles |= found  # kept as compared: rebuilding it each search cost a long episode its length
        if self.observation_format == "search_r1":
            return protocol.format_passages_search_r1(passages)
        return protocol.format_passages(passages, self.max_passage_words)

    def _finish(self, answer: str | None, info: dict[str, Any]) -> float:
        episode = self._episode
        golds = episode.example.answers
        f1 = f1_score(answer, golds) if answer is not None else 0.0
        fmt = format_score(episode.used_tags, episode.malformed_tags)
        refine = refine_score(episode.refines, golds)
        recall = title_recall(episode.retrieved_titles, episode.example.gold_titles)
        reward = episode_reward(f1, fmt, refine, self.reward_weights, recall)
        info.update(
            answer=answer,
            gold_answers=list(golds),
            em=exact_match(answer, golds) if answer is not None else 0.0,
            f1=f1,
            cover_em=cover_exact_match(answer, golds) if answer is not None else 0.0,
            format=fmt,
            refine=refine,
            num_searches=episode.num_searches,
            num_tasks=episode.num_tasks,
            recall=recall,
            invalid_actions=episode.invalid_actions,
            num_actions=episode.actions,
            retrieval_errors=episode.retrieval_errors,
            **({"retrieval_error": episode.last_retrieval_error} if episode.retrieval_errors else {}),
            turns=episode.turns + episode.planner_turns,
            answered=answer is not None,
            index=episode.index,
        )
        return reward

    def end_episode(self, reason: str) -> tuple[float, dict[str, Any]]:
        """End the running episode now, scored as unanswered (an agent whose context is full calls this).

        Returns:
            The terminal reward and info, as a truncating `step` would give them (`info["ended_by"]` says why).
        """
        if self._episode is None or self._episode.done:
            raise ResetNeeded("no episode is running; call reset()")
        self._episode.done = True
        info: dict[str, Any] = {"ended_by": reason, "role": self._episode.role, "new_context": False}
        return self._finish(None, info), info

    def render(self) -> str | None:
        """The episode transcript (render_mode="ansi"); None otherwise."""
        if self.render_mode != "ansi" or self._episode is None:
            return None
        return "".join(f"[{who}] {text.strip()}\n" for who, text in self._episode.transcript)
