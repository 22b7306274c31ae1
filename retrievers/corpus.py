"""Paragraph corpora in the Search-R1/FlashRAG format and the on-disk cache that indexes live in.

A corpus file is JSON lines (optionally gzip-compressed) of `{"id", "contents"}` with an optional
`"title"`; `contents` may start with a quoted title line (`"Title"\\ntext`). `Corpus` keeps the rows in
memory (the bundled corpus is 17,645 paragraphs) and gives every index a stable fingerprint so a cache
entry is reused only for the same corpus and settings.
"""

from __future__ import annotations

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


def iter_corpus_rows(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """Stream (doc_id, title, text) from a corpus file without holding it in memory."""
    for line_no, line in enumerate(open_text(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            doc_id = str(row["id"])
            contents = row.get("contents", row.get("text"))
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{path}:{line_no}: not a corpus row with 'id' and 'contents' ({err})") from err
        if contents is None:
            raise ValueError(f"{path}:{line_no}: corpus row has neither 'contents' nor 'text'")
        title, text = split_contents(contents, row.get("title"))
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
        """Load a Search-R1/FlashRAG corpus file (`.jsonl` or `.jsonl.gz`)."""
        rows = list(iter_corpus_rows(path))
        if not rows:
            raise ValueError(f"corpus file {path} holds no rows")
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

    @property
    def fingerprint(self) -> str:
        """A short hash of ids, titles and texts: the cache key of anything built from this corpus."""
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
