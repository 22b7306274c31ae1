"""Build a BM25 (Lucene) or dense (FAISS) index of a Search-R1/FlashRAG corpus file, streaming it.

Memory stays bounded whatever the corpus size (wiki-18 has 21M passages): BM25 streams rows to Pyserini's
`LuceneIndexer` in batches; dense encodes chunks of rows and adds each chunk to the FAISS index before
reading the next. The output directory is written atomically (a temp directory renamed at the end)::

    python -m retrievers.build_index --corpus corpus.jsonl.gz --kind bm25 --out idx/bm25
    python -m retrievers.build_index --corpus corpus.jsonl.gz --kind dense --out idx/dense [--hnsw 32]
    python -m retrievers.build_index --corpus wiki-18.jsonl --kind dense --out idx/e5 \\
        --encoder intfloat/e5-base-v2 --query-prefix "query: " --passage-prefix "passage: " --device cuda
    python -m retrievers.build_index --corpus corpus.jsonl.gz --kind embeddings --out emb/ --device cuda

`--kind embeddings` writes only fp16 vectors (`embeddings.npy` + `meta.json`, no FAISS needed): that is how
the embeddings shipped in `retrievers/data/` are made. A dense output directory holds `index.faiss` and
`meta.json`; serve it with `python -m retrievers.server --kind dense --index DIR --corpus FILE`. An existing
Search-R1 index file (e.g. `e5_Flat.index`) needs no building: pass that file as `--index` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import NoReturn

import numpy as np
from tqdm.auto import tqdm

from retrievers.corpus import CorpusError, fingerprint_rows, iter_corpus_rows
from retrievers.files import OneLineParser, output_problem

META = "meta.json"
INDEX = "index.faiss"
EMBEDDINGS = "embeddings.npy"


def contents_of(title: str, text: str) -> str:
    """The Search-R1 `contents` form of a row: `"Title"\\ntext` (just the text when there is no title)."""
    return f'"{title}"\n{text}' if title else text


def chunks(path: str | os.PathLike, size: int) -> Iterator[list[tuple[str, str, str]]]:
    """Stream a corpus file as lists of at most `size` (doc_id, title, text) rows."""
    rows = iter_corpus_rows(path)
    while chunk := list(islice(rows, size)):
        yield chunk


def _fingerprint_file(path: str | os.PathLike) -> tuple[str, int]:
    """(fingerprint, row count) of a corpus file in one streaming pass."""
    count = 0

    def counted() -> Iterator[tuple[str, str, str]]:
        nonlocal count
        for row in iter_corpus_rows(path):
            count += 1
            yield row

    return fingerprint_rows(counted()), count


class _AtomicDir:
    """A temp directory beside `out` that becomes `out` on success and vanishes on failure."""

    def __init__(self, out: str | os.PathLike, overwrite: bool) -> None:
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} exists; pass --overwrite to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out.exists() and self.overwrite:
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)


def build_bm25(
    corpus: str | os.PathLike, out: str | os.PathLike, *, threads: int = 2, batch: int = 4096, overwrite: bool = False
) -> Path:
    """Stream `corpus` into a Lucene index at `out` (only `contents` is indexed, as Search-R1 does).

    Returns:
        The index directory; open it with `BM25Retriever(Corpus.from_jsonl(corpus), index_dir=out)`.
    """
    from retrievers.jvm import start_jvm

    start_jvm()
    from pyserini.index.lucene import LuceneIndexer

    with _AtomicDir(out, overwrite) as tmp:
        indexer = LuceneIndexer(str(tmp), threads=threads)
        with tqdm(desc="BM25 index", unit="doc") as bar:
            for chunk in chunks(corpus, batch):
                indexer.add_batch_dict([{"id": d, "contents": contents_of(t, x)} for d, t, x in chunk])
                bar.update(len(chunk))
        indexer.close()
    return Path(out)


def build_dense(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    *,
    encoder=None,
    hnsw_m: int = 0,
    ef_construction: int = 200,
    chunk: int = 16384,
    embeddings_only: bool = False,
    overwrite: bool = False,
) -> Path:
    """Encode `corpus` chunk by chunk and write a FAISS index (or only fp16 embeddings) to `out`.

    Args:
        corpus: a corpus file (`.jsonl` or `.jsonl.gz`).
        out: the output directory (created atomically).
        encoder: an `HFEncoder`; the packaged all-MiniLM-L6-v2 when None.
        hnsw_m: 0 for an exact `IndexFlatIP`, else the M of an `IndexHNSWFlat` (inner product).
        ef_construction: HNSW build-time beam width.
        chunk: rows encoded (and added to the index) at a time: bounds memory.
        embeddings_only: write `embeddings.npy` (fp16, corpus order) instead of an index; FAISS not needed.
        overwrite: replace `out` if it exists.

    Returns:
        The output directory.
    """
    from retrievers.encoders import HFEncoder

    encoder = encoder or HFEncoder()
    fingerprint, count = _fingerprint_file(corpus)  # one cheap pass: the row count sizes the output
    start = time.perf_counter()
    with _AtomicDir(out, overwrite) as tmp:
        if embeddings_only:
            store = np.lib.format.open_memmap(tmp / EMBEDDINGS, mode="w+", dtype=np.float16, shape=(count, encoder.dim))
        else:
            from retrievers.dense import new_index

            index = new_index(encoder.dim, hnsw_m, ef_construction)
        done = 0
        with tqdm(total=count, desc=f"dense {encoder.name}", unit="doc") as bar:
            for rows in chunks(corpus, chunk):
                vecs = encoder.encode_passages([contents_of(t, x) for _, t, x in rows], progress=False)
                if embeddings_only:
                    store[done : done + len(rows)] = vecs
                else:
                    index.add(vecs)
                done += len(rows)
                bar.update(len(rows))
        if embeddings_only:
            store.flush()
            del store
        else:
            import faiss

            faiss.write_index(index, str(tmp / INDEX))
        meta = {
            "format": "redcoda-dense-v1",
            "corpus_fingerprint": fingerprint,
            "count": count,
            "dim": encoder.dim,
            "encoder": encoder.name,
            "encoder_key": encoder.key,
            "query_prefix": encoder.query_prefix,
            "passage_prefix": encoder.passage_prefix,
            "max_length": encoder.max_length,
            "index": None if embeddings_only else ("hnsw" if hnsw_m else "flat"),
            "hnsw_m": hnsw_m,
            "ef_construction": ef_construction,
            "encode_seconds": round(time.perf_counter() - start, 1),
            "encode_device": encoder.device,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    return Path(out)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m retrievers.build_index", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="corpus file, JSON lines of {id, contents} (.gz ok)")
    parser.add_argument("--kind", required=True, choices=["bm25", "dense", "embeddings"])
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="bm25: indexing threads")
    parser.add_argument("--encoder", default=None, help="dense: HF hub id or model dir (default: all-MiniLM-L6-v2)")
    parser.add_argument("--encoder-name", default=None, help="dense: the model's name in metadata and cache keys")
    parser.add_argument("--query-prefix", default="", help='dense: e.g. "query: " for E5')
    parser.add_argument("--passage-prefix", default="", help='dense: e.g. "passage: " for E5')
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None, help="dense: torch device (default: cuda if available)")
    parser.add_argument("--hnsw", type=int, default=0, metavar="M", help="dense: HNSW with this M (0: exact flat)")
    parser.add_argument("--chunk", type=int, default=16384, help="dense: rows encoded per chunk")
    return parser


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the command line unbuildable, checked before the JVM starts or a model loads (None when nothing).

    For BM25 every row of the corpus is read here (a streaming pass, short beside the indexing); dense builds read
    the first row here and the rest in their counting pass, after the model loads and before any row is encoded. A
    malformed row stops the command in one line naming the file and the line, and leaves no output.
    """
    for name in ("threads", "max_length", "batch_size", "chunk"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.hnsw < 0:
        return f"--hnsw must be >= 0 (0: exact flat), got {args.hnsw}"
    if not Path(args.corpus).is_file():
        return f"--corpus: no corpus file at {args.corpus}"
    try:
        rows = sum(1 for _ in islice(iter_corpus_rows(args.corpus), None if args.kind == "bm25" else 1))
    except CorpusError as err:
        return str(err)
    if rows == 0:
        return f"{args.corpus}: the corpus file holds no rows"
    if Path(args.out).exists() and not args.overwrite:
        return f"--out {args.out} exists; pass --overwrite to replace it"
    if args.kind != "bm25" and args.device is not None:
        import torch

        try:
            torch.device(args.device)
        except RuntimeError:
            return f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
    return output_problem("--out", args.out, directory=True)


def _exit_with(message: str, status: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, check it, and build the index; bad input ends it in one line with exit status 2."""
    args = _parser().parse_args(argv)
    problem = _argument_problem(args)
    if problem is not None:
        _exit_with(problem)
    try:
        if args.kind == "bm25":
            out = build_bm25(args.corpus, args.out, threads=args.threads, overwrite=args.overwrite)
        else:
            out = build_dense(
                args.corpus,
                args.out,
                encoder=_encoder(args),
                hnsw_m=args.hnsw,
                chunk=args.chunk,
                embeddings_only=args.kind == "embeddings",
                overwrite=args.overwrite,
            )
    except CorpusError as err:  # a malformed row past the first: the message names the file and the line
        _exit_with(str(err))
    except OSError as err:  # the disk filled or went read-only mid-build: the partial output is already removed
        _exit_with(f"writing {args.out} failed ({err}); nothing was written", 1)
    print(f"wrote {out}")


def _encoder(args: argparse.Namespace):
    """The command line's passage encoder; one that cannot load ends the command in one line."""
    from retrievers.encoders import DEFAULT_ENCODER, HFEncoder

    try:
        return HFEncoder(
            args.encoder or DEFAULT_ENCODER,
            query_prefix=args.query_prefix,
            passage_prefix=args.passage_prefix,
            max_length=args.max_length,
            batch_size=args.batch_size,
            device=args.device,
            name=args.encoder_name,
        )
    except (OSError, ValueError) as err:
        _exit_with(f"--encoder: {err}")


if __name__ == "__main__":
    main()
