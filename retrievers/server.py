"""Serve any retriever over HTTP with the Search-R1 retrieval API (FastAPI + uvicorn).

    python -m retrievers.server                                   # BM25 over the bundled HotpotQA corpus
    python -m retrievers.server --kind dense --port 8001          # MiniLM + FAISS flat (bundled embeddings)
    python -m retrievers.server --kind hybrid --cache-size 100000
    python -m retrievers.server --kind dense --corpus wiki-18.jsonl --index e5_Flat.index \\
        --encoder intfloat/e5-base-v2 --query-prefix "query: " --passage-prefix "passage: "

Endpoints:
    POST /retrieve  {"queries": [str, ...], "topk": int, "return_scores": bool}
        -> {"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]} with return_scores,
           {"result": [[{"id", "contents"}, ...], ...]} without (the bare documents, one list per query,
           for any number of queries);
        `contents` is `"Title"\\ntext`. A request it cannot serve is answered 4xx with a message (`create_app`).
    GET /health     -> {"status": "ok", "retriever": ..., "max_batch": ..., "max_topk": ..., "max_hits": ...}

It binds 127.0.0.1 unless `--host` says otherwise: it has no authentication. A command line it cannot serve (a
missing or malformed corpus or index, a limit out of range, a port it cannot listen on) ends it with one line,
``error: ...``, and exit status 2, before any index is built where it can be told earlier. Requests are served one
at a time (the retriever is called under a lock); batch queries into one request, as Search-R1's trainer does.

Memory is bounded: a request holds at most max_body_bytes of body (8 MiB) and max_hits passages (8,192), and the
JVM behind BM25 runs with a bounded heap (``--jvm-heap``, default 2g); the Lucene index is memory-mapped and the
FAISS index is held whole, so add their sizes.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

try:
    from fastapi import FastAPI, HTTPException
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as err:
    raise ImportError("the retrieval server needs fastapi and uvicorn: pip install 'redcoda[server]'") from err

from retrievers.base import Passage, QueryError, Retriever, clean_query
from retrievers.build_index import OneLineParser

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "envs" / "data" / "hotpotqa" / "corpus.jsonl.gz"


class RetrieveRequest(BaseModel):
    """The body of POST /retrieve, as Search-R1's trainer sends it."""

    model_config = ConfigDict(extra="ignore")

    queries: list[str] = Field(description="the search queries")
    topk: int | None = Field(default=None, description="passages per query (server default when absent)")
    return_scores: bool = Field(default=False, description="wrap each document with its score")


def _finite(value: Any) -> Any:
    """`value` with every non-finite float in it replaced by its name ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def document(passage: Passage) -> dict[str, str]:
    """A passage as a Search-R1 corpus row: {"id", "contents"} with contents `"Title"\\ntext`."""
    return {"id": passage.doc_id, "contents": passage.contents}


class _BodyTooLarge(HTTPException):
    """Raised from inside the body stream when a request body passes the limit (FastAPI answers it as a 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes")


class BodySizeLimit:
    """ASGI middleware: answer 413 once a request body passes `max_bytes`, counted as the body arrives.

    A Content-Length over the limit is refused before any of the body is read; a chunked body (no
    Content-Length) or one longer than it declares is cut off as soon as the bytes received pass the limit,
    so no handler ever parses more than `max_bytes`.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await JSONResponse({"detail": _BodyTooLarge(self.max_bytes).detail}, status_code=413)(scope, receive, send)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)


def create_app(
    retriever: Retriever,
    *,
    default_topk: int = 3,
    max_topk: int = 100,
    max_batch: int = 512,
    max_query_chars: int = 4096,
    max_body_bytes: int = 8 << 20,
    max_hits: int = 8192,
) -> FastAPI:
    """A FastAPI app serving `retriever` with the Search-R1 API.

    Bad JSON, missing fields, topk outside [1, max_topk], more than max_batch queries, more than max_hits passages
    (topk x queries), over-long queries, queries the retriever cannot run (more distinct terms than Lucene's
    1,024-clause limit) and bodies over max_body_bytes (counted as they arrive, chunked or not) are answered 4xx
    with a message. Lone UTF-16 surrogates in a query are replaced (U+FFFD) and the rest of the query is served.

    Args:
        retriever: anything implementing `Retriever`.
        default_topk: topk when a request omits it.
        max_topk: the largest topk accepted.
        max_batch: the most queries accepted in one request.
        max_query_chars: the longest query accepted.
        max_body_bytes: the largest request body accepted (enforced while the body is read).
        max_hits: the most passages one request may ask for (topk x queries), which bounds a response's memory.
    """
    app = FastAPI(title="RedCoda retrieval server", description="Search-R1 compatible /retrieve")
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    lock = threading.Lock()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Any, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, and JSON has no NaN or Infinity: a body with `"topk": NaN` would
        # fail to render and come back as a 500; here every non-finite number in the echo is written as a string
        return JSONResponse({"detail": _finite(jsonable_encoder(error.errors()))}, status_code=422)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "retriever": type(retriever).__name__,
            "max_batch": max_batch,
            "max_topk": max_topk,
            "max_hits": max_hits,
        }

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict[str, list]:
        topk = default_topk if request.topk is None else request.topk
        if not 1 <= topk <= max_topk:
            raise HTTPException(422, f"topk must be between 1 and {max_topk}, got {topk}")
        if len(request.queries) > max_batch:
            raise HTTPException(413, f"at most {max_batch} queries per request, got {len(request.queries)}")
        if topk * len(request.queries) > max_hits:
            raise HTTPException(
                413,
                f"topk x queries is {topk} x {len(request.queries)} = {topk * len(request.queries)} passages, over "
                f"the limit of {max_hits} per request; send fewer queries per request",
            )
        too_long = [i for i, q in enumerate(request.queries) if len(q) > max_query_chars]
        if too_long:
            raise HTTPException(422, f"queries {too_long[:5]} are longer than {max_query_chars} characters")
        queries = [clean_query(q) for q in request.queries]
        try:
            with lock:
                hits = retriever.batch_search(queries, topk) if queries else []
        except QueryError as err:
            raise HTTPException(422, str(err)) from err
        if request.return_scores:
            return {"result": [[{"document": document(p), "score": p.score} for p in ps] for ps in hits]}
        return {"result": [[document(p) for p in ps] for ps in hits]}

    return app


def build_retriever(args: argparse.Namespace) -> Retriever:
    """The retriever the command line asks for."""
    from retrievers.corpus import Corpus

    corpus = Corpus.from_jsonl(args.corpus)
    dense = bm25 = None
    if args.kind in ("dense", "hybrid"):
        from retrievers.dense import DenseRetriever
        from retrievers.encoders import DEFAULT_ENCODER, HFEncoder

        encoder = HFEncoder(
            args.encoder or DEFAULT_ENCODER,
            query_prefix=args.query_prefix,
            passage_prefix=args.passage_prefix,
            device=args.device,
        )
        index = args.index if args.kind == "dense" else args.dense_index
        try:
            dense = DenseRetriever(
                corpus, encoder, index=index, kind="hnsw" if args.hnsw else "flat", hnsw_m=args.hnsw or 32
            )
        except RuntimeError as err:  # FAISS's reader: a file that holds no index, or one this build cannot read
            flag = "--index" if args.kind == "dense" else "--dense-index"
            raise ValueError(f"{flag} {index}: not a FAISS index ({str(err).splitlines()[0][-200:]})") from None
    if args.kind in ("bm25", "hybrid"):
        from retrievers.bm25 import BM25Retriever

        bm25 = BM25Retriever(
            corpus, index_dir=args.index if args.kind == "bm25" else args.bm25_index, engine=args.bm25_engine
        )
    if args.kind == "hybrid":
        from retrievers.hybrid import HybridRetriever

        retriever: Retriever = HybridRetriever([bm25, dense])
    else:
        retriever = bm25 or dense
    if args.cache_size > 0:
        from retrievers.cached import CachedRetriever

        retriever = CachedRetriever(retriever, maxsize=args.cache_size)
    return retriever


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m retrievers.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["bm25", "dense", "hybrid"], default="bm25")
    parser.add_argument("--corpus", default=str(BUNDLED_CORPUS), help="corpus file (default: bundled HotpotQA)")
    parser.add_argument("--index", default=None, help="prebuilt index for bm25/dense (default: build and cache)")
    parser.add_argument("--bm25-index", default=None, help="hybrid: prebuilt Lucene index")
    parser.add_argument("--dense-index", default=None, help="hybrid: prebuilt FAISS index")
    parser.add_argument(
        "--bm25-engine",
        choices=["lucene", "matrix"],
        default="lucene",
        help="bm25/hybrid: 'matrix' scores a request's whole batch at once (same ranking as Lucene; memory grows "
        "with the index's postings, for corpora up to a few million passages)",
    )
    parser.add_argument("--encoder", default=None, help="dense: HF hub id or model dir (default: all-MiniLM-L6-v2)")
    parser.add_argument("--query-prefix", default="", help='dense: e.g. "query: " for E5')
    parser.add_argument("--passage-prefix", default="", help='dense: e.g. "passage: " for E5')
    parser.add_argument("--device", default=None, help="dense: torch device for the query encoder")
    parser.add_argument("--hnsw", type=int, default=0, metavar="M", help="dense: HNSW index with this M (0: flat)")
    parser.add_argument("--cache-size", type=int, default=0, help="LRU query cache entries (0: no cache)")
    parser.add_argument("--topk", type=int, default=3, help="topk when a request gives none")
    parser.add_argument("--max-topk", type=int, default=100)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--max-hits", type=int, default=8192, help="most passages per request (topk x queries)")
    parser.add_argument(
        "--jvm-heap",
        default=None,
        help="bm25/hybrid: the JVM's maximum heap, e.g. 4g (default: REDCODA_JVM_HEAP, else 2g)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (the server has no authentication)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem is not None:
        _exit_with(problem)
    if args.jvm_heap is not None:
        os.environ["REDCODA_JVM_HEAP"] = args.jvm_heap  # read when the JVM starts, in build_retriever

    import uvicorn

    try:
        retriever = build_retriever(args)
    except (OSError, ValueError, ImportError) as err:  # their messages say what to fix: a traceback adds nothing
        _exit_with(str(err))
    app = create_app(
        retriever,
        default_topk=args.topk,
        max_topk=args.max_topk,
        max_batch=args.max_batch,
        max_hits=args.max_hits,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the command line unservable, checked before the index is built (None when nothing does)."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535] (0: any free port), got {args.port}"
    for name in ("topk", "max_topk", "max_batch", "max_hits"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.topk > args.max_topk:
        return f"--topk ({args.topk}) must be <= --max-topk ({args.max_topk})"
    for name in ("cache_size", "hnsw"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    if not Path(args.corpus).is_file():
        return f"--corpus: no corpus file at {args.corpus}"
    for name in ("index", "bm25_index", "dense_index"):
        if getattr(args, name) is not None and not Path(getattr(args, name)).exists():
            return f"--{name.replace('_', '-')}: no index at {getattr(args, name)}"
    if args.kind != "bm25" and args.device is not None:
        import torch

        try:
            torch.device(args.device)
        except RuntimeError:
            return f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
    try:  # a port in use (or a host that is not this machine's) fails now, not after minutes of index building
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as err:
        reason = str(err.strerror or err).split(" (while attempting")[0]  # the address is in the message already
        return f"cannot listen on {args.host}:{args.port} ({reason}); choose another --port or --host"
    return None


def _exit_with(message: str) -> NoReturn:
    """End the command with `message` as one line and exit status 2 (a usage error)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
