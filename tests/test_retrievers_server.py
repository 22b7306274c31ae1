"""The retrieval server and HTTP client, over a real Lucene index, on loopback.

A real uvicorn server runs in a thread on a free 127.0.0.1 port and is sent requests shaped exactly as
Search-R1's trainer sends them.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from retrievers.corpus import Corpus

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "envs" / "data" / "hotpotqa" / "corpus.jsonl.gz"
# 1,296 distinct two-character terms in 3,887 characters: under the server's 4,096-character query limit, over
# Lucene's 1,024-clause limit (a few are stopwords, which the analyzer drops).
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
MANY_TERMS = " ".join(a + b for a in _ALNUM for b in _ALNUM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def small_corpus() -> Corpus:
    """The first 300 paragraphs of the bundled corpus."""
    rows = []
    with gzip.open(CORPUS_FILE, "rt") as handle:
        for line in handle:
            row = json.loads(line)
            rows.append((row["id"], row["title"], row["contents"].partition("\n")[2]))
            if len(rows) == 300:
                break
    return Corpus.from_passages(rows, name="first300")


@pytest.fixture(scope="session")
def bm25_small(small_corpus, tmp_path_factory):
    from retrievers.bm25 import BM25Retriever

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDCODA_CACHE", str(tmp_path_factory.mktemp("redcoda-cache")))
        return BM25Retriever(small_corpus)


@pytest.fixture(scope="session")
def server_url(bm25_small, serve_app) -> str:
    from retrievers.server import create_app

    return serve_app(create_app(bm25_small, max_topk=20, max_batch=8, max_hits=60))[0]


def test_search_r1_request_shape(server_url, bm25_small, small_corpus):
    queries = ["Ed Wood film Tim Burton", small_corpus.titles[42]]
    # Exactly what Search-R1's trainer (search_r1/llm_agent/generation.py) sends.
    response = requests.post(f"{server_url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2 and all(len(hits) == 3 for hits in result)
    for query, hits in zip(queries, result, strict=True):
        expected = bm25_small.search(query, 3)
        assert [hit["document"]["id"] for hit in hits] == [p.doc_id for p in expected]
        assert [hit["score"] for hit in hits] == pytest.approx([p.score for p in expected])
        first = expected[0]
        assert hits[0]["document"]["contents"] == f'"{first.title}"\n{first.text}'
    assert result[1][0]["document"]["id"] == small_corpus.doc_ids[42]


def test_without_scores_returns_documents_only(server_url):
    response = requests.post(f"{server_url}/retrieve", json={"queries": ["Johnny Depp"], "topk": 2})
    hits = response.json()["result"][0]
    assert len(hits) == 2 and set(hits[0]) == {"id", "contents"}


def test_health(server_url):
    body = requests.get(f"{server_url}/health").json()
    assert body["status"] == "ok" and body["retriever"] == "BM25Retriever"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 422, "JSON"),
        ({"topk": 3}, 422, "queries"),
        ({"queries": "a string, not a list", "topk": 3}, 422, "queries"),
        ({"queries": ["x"], "topk": 0}, 422, "topk"),
        ({"queries": ["x"], "topk": 21}, 422, "topk"),
        ({"queries": ["x"] * 9, "topk": 3}, 413, "at most 8"),
        ({"queries": ["x" * 5000], "topk": 3}, 422, "longer than"),
        (b'{"queries": ["x"], "topk": NaN}', 422, "nan"),  # JSON has no NaN: the echo of it must still render
        (b'{"queries": ["x"], "topk": Infinity}', 422, "inf"),
        (b'{"queries": ["x"], "topk": 2.5}', 422, "topk"),
    ],
)
def test_bad_requests_get_4xx_with_a_message(server_url, body, status, message):
    if isinstance(body, bytes):
        response = requests.post(f"{server_url}/retrieve", data=body, headers={"content-type": "application/json"})
    else:
        response = requests.post(f"{server_url}/retrieve", json=body)
    assert response.status_code == status
    assert message in response.text


def test_http_retriever_matches_the_index(server_url, bm25_small, check_retriever):
    from retrievers.http import HTTPRetriever

    client = HTTPRetriever(server_url, timeout=10, retries=1, max_batch=4)
    check_retriever(client, [f"{t} history" for t in bm25_small.corpus.titles[:3]], 4)
    queries = [f"{t} history" for t in bm25_small.corpus.titles[:10]]  # 10 > max_batch: split into 3 requests
    remote = client.batch_search(queries, 4)
    local = bm25_small.batch_search(queries, 4)
    assert [[(p.doc_id, p.title, p.text) for p in ps] for ps in remote] == [
        [(p.doc_id, p.title, p.text) for p in ps] for ps in local
    ]
    assert [p.doc_id for p in client.search(queries[0], 2)] == [p.doc_id for p in remote[0][:2]]
    with pytest.raises(RuntimeError, match="topk"):
        client.search("x", 50)  # over the server's max_topk: a 4xx is not retried
    client.close()


def test_http_retriever_probes_servers_without_health(bm25_small, serve_app):
    """Search-R1's own server has no /health: the client falls back to a one-query /retrieve probe."""
    from retrievers.http import HTTPRetriever
    from retrievers.server import create_app

    app = create_app(bm25_small)
    app.router.routes = [route for route in app.router.routes if getattr(route, "path", "") != "/health"]
    url, stop = serve_app(app)
    assert requests.get(f"{url}/health").status_code == 404
    assert HTTPRetriever(url).search("Ed Wood", 1)[0].doc_id == bm25_small.search("Ed Wood", 1)[0].doc_id
    stop()


def test_http_retriever_fails_fast_with_a_hint():
    from retrievers.http import HTTPRetriever

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="python -m retrievers.server"):
        HTTPRetriever(f"http://127.0.0.1:{free_port()}", timeout=2, retries=1, backoff=0.1)
    assert time.monotonic() - start < 10


def test_lone_surrogate_is_cleaned_and_served(server_url, bm25_small):
    """A query holding a lone UTF-16 surrogate (valid JSON, invalid Unicode) used to be a 500."""
    body = b'{"queries": ["Ed Wood\\ud800 film Tim Burton"], "topk": 3, "return_scores": true}'
    response = requests.post(f"{server_url}/retrieve", data=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    expected = [p.doc_id for p in bm25_small.search("Ed Wood film Tim Burton", 3)]
    assert [hit["document"]["id"] for hit in response.json()["result"][0]] == expected
    assert [p.doc_id for p in bm25_small.search("Ed Wood\ud800 film Tim Burton", 3)] == expected  # in process too

    from retrievers.http import HTTPRetriever

    client = HTTPRetriever(server_url, timeout=10, retries=0)
    assert [p.doc_id for p in client.search("Ed Wood\ud800 film Tim Burton", 3)] == expected
    client.close()


def test_query_over_lucenes_clause_limit_is_a_4xx_with_a_message(server_url, bm25_small):
    """Lucene refuses queries of more than 1,024 distinct terms ("queryCount = 1 is not equal to ...": a 500)."""
    from retrievers.base import QueryError
    from retrievers.http import HTTPRetriever

    assert len(MANY_TERMS) <= 4096
    response = requests.post(f"{server_url}/retrieve", json={"queries": ["Ed Wood", MANY_TERMS], "topk": 3})
    assert response.status_code == 422
    assert "query 1 has" in response.text and "distinct terms, over Lucene's limit of 1024" in response.text
    with pytest.raises(QueryError, match="distinct terms"):
        bm25_small.search(MANY_TERMS, 3)
    client = HTTPRetriever(server_url, timeout=10, retries=2)
    with pytest.raises(RuntimeError, match="distinct terms") as raised:
        client.search(MANY_TERMS, 3)
    assert "python -m retrievers.server" not in str(raised.value)  # the server is there: no "start one" hint
    assert client.search("Ed Wood", 1)  # and it still serves
    client.close()


def test_chunked_body_over_the_limit_is_refused_while_reading(bm25_small, serve_app):
    """A chunked body has no Content-Length: the limit must hold as the bytes arrive, not after the whole body."""
    from retrievers.server import create_app

    url, stop = serve_app(create_app(bm25_small, max_body_bytes=1024))
    over = requests.post(f"{url}/retrieve", json={"queries": ["x" * 2000], "topk": 1})
    assert over.status_code == 413 and "over 1024 bytes" in over.text  # Content-Length: refused before reading
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = (
            "POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        chunk = b'{"queries": ["' + b"a" * 500
        for piece in (chunk, b"a" * 512, b"a" * 512):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        # the body never ends (no last chunk): only a server that counts as it reads can answer now
        reply = b""
        while b"}" not in reply and (piece := sock.recv(4096)):
            reply += piece
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "over 1024 bytes" in reply
    stop()


def test_passages_per_request_are_capped_and_the_client_splits_to_fit(server_url, bm25_small):
    from retrievers.http import HTTPRetriever

    queries = [f"{t} history" for t in bm25_small.corpus.titles[:8]]
    response = requests.post(f"{server_url}/retrieve", json={"queries": queries, "topk": 20})
    assert response.status_code == 413 and "20 x 8 = 160 passages, over the limit of 60" in response.text
    assert requests.get(f"{server_url}/health").json()["max_hits"] == 60
    client = HTTPRetriever(server_url, timeout=10, retries=0)
    assert client.max_hits == 60 and client.max_batch == 8
    remote = client.batch_search(queries, 20)  # 3 queries (60 passages) per request
    assert [[p.doc_id for p in ps] for ps in remote] == [
        [p.doc_id for p in ps] for ps in bm25_small.batch_search(queries, 20)
    ]
    client.close()


def test_the_jvm_heap_is_bounded(bm25_small, monkeypatch):
    from jnius import autoclass

    from retrievers.jvm import jvm_heap

    heap = jvm_heap()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    bound = int(heap.rstrip("kKmMgG")) * units.get(heap[-1].lower(), 1)
    assert autoclass("java.lang.Runtime").getRuntime().maxMemory() <= bound
    monkeypatch.setenv("REDCODA_JVM_HEAP", "lots")
    with pytest.raises(ValueError, match="REDCODA_JVM_HEAP"):
        jvm_heap()


@pytest.mark.slow
def test_server_command_line(tmp_path):
    """`python -m retrievers.server` as a user runs it (BM25 over the bundled corpus), in a subprocess."""
    import os
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "REDCODA_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "retrievers.server", "--kind", "bm25", "--port", str(port), "--cache-size", "64"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        from retrievers.http import HTTPRetriever

        deadline = time.monotonic() + 120
        while True:
            try:
                client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=5, retries=0)
                break
            except ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(1)
        hits = client.search("What citizen was the author of Bimbos of the Death Sun?", 5)
        assert "Bimbos of the Death Sun" in {p.title for p in hits}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_quieted_http_clients_log_no_line_per_search(server_url, caplog):
    """Under a root logger at INFO, httpx logs each request; after `quiet_http_logs` a search logs nothing."""
    import logging

    import httpx

    from algos.run.logs import QUIET_LOGGERS, BelowWarning, quiet_http_logs

    body = {"queries": ["Ed Wood"], "topk": 2, "return_scores": True}
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for name in QUIET_LOGGERS:  # as in a fresh process (an earlier in-process run may have quieted them already)
        logging.getLogger(name).setLevel(logging.NOTSET)
    for handler in [*logging.getLogger().handlers, caplog.handler]:  # and its filter on pytest's own handlers
        for dropped in [f for f in handler.filters if isinstance(f, BelowWarning)]:
            handler.removeFilter(dropped)
    caplog.set_level(logging.INFO)
    try:
        httpx.post(f"{server_url}/retrieve", json=body, timeout=30).raise_for_status()
        assert any(r.name == "httpx" and r.levelno == logging.INFO for r in caplog.records)  # what we quiet
        caplog.clear()
        quiet_http_logs()
        assert httpx.post(f"{server_url}/retrieve", json=body, timeout=30).json()["result"][0]
        assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
