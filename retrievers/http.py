"""A `Retriever` backed by a retrieval server speaking the Search-R1 API.

Works against `python -m retrievers.server` and against Search-R1's own `retrieval_server.py` (e.g. its
wiki-18 e5 index on a GPU host): both take `POST /retrieve {"queries": [...], "topk": k, "return_scores":
true}` and answer `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`::

    from retrievers.http import HTTPRetriever
    retriever = HTTPRetriever("http://127.0.0.1:8000")   # raises now if no server answers
    retriever.search("Who directed Ed Wood?", k=3)

The constructor checks the server (`GET /health`, or a one-query `/retrieve` probe for servers without
/health) and raises `ConnectionError` with the command that starts one. Requests time out, transient
failures (connection errors, timeouts, 5xx) are retried a bounded number of times, and 4xx answers raise
`RuntimeError` at once with the server's message (a rejected request is not retried, and is not reported as
a missing server). A search against a hung server blocks for at most ``timeout * (retries + 1)`` seconds
plus the backoff. Batches are split to respect the limits the server reports on /health (queries per
request and passages per request), and lone UTF-16 surrogates are replaced before a query is sent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx

from retrievers.base import Passage, SharedIndex, clean_query, split_contents

START_HINT = (
    "start one with `python -m retrievers.server --kind bm25 --port 8000` "
    "(or Search-R1's retrieval_launch.sh), or check the URL"
)


class HTTPRetriever(SharedIndex):
    """Retriever client for a Search-R1-compatible `/retrieve` endpoint.

    Args:
        url: the server's base URL, e.g. "http://127.0.0.1:8000" (a trailing "/retrieve" is accepted).
        timeout: seconds allowed for each HTTP request.
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
        self._client = httpx.Client(timeout=timeout)
        self._check_server()

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r})"

    def close(self) -> None:
        """Close the underlying connection pool."""
        self._client.close()

    def _check_server(self) -> None:
        try:
            health = self._client.get(f"{self.url}/health")
            if health.status_code == 200:
                limits = health.json() if "json" in health.headers.get("content-type", "") else {}
                if isinstance(limits, dict):
                    if isinstance(limits.get("max_batch"), int) and limits["max_batch"] > 0:
                        self.max_batch = min(self.max_batch, limits["max_batch"])
                    if isinstance(limits.get("max_hits"), int) and limits["max_hits"] > 0:
                        self.max_hits = limits["max_hits"]
                return
            self._post({"queries": ["probe"], "topk": 1, "return_scores": True}, attempts=1)  # Search-R1: no /health
        except (httpx.HTTPError, RuntimeError, ValueError) as err:
            raise ConnectionError(f"no retrieval server answers at {self.url} ({err}); {START_HINT}") from err

    def _post(self, payload: dict[str, Any], attempts: int | None = None) -> list:
        attempts = self.retries + 1 if attempts is None else attempts
        for attempt in range(attempts):
            try:
                response = self._client.post(f"{self.url}/retrieve", json=payload)
            except httpx.TransportError as err:  # connection refused/reset, timeouts
                failure: str = f"{type(err).__name__}: {err}"
                hint = START_HINT
            else:
                if response.status_code < 400:
                    result = response.json().get("result")
                    if not isinstance(result, list) or len(result) != len(payload["queries"]):
                        raise ValueError(f"{self.url}/retrieve answered without one result per query")
                    return result
                if response.status_code < 500:
                    raise RuntimeError(
                        f"{self.url}/retrieve rejected the request ({response.status_code}): {response.text[:500]}"
                    )
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
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
