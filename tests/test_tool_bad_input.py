"""The command-line tools outside the trainers refuse bad input at start: one line, ``error: ...``, naming the setting
or the file and what is wrong, exit status 2, no traceback, nothing written, and before any JVM, model or index.

Each case runs the real command in a fresh process; `{tmp}` in an argument is the test's temporary directory, which
holds `good.jsonl` (a one-passage corpus), `bad.jsonl` (a corpus whose second line is no passage), `empty.jsonl`
and `questions.jsonl` (a data file whose row is no question)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
GOOD_ROW = {"id": "a", "contents": '"Ed Wood"\nEdward Davis Wood Jr. was an American filmmaker.'}


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD_ROW) + "\n[1, 2]\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "questions.jsonl").write_text(json.dumps({"_id": "q", "question": "Who?"}) + "\n")
    return tmp_path


def _refused(module: str, argv: list[str], tmp: Path, timeout: float = 120) -> str:
    """Run `python -m module argv` and return its one stderr line, asserting exit status 2 and no traceback."""
    command = [sys.executable, "-m", module, *(arg.format(tmp=tmp) for arg in argv)]
    done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


EXPORT = {
    "unknown split": (["--split", "nope"], "error: --split 'nope': hotpotqa has no bundled split of that name; "),
    "split of another dataset": (["--dataset", "bamboogle", "--split", "dev"], "bamboogle has no bundled split"),
    "unknown dataset": (["--dataset", "nope"], "error: argument --dataset: invalid choice: 'nope'"),
    "unknown format": (["--format", "csv"], "error: argument --format: invalid choice: 'csv'"),
    "missing data file": (["--data-path", "{tmp}/missing.jsonl"], "error: --data-path '{tmp}/missing.jsonl': no such"),
    "malformed data file": (["--data-path", "{tmp}/questions.jsonl"], "error: {tmp}/questions.jsonl: line 1: not a "),
    "empty data file": (["--data-path", "{tmp}/empty.jsonl"], "error: {tmp}/empty.jsonl holds no questions"),
    "output is a directory": (["--out", "{tmp}"], "error: --out {tmp}: is a directory; give a file name"),
    "output under a file": (["--out", "{tmp}/good.jsonl/x.jsonl"], "{tmp}/good.jsonl is a file, not a directory"),
    "output's parent cannot be made": (
        ["--out", "/proc/no-such/x.jsonl"],
        "error: --out /proc/no-such/x.jsonl: cannot",
    ),
}


@pytest.mark.parametrize("case", list(EXPORT))
def test_export_refuses_bad_input_in_one_line(case, tmp):
    argv, message = EXPORT[case]
    out = [] if "--out" in argv else ["--out", "{tmp}/out/rows.jsonl"]
    assert message.format(tmp=tmp) in _refused("envs.export", [*argv, *out], tmp)
    assert not (tmp / "out" / "rows.jsonl").exists()


ORACLE = {
    "unknown split": (["--split", "nope"], "error: --split 'nope': hotpotqa has no bundled split of that name; "),
    "unknown dataset": (["--dataset", "nope"], "error: argument --dataset: invalid choice: 'nope'"),
    "unknown protocol": (["--protocol", "tree"], "error: argument --protocol: invalid choice: 'tree'"),
    "missing data file": (["--data-path", "{tmp}/missing.jsonl"], "error: --data-path '{tmp}/missing.jsonl': no such"),
    "malformed data file": (["--data-path", "{tmp}/questions.jsonl"], "error: {tmp}/questions.jsonl: line 1: not a "),
    "limit 0": (["--limit", "0"], "error: --limit must be >= 1, got 0"),
    "limit not a number": (["--limit", "ten"], "error: argument --limit: invalid int value: 'ten'"),
    "batch 0": (["--batch", "0"], "error: --batch must be >= 1, got 0"),
    "negative quote": (["--quote-words", "-1"], "error: --quote-words must be >= 0 (0: no quote), got -1"),
    "negative seed": (["--seed", "-1"], "error: --seed must be in [0, 2**32) (NumPy's seeds), got -1"),
    "output is a directory": (["--out", "{tmp}"], "error: --out {tmp}: is a directory; give a file name"),
    "output under a file": (["--out", "{tmp}/good.jsonl/x.jsonl"], "{tmp}/good.jsonl is a file, not a directory"),
}


@pytest.mark.parametrize("case", list(ORACLE))
def test_the_oracle_refuses_bad_input_in_one_line(case, tmp):
    argv, message = ORACLE[case]
    out = [] if "--out" in argv else ["--out", "{tmp}/out/demos.jsonl"]
    assert message.format(tmp=tmp) in _refused("agents.oracle", [*argv, *out], tmp)
    assert not (tmp / "out" / "demos.jsonl").exists()


BUILD = {
    "missing corpus": (["--corpus", "{tmp}/missing.jsonl"], "error: --corpus: no corpus file at {tmp}/missing.jsonl"),
    "corpus is a directory": (["--corpus", "{tmp}"], "error: --corpus: no corpus file at {tmp}"),
    "empty corpus": (["--corpus", "{tmp}/empty.jsonl"], "error: {tmp}/empty.jsonl: the corpus file holds no rows"),
    "not a corpus": (
        ["--corpus", "{tmp}/questions.jsonl"],
        "error: {tmp}/questions.jsonl: line 1: 'id' must be a string or an integer",
    ),
    "unknown kind": (["--kind", "sparse"], "error: argument --kind: invalid choice: 'sparse'"),
    "output exists": (["--out", "{tmp}"], "error: --out {tmp} exists; pass --overwrite to replace it"),
    "output is a file": (["--out", "{tmp}/good.jsonl", "--overwrite"], "error: --out {tmp}/good.jsonl: is a file, not"),
    "output under a file": (["--out", "{tmp}/good.jsonl/idx"], "{tmp}/good.jsonl is a file, not a directory"),
    "output's parent cannot be made": (["--out", "/proc/no-such/idx"], "error: --out /proc/no-such/idx: cannot write"),
    "threads 0": (["--threads", "0"], "error: --threads must be >= 1, got 0"),
    "chunk 0": (["--chunk", "0"], "error: --chunk must be >= 1, got 0"),
    "batch size 0": (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),
    "max length 0": (["--max-length", "0"], "error: --max-length must be >= 1, got 0"),
    "negative hnsw": (["--hnsw", "-4"], "error: --hnsw must be >= 0 (0: exact flat), got -4"),
    "bad device": (["--kind", "dense", "--device", "gpu0"], "error: --device 'gpu0' is not a torch device"),
}


@pytest.mark.parametrize("case", list(BUILD))
def test_build_index_refuses_bad_input_in_one_line(case, tmp):
    argv, message = BUILD[case]
    defaults = {"--corpus": "{tmp}/good.jsonl", "--kind": "bm25", "--out": "{tmp}/idx"}
    argv = [*argv, *(item for flag, value in defaults.items() if flag not in argv for item in (flag, value))]
    assert message.format(tmp=tmp) in _refused("retrievers.build_index", argv, tmp)
    assert not (tmp / "idx").exists()


def test_a_bm25_build_reads_the_whole_corpus_before_the_jvm_starts(tmp):
    line = _refused(
        "retrievers.build_index", ["--corpus", "{tmp}/bad.jsonl", "--kind", "bm25", "--out", "{tmp}/idx"], tmp
    )
    assert line == f"error: {tmp}/bad.jsonl: line 2: expected a JSON object (one passage), got a list"
    assert not (tmp / "idx").exists()


def test_a_dense_build_stops_at_a_malformed_row_before_encoding_and_leaves_nothing(tmp):
    """The first row is checked at start; the counting pass that follows the model's loading meets the second."""
    command = [sys.executable, "-m", "retrievers.build_index", "--corpus", str(tmp / "bad.jsonl"), "--kind", "dense"]
    done = subprocess.run(
        [*command, "--out", str(tmp / "idx"), "--device", "cpu"],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {tmp}/bad.jsonl: line 2: expected a JSON object (one passage), got a list"
    ]
    assert sorted(path.name for path in tmp.iterdir()) == ["bad.jsonl", "empty.jsonl", "good.jsonl", "questions.jsonl"]


SERVER = {
    "port not a number": (["--port", "http"], "error: argument --port: invalid int value: 'http'"),
    "negative port": (["--port", "-1"], "error: --port must be in [0, 65535] (0: any free port), got -1"),
    "unknown kind": (["--kind", "sparse"], "error: argument --kind: invalid choice: 'sparse'"),
    "corpus is a directory": (["--corpus", "{tmp}"], "error: --corpus: no corpus file at {tmp}"),
    "missing bm25 index": (["--kind", "hybrid", "--bm25-index", "{tmp}/none"], "error: --bm25-index: no index at"),
    "negative cache": (["--cache-size", "-1"], "error: --cache-size must be >= 0, got -1"),
    "negative hnsw": (["--hnsw", "-1"], "error: --hnsw must be >= 0, got -1"),
    "max batch 0": (["--max-batch", "0"], "error: --max-batch must be >= 1, got 0"),
    "bad jvm heap": (["--jvm-heap", "lots"], "error: REDCODA_JVM_HEAP must be a Java heap size such as 512m or 4g"),
    "bad device": (["--kind", "dense", "--device", "gpu0"], "error: --device 'gpu0' is not a torch device"),
}


@pytest.mark.parametrize("case", list(SERVER))
def test_the_server_refuses_bad_input_in_one_line(case, tmp):
    """Beside tests/test_cli_errors.py's server cases (ports in use, missing corpus or index, topk limits)."""
    argv, message = SERVER[case]
    defaults = {"--corpus": "{tmp}/good.jsonl", "--port": "0"}
    argv = [*argv, *(item for flag, value in defaults.items() if flag not in argv for item in (flag, value))]
    assert message.format(tmp=tmp) in _refused("retrievers.server", argv, tmp, timeout=60)


def test_the_server_names_an_index_file_faiss_cannot_read(tmp):
    """Told after the query encoder loads (FAISS reads the file then), still in one line with exit status 2."""
    (tmp / "junk.index").write_text("junk\n")
    command = [sys.executable, "-m", "retrievers.server", "--kind", "dense", "--index", str(tmp / "junk.index")]
    command += ["--corpus", str(tmp / "good.jsonl"), "--device", "cpu", "--port", "0"]
    done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    errors = [line[line.index("error: ") :] for line in done.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: --index {tmp / 'junk.index'}: not a FAISS index ("), (
        errors
    )


# --- writes that fail part-way -------------------------------------------------------------------------------------
def test_an_export_whose_disk_fills_ends_in_one_line_and_keeps_the_old_file(tmp, monkeypatch, capsys):
    import errno

    from envs import export

    def fills_up(rows, path):
        Path(path).write_text('{"question": "half a ro')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp / "rows.jsonl"
    out.write_text("the old rows\n")
    monkeypatch.setattr(export, "write_rows", fills_up)
    with pytest.raises(SystemExit) as stopped:
        export.main(["--split", "dev", "--out", str(out)])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err == f"error: writing {out} failed ([Errno 28] No space left on device)\n", err
    assert out.read_text() == "the old rows\n" and not list(tmp.glob(".partial-*"))


def test_an_atomic_file_appears_whole_or_not_at_all(tmp):
    from retrievers.files import atomic_file

    out = tmp / "demos.jsonl.gz"
    with pytest.raises(RuntimeError), atomic_file(out) as partial:
        assert partial.parent == tmp and partial.name.endswith(".jsonl.gz")
        partial.write_text("half")
        raise RuntimeError("killed mid-write")
    assert not out.exists() and not list(tmp.glob(".partial-*"))
    with atomic_file(out) as partial:
        partial.write_text("whole")
    assert out.read_text() == "whole" and not list(tmp.glob(".partial-*"))
