"""The retrieval contract: one record type (`Passage`) and one protocol (`Retriever`).

Every retriever in this package (BM25 on Lucene, dense on FAISS, hybrid fusion, the HTTP client, the
in-memory BM25 used for the distractor setting) implements `Retriever`, so the env and the benchmarks
never care which one they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Passage:
    """One retrieved paragraph."""

    doc_id: str
    """Identifier of the paragraph in its corpus."""
    title: str
    """Wikipedia-style title ("" when the corpus has none)."""
    text: str
    """Paragraph text without the title line."""
    score: float
    """Retriever score; higher is better; comparable only within one retriever and query."""

    @property
    def contents(self) -> str:
        """The passage as a Search-R1 corpus row's ``contents``: ``"Title"\\ntext`` (the text alone without a title)."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text


@runtime_checkable
class Retriever(Protocol):
    """Anything that returns the top-k passages of a query."""

    def search(self, query: str, k: int) -> list[Passage]:
        """Return at most `k` passages for `query`, best first."""
        ...

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """Return `search(q, k)` for every query, in order; implementations may run them in parallel."""
        ...


class QueryError(ValueError):
    """A query the retriever cannot run as written (e.g. more distinct terms than Lucene allows).

    The retrieval server answers it with a 4xx and this message; it is the query's fault, not the index's.
    """


def clean_query(query: str) -> str:
    """`query` as valid Unicode: UTF-16 surrogate pairs joined, lone surrogates replaced by U+FFFD.

    Model output and JSON can hold lone surrogates (``"\\ud800"``), which no UTF-8 encoder (Lucene through
    the JVM, an HTTP body, a tokenizer) accepts; like the in-memory BM25, which never sees them as word
    characters, the retrievers search the rest of the query.
    """
    try:
        query.encode("utf-8")
    except UnicodeEncodeError:
        return query.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return query


def split_contents(contents: str, title: str | None = None) -> tuple[str, str]:
    """Split a Search-R1/FlashRAG `contents` field (`"Title"\\ntext`) into (title, text).

    Args:
        contents: the corpus row's contents.
        title: the row's explicit title when it has one; it wins over the first line.

    Returns:
        (title, text); the title is "" when neither source gives one.
    """
    head, sep, rest = contents.partition("\n")
    if sep and len(head) >= 2 and head.startswith('"') and head.endswith('"'):
        return (title if title is not None else head[1:-1]), rest
    return (title or ""), contents


class SharedIndex:
    """Mixin for retrievers that hold an index: deep copies return the same object.

    An index is shared by every env that searches it (never one per env); `gym.make` and
    `check_env` deep-copy env arguments, and copying a Lucene searcher or FAISS index would be both
    wrong and impossible.
    """

    def __deepcopy__(self, memo: dict) -> SharedIndex:
        return self
