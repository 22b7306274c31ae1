"""The retrieval server and HTTP client, over a real Lucene index, on loopback.

A real uvicorn server runs in a thread on a free 127.0.0.1 port and is sent requests shaped exactly as
Search-R1's trainer sends them.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from retrievers.base import Retriever
from retrievers.corpus import Corpus

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "envs" / "data" / "hotpotqa" / "corpus.jsonl.gz"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(app) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free loopback port; yield its URL; stop it (bounded)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


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
def server_url(bm25_small) -> Iterator[str]:
    from retrievers.server import create_app

    yield from serve(create_app(bm25_small, max_topk=20, max_batch=8))


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
    ],
)
def test_bad_requests_get_4xx_with_a_message(server_url, body, status, message):
    if isinstance(body, bytes):
        response = requests.post(f"{server_url}/retrieve", data=body, headers={"content-type": "application/json"})
    else:
        response = requests.post(f"{server_url}/retrieve", json=body)
    assert response.status_code == status
    assert message in response.text


def test_http_retriever_matches_the_index(server_url, bm25_small):
    from retrievers.http import HTTPRetriever

    client = HTTPRetriever(server_url, timeout=10, retries=1, max_batch=4)
    assert isinstance(client, Retriever)
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


def test_http_retriever_probes_servers_without_health(bm25_small):
    """Search-R1's own server has no /health: the client falls back to a one-query /retrieve probe."""
    from retrievers.http import HTTPRetriever
    from retrievers.server import create_app

    app = create_app(bm25_small)
    app.router.routes = [route for route in app.router.routes if getattr(route, "path", "") != "/health"]
    for url in serve(app):
        assert requests.get(f"{url}/health").status_code == 404
        assert HTTPRetriever(url).search("Ed Wood", 1)[0].doc_id == bm25_small.search("Ed Wood", 1)[0].doc_id


def test_http_retriever_fails_fast_with_a_hint():
    from retrievers.http import HTTPRetriever

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="python -m retrievers.server"):
        HTTPRetriever(f"http://127.0.0.1:{free_port()}", timeout=2, retries=1, backoff=0.1)
    assert time.monotonic() - start < 10


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
