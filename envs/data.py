"""Question-answering data: the `QAExample` record and loaders for the bundled and official files.

Sources, in the order a researcher meets them:

* bundled (default): real HotpotQA distractor rows, a 17,645-paragraph HotpotQA corpus, MuSiQue and
  2WikiMultihopQA dev samples and Bamboogle, shipped gzip-compressed in `envs/data/` with their licences
  (`envs/data/ATTRIBUTION.md`). Nothing is downloaded.
* a local file: the official HotpotQA JSON (distractor or fullwiki, a JSON list) or JSON lines, the
  MuSiQue / 2WikiMultihopQA / FlashRAG JSON lines, and Search-R1's parquet (or JSON lines) rows. A row with
  `golden_answers` (FlashRAG, Search-R1) or Search-R1's `reward_model.ground_truth.target` is read as such
  whatever `dataset` says; every accepted row layout is in docs/data.md.
* the other way, `search_r1_rows` / `flashrag_rows` and `write_rows` (`python -m envs.export`) write questions
  in Search-R1's and FlashRAG's formats.
* the Hugging Face hub (`load_hotpotqa_hub`), only when `datasets` is installed and a network is there.
  Never called at import time or in tests.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

DATASETS = ("hotpotqa", "musique", "2wiki", "bamboogle")
BUNDLED_SPLITS = {
    "hotpotqa": ("train", "dev"),
    "musique": ("dev",),
    "2wiki": ("dev",),
    "bamboogle": ("test",),
}
_BUNDLED_DIR = {"hotpotqa": "hotpotqa", "musique": "musique", "2wiki": "2wikimultihopqa", "bamboogle": "bamboogle"}
SEARCH_R1_SOURCES = {"2wiki": "2wikimultihopqa"}
"""Our dataset names that Search-R1 spells otherwise: its reward dispatcher (`_select_rm_score_fn`) knows nq,
triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique and bamboogle as `data_source`."""
_OUR_NAMES = {theirs: ours for ours, theirs in SEARCH_R1_SOURCES.items()}


@dataclass(frozen=True)
class QAExample:
    """One multi-hop question with its gold answer(s) and evidence."""

    id: str
    """Dataset identifier of the question."""
    question: str
    """The question text."""
    answers: tuple[str, ...]
    """Gold answer first, then accepted aliases; metrics take the max over them."""
    dataset: str
    """Which dataset the row comes from (hotpotqa, musique, 2wiki, bamboogle, ...)."""
    type: str = ""
    """Question type as the dataset labels it (bridge, comparison, compositional, ...)."""
    context: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """The question's own paragraphs as (title, sentences): the distractor setting."""
    supporting_facts: tuple[tuple[str, int], ...] = ()
    """(title, sentence index) pairs of the evidence."""
    decomposition: tuple[tuple[str, str], ...] = ()
    """(sub-question, sub-answer) pairs where the dataset provides them (MuSiQue)."""

    @property
    def answer(self) -> str:
        """The gold answer."""
        return self.answers[0]

    @property
    def kind(self) -> str:
        """``yes/no`` where the gold answer is yes or no, else the dataset's type ("" where it labels none)."""
        from envs.rewards import is_yes_no

        return "yes/no" if is_yes_no(self.answer) else self.type

    @property
    def gold_titles(self) -> tuple[str, ...]:
        """Titles of the supporting paragraphs, in first-mention order, without duplicates."""
        return tuple(dict.fromkeys(title for title, _ in self.supporting_facts))

    @property
    def paragraphs(self) -> tuple[tuple[str, str], ...]:
        """The question's own paragraphs as (title, text)."""
        return tuple((title, "".join(sentences).strip()) for title, sentences in self.context)

    def supporting_sentences(self, title: str) -> tuple[str, ...]:
        """The supporting sentences of one gold title (stripped), in sentence order."""
        sentences = dict(self.context).get(title, ())
        ids = sorted({i for t, i in self.supporting_facts if t == title})
        return tuple(sentences[i].strip() for i in ids if 0 <= i < len(sentences))


def bundled_path(dataset: str, split: str) -> Path:
    """Path of a bundled data file (`corpus` is also a split name for hotpotqa's corpus)."""
    if dataset not in _BUNDLED_DIR:
        raise ValueError(f"unknown dataset {dataset!r}; bundled datasets: {', '.join(DATASETS)}")
    if split != "corpus" and split not in BUNDLED_SPLITS[dataset]:
        raise ValueError(f"{dataset} has no bundled split {split!r}; bundled: {', '.join(BUNDLED_SPLITS[dataset])}")
    root = resources.files("envs") / "data" / _BUNDLED_DIR[dataset]
    path = Path(str(root / f"{split}.jsonl.gz"))
    if not path.exists():
        raise FileNotFoundError(f"bundled file {path} is missing; reinstall the package")
    return path


class DataError(ValueError):
    """A data file that cannot be used: the message names the file, where in it (line or row) and what is wrong."""


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from err
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises its own error types for damaged files
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from err
    for n, row in enumerate(rows, 1):
        yield f"row {n}", row


def _read_rows(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row of a JSON list file (official HotpotQA), a JSON-lines file (gzip or not) or a
    parquet file (Search-R1's; needs pyarrow).

    `where` is ``"line N"`` in a JSON-lines file and ``"row N"`` in a JSON list or a parquet file.

    Raises:
        FileNotFoundError: no file at `path`.
        DataError: the file is not valid JSON (truncated, binary, a malformed line).
    """
    from retrievers.corpus import open_text

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no data file at {path}")
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    lines = open_text(path)
    line_no = 0
    try:
        first = next(lines, "")
        if first.lstrip().startswith("["):  # a JSON list: the official HotpotQA release
            text = first + "".join(lines)
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as err:
                ends_early = err.pos >= len(text.rstrip()) - 1 or err.msg.startswith("Unterminated")
                truncated = "; the file ends early (truncated?)" if ends_early else ""
                raise DataError(
                    f"{path}: line {err.lineno}, column {err.colno}: not valid JSON ({err.msg}){truncated}"
                ) from err
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected a JSON list of questions")
            for n, row in enumerate(rows, 1):
                yield f"row {n}", row
            return
        for line_no, line in enumerate(itertools.chain([first], lines), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}: line {line_no}: not valid JSON ({err.msg})") from err
                yield f"line {line_no}", row
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a truncated gzip stream, a binary file
        raise DataError(
            f"{path}: line {line_no + 1}: cannot be read ({type(err).__name__}: {err}); damaged or truncated?"
        ) from err


def _context(raw: Iterable) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((str(title), tuple(str(s) for s in sentences)) for title, sentences in raw)


def hotpotqa_example(row: dict[str, Any], dataset: str = "hotpotqa") -> QAExample:
    """A QAExample from an official HotpotQA (or 2WikiMultihopQA, same layout) row."""
    if "answer" not in row:
        raise ValueError(f"row {row.get('_id', '?')} has no answer (the official test split has none)")
    return QAExample(
        id=str(row.get("_id", row.get("id", ""))),
        question=row["question"],
        answers=(str(row["answer"]),),
        dataset=dataset,
        type=str(row.get("type", "")),
        context=_context(row.get("context", ())),
        supporting_facts=tuple((str(t), int(i)) for t, i in row.get("supporting_facts", ())),
    )


def musique_example(row: dict[str, Any]) -> QAExample:
    """A QAExample from a MuSiQue-Ans row (each paragraph is one "sentence")."""
    paragraphs = sorted(row.get("paragraphs", ()), key=lambda p: p["idx"])
    return QAExample(
        id=str(row["id"]),
        question=row["question"],
        answers=(str(row["answer"]), *map(str, row.get("answer_aliases", ()))),
        dataset="musique",
        type=str(row["id"]).split("__")[0],
        context=tuple((p["title"], (p["paragraph_text"],)) for p in paragraphs),
        supporting_facts=tuple((p["title"], 0) for p in paragraphs if p.get("is_supporting")),
        decomposition=tuple((d["question"], str(d["answer"])) for d in row.get("question_decomposition", ())),
    )


def flashrag_example(row: dict[str, Any], dataset: str = "bamboogle") -> QAExample:
    """A QAExample from a FlashRAG row (`id, question, golden_answers`; no passages) or a Search-R1 row (the same
    fields, or only `question` with `reward_model.ground_truth.target`); `data_source` names the dataset (in
    Search-R1's spelling or ours)."""
    answers = row.get("golden_answers")
    if answers is None:
        answers = row["reward_model"]["ground_truth"]["target"]
    if isinstance(answers, str):
        answers = [answers]
    answers = tuple(map(str, answers))
    if not answers:
        raise ValueError("the row has no gold answer")
    extra = row.get("extra_info") or {}
    source = str(row.get("data_source") or dataset)
    return QAExample(
        id=str(row.get("id", extra.get("index", ""))),
        question=row["question"],
        answers=answers,
        dataset=_OUR_NAMES.get(source, source),
    )


def _is_flashrag(row: dict[str, Any]) -> bool:
    """Whether a row is in FlashRAG's or Search-R1's layout (gold answers as `golden_answers` or a reward target)."""
    return "golden_answers" in row or isinstance(row.get("reward_model"), dict)


_PARSERS = {
    "hotpotqa": hotpotqa_example,
    "2wiki": lambda row: hotpotqa_example(row, dataset="2wiki"),
    "musique": musique_example,
    "bamboogle": flashrag_example,
}


@functools.lru_cache(maxsize=16)
def _load_cached(dataset: str, path: str) -> tuple[QAExample, ...]:
    examples = []
    for where, row in _read_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}: {where}: expected a JSON object (one question), got a {type(row).__name__}")
        # FlashRAG and Search-R1 files hold every dataset in one layout: the row says which layout it is
        parse = functools.partial(flashrag_example, dataset=dataset) if _is_flashrag(row) else _PARSERS[dataset]
        try:
            examples.append(parse(row))
        except KeyError as err:
            raise DataError(f"{path}: {where}: not a {dataset} row: it has no {err.args[0]!r} field") from err
        except (TypeError, ValueError, AttributeError) as err:
            raise DataError(f"{path}: {where}: not a {dataset} row ({type(err).__name__}: {err})") from err
        question = examples[-1].question
        if not isinstance(question, str) or not question.strip():  # the env would show its repr, or nothing
            raise DataError(f"{path}: {where}: 'question' must be a non-empty string, got {question!r:.80}")
    if not examples:
        raise DataError(f"{path} holds no questions")
    return tuple(examples)


def load_examples(
    dataset: str = "hotpotqa", split: str = "train", path: str | os.PathLike | None = None
) -> tuple[QAExample, ...]:
    """Load questions as QAExample records.

    Args:
        dataset: hotpotqa, musique, 2wiki or bamboogle (the file layout to parse).
        split: a bundled split (hotpotqa: train, dev; musique, 2wiki: dev; bamboogle: test); ignored with `path`.
        path: an official data file (HotpotQA JSON list, or JSON lines), used instead of the bundled one.

    Returns:
        The questions in file order (cached per process; the tuple is immutable).
    """
    if dataset not in _PARSERS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    file = Path(path) if path is not None else bundled_path(dataset, split)
    return _load_cached(dataset, str(file.resolve()))


def load_hotpotqa_hub(split: str = "validation", setting: str = "distractor") -> tuple[QAExample, ...]:
    """Load HotpotQA from the Hugging Face hub (`hotpotqa/hotpot_qa`); needs `datasets` and a network.

    Args:
        split: train or validation.
        setting: distractor or fullwiki.
    """
    try:
        import datasets
    except ImportError as err:
        raise ImportError("loading from the hub needs the datasets package: pip install 'redcoda[hub]'") from err
    rows = datasets.load_dataset("hotpotqa/hotpot_qa", setting, split=split)
    out = []
    for row in rows:
        context = list(zip(row["context"]["title"], row["context"]["sentences"], strict=True))
        facts = list(zip(row["supporting_facts"]["title"], row["supporting_facts"]["sent_id"], strict=True))
        out.append(hotpotqa_example({**row, "_id": row["id"], "context": context, "supporting_facts": facts}))
    return tuple(out)


def pooled_passages(examples: Sequence[QAExample], prefix: str) -> list[tuple[str, str, str]]:
    """Every paragraph of these questions, deduplicated on (title, text), as (doc_id, title, text).

    This is the closed "pooled" corpus of datasets that ship no corpus of their own (MuSiQue, 2Wiki).
    """
    seen: dict[tuple[str, str], str] = {}
    for example in examples:
        for title, text in example.paragraphs:
            seen.setdefault((title, text), f"{prefix}-{len(seen)}")
    return [(doc_id, title, text) for (title, text), doc_id in seen.items()]


EXPORT_FORMATS = ("search-r1", "flashrag")


def flashrag_rows(examples: Sequence[QAExample]) -> list[dict[str, Any]]:
    """FlashRAG rows (`{"id", "question", "golden_answers", "metadata"}`) of these questions."""
    return [
        {
            "id": example.id,
            "question": example.question,
            "golden_answers": list(example.answers),
            "metadata": {"type": example.type, "supporting_titles": list(example.gold_titles)},
        }
        for example in examples
    ]


def search_r1_rows(examples: Sequence[QAExample], split: str = "train") -> list[dict[str, Any]]:
    """Search-R1 training rows of these questions (its `scripts/data_process/nq_search.py` layout).

    Each row keeps FlashRAG's `id`, `question` and `golden_answers` and adds what Search-R1's trainer reads:
    `data_source` (Search-R1's name of the dataset, `SEARCH_R1_SOURCES`), `prompt` (one user message: Search-R1's
    instructions, ours with <refine>, then the question), `ability`, `reward_model` (`{"style": "rule",
    "ground_truth": {"target": answers}}`) and `extra_info`. As its script does, the question is stripped and ends
    with "?" (one is added when missing), in `question` and in the prompt alike.
    """
    from envs.protocol import FLAT_INSTRUCTIONS

    rows = []
    for n, example in enumerate(examples):
        question = example.question.strip()
        if not question.endswith("?"):
            question += "?"
        rows.append(
            {
                "id": example.id,
                "question": question,
                "golden_answers": list(example.answers),
                "data_source": SEARCH_R1_SOURCES.get(example.dataset, example.dataset),
                "prompt": [{"role": "user", "content": f"{FLAT_INSTRUCTIONS} Question: {question}\n"}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": list(example.answers)}},
                "extra_info": {"split": split, "index": n},
            }
        )
    return rows


def write_rows(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows as parquet (a `.parquet` path; needs pyarrow) or JSON lines (any other path; gzip for `.gz`).

    Returns:
        The path written.
    """
    import gzip

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("writing parquet needs pyarrow: pip install pyarrow (or write .jsonl)") from err
        pq.write_table(pa.Table.from_pylist(list(rows)), path)
        return path
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
