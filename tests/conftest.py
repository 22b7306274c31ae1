"""Shared fixtures. Tests are hermetic: bundled data, indexes built locally, no network."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Indexes and converted models are cached inside the checkout (git-ignored), never in a user's home.
os.environ.setdefault("REDCODA_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def share_of_the_cores():
    """Under pytest-xdist (`-n`), each worker gives torch its share of the cores: N workers at torch's default of
    one thread per core would each spin on every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session")
def hotpot_corpus():
    """The bundled 17,645-paragraph HotpotQA corpus."""
    from envs.rag_env import dataset_corpus

    return dataset_corpus("hotpotqa")


@pytest.fixture(scope="session")
def bm25(hotpot_corpus):
    """The shared real Lucene BM25 index over the bundled corpus (built once, cached on disk)."""
    from retrievers.bm25 import BM25Retriever

    return BM25Retriever.for_corpus(hotpot_corpus)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from more threads; on a busy CPU their spin-waits cost seconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): a 2-layer Llama over the real SmolLM2 vocabulary, seeded."""
    from agents.models import tiny_model

    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def serve_app():
    """Serve apps with a real uvicorn server, each in a thread on a free 127.0.0.1 port.

    Returns ``start(app) -> (url, stop)``; ``stop()`` shuts that server down (bounded wait), and servers still
    running are stopped at the end of the session.
    """
    import uvicorn

    stops = []

    def start(app):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

        def stop() -> None:
            server.should_exit = True
            thread.join(timeout=10)

        stops.append(stop)
        return f"http://127.0.0.1:{port}", stop

    yield start
    for stop in stops:
        stop()


def _check_retriever(retriever, queries: list[str], k: int) -> None:
    """`retriever` keeps the Retriever contract, not only its method names: each search returns at most `k`
    distinct Passages, best first, and batch_search returns what search does, query by query."""
    from retrievers.base import Passage

    batch = retriever.batch_search(queries, k)
    assert len(batch) == len(queries)
    for query, hits in zip(queries, batch, strict=True):
        single = retriever.search(query, k)
        assert 0 < len(single) <= k and all(isinstance(p, Passage) for p in single)
        assert len({p.doc_id for p in single}) == len(single)
        assert all(a.score >= b.score for a, b in itertools.pairwise(single)), "best first"
        assert [p.doc_id for p in hits] == [p.doc_id for p in single]


def _check_sampler(sampler, prompt: list[int]) -> None:
    """`sampler` keeps the Sampler contract, not only its method names: one Completion per prompt, whose token
    ids and log-probs align, within max_new_tokens, decoded by the sampler's tokenizer."""
    from agents.records import Completion, SamplingParams

    assert sampler.max_context > len(prompt)
    [completion] = sampler.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0))
    assert isinstance(completion, Completion) and completion.finish_reason in ("stop", "length")
    assert 0 < len(completion.token_ids) <= 4 and len(completion.logprobs) == len(completion.token_ids)
    assert completion.text.startswith(sampler.tokenizer.decode(completion.token_ids[:1], skip_special_tokens=True))


@pytest.fixture
def check_retriever():
    """Checks a retriever against the Retriever contract (see `_check_retriever`)."""
    return _check_retriever


@pytest.fixture
def check_sampler():
    """Checks a sampler against the Sampler contract (see `_check_sampler`)."""
    return _check_sampler
