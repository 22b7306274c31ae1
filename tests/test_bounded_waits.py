"""Waits that end: a retrieval request and an OpenAI-compatible sampler's request within their deadlines against a
server that drips its answer, and a data-parallel run whose rank waits on a stalled one within
``--dist-timeout-seconds``.

The second test launches this file under torchrun (two gloo processes, the tiny preset):

    torchrun --nproc-per-node 2 tests/test_bounded_waits.py RUN_DIR TIMEOUT_SECONDS
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DRIP_INTERVAL = 0.2
"""Seconds between the bytes of a dripped answer: each read returns long before any per-read timeout."""


class _DripHandler(http.server.BaseHTTPRequestHandler):
    """Answers GET /health at once (unless the server drips everything) and POST /retrieve one byte at a time."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # keep the test's output clean
        pass

    def _answer(self, body: bytes, drip: bool) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        answer = head.encode() + body
        try:
            if not drip:
                self.wfile.write(answer)
                return
            for i in range(len(answer)):  # the status line and headers drip too, not only the body
                if self.server.stopped:  # the test has seen what it waited for
                    self.close_connection = True
                    return
                self.wfile.write(answer[i : i + 1])
                self.wfile.flush()
                time.sleep(DRIP_INTERVAL)
        except OSError:  # the client gave up and closed the connection: what the test waits for
            self.close_connection = True

    def do_GET(self) -> None:
        self._answer(b'{"status": "ok"}', drip=self.server.drip_all)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posts.append(time.monotonic())
        # a valid answer: a client without a deadline would return it, only far too late
        self._answer(json.dumps({"result": [[]]}).encode().ljust(200), drip=True)


@pytest.fixture
def drip_server() -> Iterator[Callable[..., tuple[str, http.server.ThreadingHTTPServer]]]:
    """Start a dripping HTTP server on 127.0.0.1 in a thread: ``start(drip_all) -> (url, server)``."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(drip_all: bool = False) -> tuple[str, http.server.ThreadingHTTPServer]:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DripHandler)
        server.daemon_threads = True
        server.drip_all = drip_all
        server.posts = []
        server.stopped = False
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.stopped = True  # no handler goes on dripping into the tests that follow
        server.shutdown()
        server.server_close()


def test_a_dripping_answer_fails_at_the_deadline_and_each_retry_gets_its_own(drip_server):
    from retrievers.http import HTTPRetriever

    url, server = drip_server()
    timeout, backoff = 1.0, 0.1
    client = HTTPRetriever(url, timeout=timeout, retries=1, backoff=backoff)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as failure:
        client.search("Ed Wood", 3)
    took = time.monotonic() - start
    client.close()

    message = str(failure.value)
    assert "failed 2 time(s)" in message and "deadline of 1 s" in message and "ReadTimeout" in message
    assert len(server.posts) == 2  # the retry was sent ...
    first_try = server.posts[1] - server.posts[0] - backoff
    assert first_try >= 0.9 * timeout  # ... after the first try had its whole deadline, not a share of one
    assert 2 * 0.9 * timeout <= took < 3 * (2 * timeout + backoff)  # bounded: the dripped answer takes ~1 min per try


def test_a_dripping_health_check_fails_the_constructor_at_the_deadline(drip_server):
    from retrievers.http import HTTPRetriever

    url, _ = drip_server(drip_all=True)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no retrieval server answers .*deadline of 1 s"):
        HTTPRetriever(url, timeout=1.0, retries=0)
    assert time.monotonic() - start < 3 * 1.0


def test_an_openai_sampler_row_ends_at_its_deadline_and_counts_as_an_error(drip_server, tiny):
    """A served model that drips its answer: the row fails at the request's deadline (each retry with its own)
    instead of after the whole dripped answer, and the other rows of the batch are not held up longer."""
    from agents.records import SamplingParams
    from agents.samplers.openai_api import OpenAISampler

    url, server = drip_server()
    _, tokenizer = tiny
    timeout = 1.0
    sampler = OpenAISampler(f"{url}/v1", "served", tokenizer, timeout_s=timeout, max_retries=1)
    start = time.monotonic()
    rows = sampler.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
    took = time.monotonic() - start
    sampler.close()
    for row in rows:
        assert row.finish_reason == "error" and "deadline of 1 s" in row.error, row
    assert len(server.posts) == 4  # two rows, each tried twice
    assert 2 * 0.9 * timeout <= took < 3 * (2 * timeout + 0.5)  # the dripped answer would take about a minute
    with pytest.raises(ValueError, match="finite timeout_s"):
        OpenAISampler(f"{url}/v1", "served", tokenizer, timeout_s=float("inf"))


def test_the_openai_clients_own_timeout_does_not_end_a_dripping_answer(drip_server):
    """Why `OpenAISampler` keeps a transport of its own under the `openai` client: the client's timeout bounds each
    socket read alone, so a dripped answer holds the client long past it (a minute, here)."""
    openai = pytest.importorskip("openai")

    url, server = drip_server()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=1.0, max_retries=0)
    outcome: list[object] = []

    def ask() -> None:
        try:
            outcome.append(client.completions.create(model="served", prompt="x", max_tokens=4))
        except Exception as err:  # what the client raises once the test stops the drip
            outcome.append(err)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout=4.0)
    still_waiting = thread.is_alive() and not outcome
    server.stopped = True  # end the drip, so the client's thread ends too
    thread.join(timeout=10.0)
    client.close()
    assert still_waiting, f"the client gave up on its own after {outcome}"


class _FlakyHandler(http.server.BaseHTTPRequestHandler):
    """Answers the first POST with 503 and every later one with a completion."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posts.append(dict(self.headers))
        if len(self.server.posts) == 1:
            status, body = 503, {"error": {"message": "overloaded"}}
        else:
            choice = {"index": 0, "text": "<answer>Ed Wood", "finish_reason": "stop", "logprobs": None}
            status, body = 200, {"id": "c", "object": "text_completion", "model": "served", "choices": [choice]}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_an_openai_sampler_retries_through_the_openai_client(tiny):
    """A 503 is retried by the `openai` client itself (its retry count header on the second request), and the
    answer comes back through the sampler's deadline transport."""
    from agents.records import SamplingParams
    from agents.samplers.openai_api import OpenAISampler

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyHandler)
    server.daemon_threads, server.posts = True, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _, tokenizer = tiny
    sampler = OpenAISampler(f"http://127.0.0.1:{server.server_address[1]}/v1", "served", tokenizer, max_retries=1)
    [row] = sampler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, stop=("</answer>",)))
    sampler.close()
    server.shutdown()
    server.server_close()
    assert row.finish_reason == "stop" and row.text == "<answer>Ed Wood</answer>", row
    assert len(server.posts) == 2
    retries = [{k.lower(): v for k, v in headers.items()}.get("x-stainless-retry-count") for headers in server.posts]
    assert retries == ["0", "1"]


def test_evaluate_gives_up_on_a_dripping_served_model_at_its_sampler_timeout(drip_server, tiny, tmp_path, capsys):
    """`benchmarks.evaluate --sampler openai --sampler-timeout S`: each question's request ends at its deadline and
    counts as errored; with every question errored the evaluation fails in one line instead of waiting a minute a
    question for the dripped answers."""
    from benchmarks.evaluate import main

    url, server = drip_server()
    tiny[1].save_pretrained(tmp_path / "served")  # the tokenizer the served model is named by
    argv = ["--agent", "direct", "--model", str(tmp_path / "served"), "--served-model", "tiny", "--corpus",
            "distractor", "--sampler", "openai", "--sampler-url", f"{url}/v1", "--max-new-tokens", "8", "--limit", "2",
            "--sampler-timeout", "1", "--sampler-retries", "0"]  # fmt: skip
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    took = time.monotonic() - start
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert "2 of 2 episodes (100%)" in line and "deadline of 1 s" in line, line
    assert len(server.posts) == 2  # one request a question, no retry
    assert took < 60  # each dripped answer alone would take about a minute


@pytest.fixture(scope="module")
def server_url(serve_app, small_corpus):
    from retrievers.inmemory import InMemoryBM25
    from retrievers.server import create_app

    url, stop = serve_app(create_app(InMemoryBM25.for_corpus(small_corpus)))
    yield url
    stop()


@pytest.fixture(scope="module")
def small_corpus():
    from envs.data import load_examples
    from retrievers.corpus import Corpus

    rows = {}
    for example in load_examples("hotpotqa", "dev")[:10]:
        for title, text in example.paragraphs:
            rows.setdefault(title, text)
    return Corpus.from_passages([(f"d{i}", title, text) for i, (title, text) in enumerate(rows.items())])


def test_the_deadline_leaves_a_normal_answer_alone(server_url, small_corpus):
    """The deadline bounds the exchange, it does not cut short a server that answers: the real server, searched
    three times over one pooled connection."""
    from retrievers.http import HTTPRetriever

    titles = small_corpus.titles[:3]
    client = HTTPRetriever(server_url, timeout=10, retries=0)
    hits = [client.search(title, 2) for title in titles]
    client.close()
    assert [passages[0].title for passages in hits] == list(titles)


# --- a stalled rank ------------------------------------------------------------------------------------------------
DIST_TIMEOUT = 10.0
"""--dist-timeout-seconds of the two-process run: rank 1 sleeps far longer than this before its first collective."""
STALL = 600.0


def test_a_stalled_rank_ends_the_run_within_the_collective_timeout(tmp_path):
    """Rank 1 stops answering (it sleeps in its first step); rank 0 must not wait on in its first collective: it ends
    the run with one line naming --dist-timeout-seconds, about DIST_TIMEOUT after rank 1 stalled."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--log-dir", str(logs), "--redirects", "3"]  # each rank's stdout and stderr in its own files
    done = subprocess.run(
        [*command, __file__, str(tmp_path / "run"), str(DIST_TIMEOUT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=STALL / 2,  # a run that waited for the stalled rank would end here, failing the test
    )
    ended = time.time()
    assert done.returncode != 0
    stalled_at = float((tmp_path / "run" / "stalled_at").read_text())
    assert ended - stalled_at < 3 * DIST_TIMEOUT + 30  # the timeout, then torchrun's teardown of rank 1
    rank0_err = next(logs.rglob("0/stderr.log")).read_text()
    assert "Traceback" not in rank0_err
    last = rank0_err.strip().splitlines()[-1]
    assert last.startswith("error: a collective operation waited more than --dist-timeout-seconds 10 "), last


class _StalledRankOne:
    """A learner mixin whose rank 1 stops answering at its first training step (as a SIGSTOP would)."""

    def train_step(self):
        if self.run.world.rank == 1:
            self.run.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run.run_dir / "stalled_at").write_text(repr(time.time()))
            time.sleep(STALL)
        return super().train_step()


def _stalled_run(run_dir: str, timeout: str) -> None:
    """The tiny preset's GRPO under torchrun, through the entry points' `main`, with rank 1 stalled."""
    from algos.learners.trainer import Trainer
    from algos.registry import Algorithm, register_algorithm
    from algos.run.launch import main

    class StalledTrainer(_StalledRankOne, Trainer):
        pass

    register_algorithm(Algorithm("stalled_grpo", learner=StalledTrainer, label="GRPO with rank 1 stalled"))
    flags = ["--preset", "tiny", "--run-dir", run_dir, "--corpus", "distractor", "--eval-questions", "0"]
    main([*flags, "--dist-timeout-seconds", timeout, "--steps", "1"], algo="stalled_grpo")


if __name__ == "__main__":
    _stalled_run(*sys.argv[1:])
