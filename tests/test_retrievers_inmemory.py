"""The in-memory BM25 leaves JAX alone: bm25s starts JAX's backend at import where JAX is installed, and on a GPU
JAX then takes most of its memory. A stand-in `jax` package on the path records whether its `lax.top_k` ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, fake: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}
    )


def _fake_jax(tmp_path: Path) -> Path:
    package = tmp_path / "site" / "jax"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    marker = tmp_path / "started"
    (package / "lax.py").write_text(
        textwrap.dedent(f"""
            def top_k(values, k):
                open({str(marker)!r}, "w").close()  # a real JAX starts its backend (and takes GPU memory) here
                return values[:k], list(range(k))
        """)
    )
    return package.parent


def test_importing_the_retriever_does_not_start_jax(tmp_path):
    fake = _fake_jax(tmp_path)
    marker = tmp_path / "started"

    plain = _python("import bm25s", fake)
    assert plain.returncode == 0, plain.stderr
    assert marker.exists(), "the stand-in is not what bm25s imports: this test would prove nothing"
    marker.unlink()

    code = """
import sys
from retrievers.inmemory import InMemoryBM25
assert "jax" not in sys.modules, "jax was left imported"
hits = InMemoryBM25([("d1", "Paris", "Paris is the capital of France"), ("d2", "Rome", "Rome is in Italy")]).search(
    "capital of France", 1)
assert [h.doc_id for h in hits] == ["d1"], hits
import jax.lax  # still importable afterwards, by the user's own code
print("ok")
"""
    ours = _python(code, fake)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.strip() == "ok"
    assert not marker.exists()


def test_a_jax_imported_before_is_kept(tmp_path):
    """A user who imported JAX first keeps their module objects, and bm25s still does not run its top-k."""
    fake = _fake_jax(tmp_path)
    code = """
import sys
import jax, jax.lax
before = sys.modules["jax"], sys.modules["jax.lax"]
import retrievers.inmemory
assert (sys.modules["jax"], sys.modules["jax.lax"]) == before
print("ok")
"""
    done = _python(code, fake)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert not (tmp_path / "started").exists()
