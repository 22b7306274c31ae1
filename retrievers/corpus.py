"""Paragraph corpora in the Search-R1/FlashRAG format and the on-disk cache that indexes live in.

A corpus file is JSON lines (optionally gzip-compressed) of `{"id", "contents"}` with an optional
`"title"`; `contents` may start with a quoted title line (`"Title"\\ntext`). `Corpus` keeps the rows in
memory (the bundled corpus is 17,645 paragraphs) and gives every index a stable fingerprint so a cache
entry is reused only for the same corpus and settings.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from retrievers.base import Passage, split_contents


def cache_root() -> Path:
    """Where indexes and converted models are cached: $REDCODA_CACHE, else ~/.cache/redcoda."""
    return Path(os.environ.get("REDCODA_CACHE", Path.home() / ".cache" / "redcoda")).expanduser()


def open_text(path: str | os.PathLike) -> Iterator[str]:
    """Yield the lines of a text file, transparently gunzipping `.gz` files."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        yield from handle


class CorpusError(ValueError):
    """A corpus file that cannot be used: the message names the file, the line and what is wrong with it."""


def _numbered_rows(path: str | os.PathLike) -> Iterator[tuple[int, str, str, str]]:
    """(line number, doc_id, title, text) of each row of a corpus file, checked as it streams.

    Raises:
        FileNotFoundError: no file at `path`.
        CorpusError: a line that is not valid JSON, a row that is not an object, an id that is not a string or
            an integer, contents or a title that are not strings, or a file that cannot be read (damaged gzip,
            not UTF-8).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no corpus file at {path}")
    line_no = 0
    lines = open_text(path)
    try:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{path}: line {line_no}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise CorpusError(f"{path}: line {line_no}: expected a JSON object (one passage), got a {_kind(row)}")
            doc_id = row.get("id")
            if isinstance(doc_id, bool) or not isinstance(doc_id, str | int):
                raise CorpusError(f"{path}: line {line_no}: 'id' must be a string or an integer, got {_kind(doc_id)}")
            contents = row.get("contents", row.get("text"))
            if contents is None:
                raise CorpusError(f"{path}: line {line_no}: the row has neither 'contents' nor 'text'")
            if not isinstance(contents, str):
                raise CorpusError(f"{path}: line {line_no}: 'contents' must be a string, got {_kind(contents)}")
            title = row.get("title")
            if title is not None and not isinstance(title, str):
                raise CorpusError(f"{path}: line {line_no}: 'title' must be a string, got {_kind(title)}")
            yield (line_no, str(doc_id), *split_contents(contents, title))
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a truncated gzip stream, a binary file
        raise CorpusError(
            f"{path}: line {line_no + 1}: cannot be read ({type(err).__name__}: {err}); damaged or truncated?"
        ) from err


def _kind(value: object) -> str:
    """A JSON value's kind in an error message."""
    return "null" if value is None else type(value).__name__


def iter_corpus_rows(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """Stream (doc_id, title, text) from a corpus file without holding it in memory.

    Raises:
        FileNotFoundError: no file at `path`.
        CorpusError: a malformed row, naming the file and the line (ids are checked for repeats by
            `Corpus.from_jsonl`, which holds them all anyway).
    """
    for _, doc_id, title, text in _numbered_rows(path):
        yield doc_id, title, text


@dataclass(frozen=True)
class Corpus:
    """An in-memory paragraph corpus: parallel id/title/text tuples and an id -> row map."""

    doc_ids: tuple[str, ...]
    titles: tuple[str, ...]
    texts: tuple[str, ...]
    name: str = "corpus"
    _row: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (len(self.doc_ids) == len(self.titles) == len(self.texts)):
            raise ValueError("doc_ids, titles and texts must have the same length")
        self._row.update({doc_id: i for i, doc_id in enumerate(self.doc_ids)})
        if len(self._row) != len(self.doc_ids):
            raise ValueError(f"corpus {self.name!r} has duplicate doc ids")

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, name: str | None = None) -> Corpus:
        """Load a Search-R1/FlashRAG corpus file (`.jsonl` or `.jsonl.gz`).

        Raises:
            FileNotFoundError: no file at `path`.
            CorpusError: a malformed row or a repeated id (naming the file and the line), or no rows at all.
        """
        first_line: dict[str, int] = {}
        rows = []
        for line_no, doc_id, title, text in _numbered_rows(path):
            if doc_id in first_line:
                raise CorpusError(f"{path}: line {line_no}: id {doc_id!r} is also line {first_line[doc_id]}'s id")
            first_line[doc_id] = line_no
            rows.append((doc_id, title, text))
        if not rows:
            raise CorpusError(f"{path}: the corpus file holds no rows")
        ids, titles, texts = zip(*rows, strict=True)
        return cls(ids, titles, texts, name=name or Path(path).name.split(".")[0])

    @classmethod
    def from_passages(cls, passages: list[tuple[str, str, str]], name: str = "corpus") -> Corpus:
        """Build a corpus from (doc_id, title, text) triples."""
        if not passages:
            raise ValueError("a corpus needs at least one passage")
        ids, titles, texts = zip(*passages, strict=True)
        return cls(tuple(ids), tuple(titles), tuple(texts), name=name)

    def __len__(self) -> int:
        return len(self.doc_ids)

    def passage(self, doc_id: str, score: float = 0.0) -> Passage:
        """The passage with this id (KeyError if absent)."""
        i = self._row[doc_id]
        return Passage(doc_id, self.titles[i], self.texts[i], score)

    def contents(self, i: int) -> str:
        """Row `i` in the Search-R1 `contents` form: `"Title"\\ntext`."""
        return Passage(self.doc_ids[i], self.titles[i], self.texts[i], 0.0).contents

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of ids, titles and texts: the cache key of anything built from this corpus. Computed once
        (the rows are immutable), since every env made over the corpus asks for it (docs/results/throughput.md)."""
        return fingerprint_rows(zip(self.doc_ids, self.titles, self.texts, strict=True))


def fingerprint_rows(rows: Iterable[tuple[str, str, str]]) -> str:
    """`Corpus.fingerprint` of (doc_id, title, text) rows, computable while streaming a corpus file."""
    digest = hashlib.sha256()
    for doc_id, title, text in rows:
        digest.update(doc_id.encode())
        digest.update(b"\x00")
        digest.update(title.encode())
        digest.update(b"\x00")
        digest.update(text.encode())
        digest.update(b"\x01")
    return digest.hexdigest()[:16]
