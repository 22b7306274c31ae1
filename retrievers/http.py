"""A `Retriever` backed by a retrieval server speaking the Search-R1 API.

Works against `python -m retrievers.server` and against Search-R1's own `retrieval_server.py` (e.g. its
wiki-18 e5 index on a GPU host): both take `POST /retrieve {"queries": [...], "topk": k, "return_scores":
true}` and answer `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`::

    from retrievers.http import HTTPRetriever
    retriever = HTTPRetriever("http://127.0.0.1:8000")   # raises now if no server answers
    retriever.search("Who directed Ed Wood?", k=3)

The constructor checks the server (`GET /health`, or a one-query `/retrieve` probe for servers without
/health) and raises `ConnectionError` with the command that starts one. Each request has a deadline of
``timeout`` seconds for the whole exchange (connecting, sending, and every read of the answer), so a server
that hangs, or one that drips its answer a byte at a time, fails the request at the deadline; transient
failures (connection errors, deadlines, 5xx) are retried a bounded number of times, each try with its own
deadline, and 4xx answers raise `RuntimeError` at once with the server's message (a rejected request is not
retried, and is not reported as a missing server). A search therefore blocks for at most
``timeout * (retries + 1)`` seconds plus the backoff. Batches are split to respect the limits the server
reports on /health (queries per request and passages per request), and lone UTF-16 surrogates are replaced
before a query is sent.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import httpcore

from retrievers.base import Passage, SharedIndex, clean_query, split_contents

START_HINT = (
    "start one with `python -m retrievers.server --kind bm25 --port 8000` "
    "(or Search-R1's retrieval_launch.sh), or check the URL"
)
TRANSPORT_ERRORS = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.ConnectionNotAvailable,
    httpcore.UnsupportedProtocol,
)
"""What a request can fail with short of an HTTP answer: no connection, a deadline, a broken exchange, a bad URL."""
_WRITE_CHUNK = 16384
"""Bytes sent per socket write, so that the deadline is checked between the pieces of a large request."""


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking sockets, with every operation's timeout cut to what is left of the request's deadline.

    httpcore's timeouts bound each connect, write and read on its own, so an answer that arrives one byte per
    interval never times out; here each operation gets at most the time left before the deadline that
    `within` set for the calling thread, and once it has passed the next operation fails at once.
    """

    def __init__(self) -> None:
        self._sockets = httpcore.SyncBackend()
        self._local = threading.local()

    @contextlib.contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """Every socket operation of this thread inside the block ends within `seconds` of its start."""
        self._local.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._local.deadline = None

    def left(self, timeout: float | None, error: type[Exception]) -> float | None:
        """`timeout` cut to the time left before the deadline; raises `error` once the deadline has passed."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise error("the request's deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._sockets.connect_tcp(
            host, port, self.left(timeout, httpcore.ConnectTimeout), local_address, socket_options
        )
        return _DeadlineStream(stream, self)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        stream = self._sockets.connect_unix_socket(path, self.left(timeout, httpcore.ConnectTimeout), socket_options)
        return _DeadlineStream(stream, self)

    def sleep(self, seconds: float) -> None:
        self._sockets.sleep(seconds)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes end by the deadline of `_DeadlineBackend`."""

    def __init__(self, stream: httpcore.NetworkStream, backend: _DeadlineBackend) -> None:
        self._stream = stream
        self._backend = backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._backend.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for lo in range(0, len(buffer), _WRITE_CHUNK):  # a server that reads slowly must not stretch the deadline
            self._stream.write(buffer[lo : lo + _WRITE_CHUNK], self._backend.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        timeout = self._backend.left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout), self._backend)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class DeadlinePool:
    """A thread-safe HTTP connection pool whose every request is answered in full within a deadline, or fails.

    httpx's and httpcore's own timeouts bound each socket operation alone, so a server that answers one byte per
    interval holds a request for as long as it likes; here the whole exchange (connecting, sending, every read of
    the status line, headers and body) ends within ``timeout`` seconds of its start. The retrieval client and the
    OpenAI-compatible sampler (`agents.samplers.openai_api`) both send their requests through one.
    """

    def __init__(self) -> None:
        self._backend = _DeadlineBackend()
        self._pool = httpcore.ConnectionPool(network_backend=self._backend)

    def request(
        self,
        method: str,
        url: str,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpcore.Response:
        """One exchange with `url`, read whole.

        Raises:
            httpcore.TimeoutException: the deadline passed, with a message that names it.
            One of `TRANSPORT_ERRORS`: no connection, a broken exchange, or a URL that is not http(s).
        """
        timeouts = dict.fromkeys(("connect", "read", "write", "pool"), timeout)
        with self._backend.within(timeout):
            try:
                return self._pool.request(
                    method, url, headers=headers or {}, content=content, extensions={"timeout": timeouts}
                )
            except httpcore.TimeoutException as err:
                raise type(err)(f"no complete answer within the request's deadline of {timeout:g} s") from err

    def close(self) -> None:
        """Close the pool's connections."""
        self._pool.close()


class HTTPRetriever(SharedIndex):
    """Retriever client for a Search-R1-compatible `/retrieve` endpoint.

    Args:
        url: the server's base URL, e.g. "http://127.0.0.1:8000" (a trailing "/retrieve" is accepted).
        timeout: seconds allowed for each HTTP request as a whole (connect, send, and the whole answer); a retry
            gets its own.
        retries: extra attempts after a connection error, timeout or 5xx answer (0 = try once).
        max_batch: queries per request; larger batches are split (our server accepts 512 by default).
        backoff: seconds before the first retry; doubled for each further one.

    Raises:
        ConnectionError: when no retrieval server answers at `url`.
    """

    def __init__(
        self, url: str, timeout: float = 30.0, retries: int = 2, max_batch: int = 256, backoff: float = 0.5
    ) -> None:
        if retries < 0 or max_batch < 1 or timeout <= 0:
            raise ValueError(f"need retries >= 0, max_batch >= 1, timeout > 0; got {retries}, {max_batch}, {timeout}")
        self.url = url.rstrip("/").removesuffix("/retrieve")
        self.timeout = timeout
        self.retries = retries
        self.max_batch = max_batch
        self.backoff = backoff
        self.max_hits: int | None = None
        """Passages per request the server accepts (from its /health), None when it does not say."""
        self._pool = DeadlinePool()
        self._check_server()

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r})"

    def close(self) -> None:
        """Close the underlying connection pool."""
        self._pool.close()

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> httpcore.Response:
        """One HTTP exchange with `path`, answered in full within the deadline (``timeout`` seconds from now).

        Raises:
            httpcore.TimeoutException: the deadline passed (or one step of the exchange took ``timeout``).
            One of `TRANSPORT_ERRORS`: no connection, a broken exchange, or a URL that is not http(s).
        """
        body = None if payload is None else json.dumps(payload).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        return self._pool.request(method, f"{self.url}{path}", timeout=self.timeout, headers=headers, content=body)

    def _check_server(self) -> None:
        try:
            health = self._request("GET", "/health")
            if health.status == 200:
                content_type = dict((k.lower(), v) for k, v in health.headers).get(b"content-type", b"")
                limits = json.loads(health.content) if b"json" in content_type else {}
                if isinstance(limits, dict):
                    if isinstance(limits.get("max_batch"), int) and limits["max_batch"] > 0:
                        self.max_batch = min(self.max_batch, limits["max_batch"])
                    if isinstance(limits.get("max_hits"), int) and limits["max_hits"] > 0:
                        self.max_hits = limits["max_hits"]
                return
            self._post({"queries": ["probe"], "topk": 1, "return_scores": True}, attempts=1)  # Search-R1: no /health
        except (*TRANSPORT_ERRORS, RuntimeError, ValueError) as err:
            raise ConnectionError(f"no retrieval server answers at {self.url} ({err}); {START_HINT}") from err

    def _post(self, payload: dict[str, Any], attempts: int | None = None) -> list:
        attempts = self.retries + 1 if attempts is None else attempts
        for attempt in range(attempts):
            try:
                response = self._request("POST", "/retrieve", payload)
            except TRANSPORT_ERRORS as err:  # connection refused/reset, deadlines
                failure: str = f"{type(err).__name__}: {err}"
                hint = START_HINT
            else:
                text = response.content.decode("utf-8", "replace")
                if response.status < 400:
                    answer = json.loads(response.content)
                    result = answer.get("result") if isinstance(answer, dict) else None
                    if not isinstance(result, list) or len(result) != len(payload["queries"]):
                        raise ValueError(f"{self.url}/retrieve answered without one result per query")
                    return result
                if response.status < 500:
                    raise RuntimeError(f"{self.url}/retrieve rejected the request ({response.status}): {text[:500]}")
                failure = f"HTTP {response.status}: {text[:200]}"
                hint = "the server is up but failed: see its log"
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"retrieval server {self.url} failed {attempts} time(s), last: {failure}; {hint}")

    @staticmethod
    def _passage(hit: dict[str, Any]) -> Passage:
        doc = hit.get("document", hit)  # with return_scores each hit wraps the document
        title, text = split_contents(str(doc.get("contents", doc.get("text", ""))), doc.get("title"))
        return Passage(str(doc.get("id", "")), title, text, float(hit.get("score", 0.0)))

    def search(self, query: str, k: int) -> list[Passage]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        per_request = self.max_batch if self.max_hits is None else max(1, min(self.max_batch, self.max_hits // k))
        results: list[list[Passage]] = []
        for lo in range(0, len(queries), per_request):
            batch = [clean_query(q) for q in queries[lo : lo + per_request]]
            for hits in self._post({"queries": batch, "topk": k, "return_scores": True}):
                results.append([self._passage(hit) for hit in hits])
        return results
