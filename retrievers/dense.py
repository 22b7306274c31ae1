"""Dense retrieval on FAISS: exact inner product over L2-normalized vectors, HNSW as an option, GPU when possible.

Passages are embedded once (see `retrievers.encoders`), stored as fp16, and cached with their FAISS index
under `cache_root()/dense/<corpus fingerprint>-<encoder key>/`. For the bundled HotpotQA corpus and the
default encoder the embeddings ship in `retrievers/data/` (made on a GPU; a CPU re-encode matches to fp16
rounding), so the first `DenseRetriever` over it takes seconds instead of ~17 CPU-minutes::

    from retrievers.corpus import Corpus
    from retrievers.dense import DenseRetriever
    dense = DenseRetriever.for_corpus(Corpus.from_jsonl("envs/data/hotpotqa/corpus.jsonl.gz"))
    dense.search("Which band released Parklife?", k=3)

An existing FAISS index over the corpus rows, in corpus order (a Search-R1 `e5_Flat.index`, or a directory
written by `python -m retrievers.build_index --kind dense`), is loaded with `index=PATH`. FAISS ids of -1
(fewer hits than k) are dropped, never returned.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

try:
    import faiss
except ImportError as err:
    raise ImportError(
        "dense retrieval needs faiss: pip install 'redcoda[dense]' (or faiss-gpu: 'redcoda[gpu]')"
    ) from err

from retrievers.base import Passage, SharedIndex
from retrievers.corpus import Corpus, cache_root
from retrievers.encoders import HFEncoder
from retrievers.files import atomic_file

BUNDLED_DIR = Path(__file__).resolve().parent / "data"
INDEX_KINDS = ("flat", "hnsw")
_SHARED: dict[tuple, DenseRetriever] = {}
_SHARED_LOCK = threading.Lock()


def gpu_available() -> bool:
    """True when this faiss build has GPU support and sees a CUDA device."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def new_index(dim: int, hnsw_m: int = 0, ef_construction: int = 200) -> faiss.Index:
    """An empty inner-product index: exact `IndexFlatIP` when `hnsw_m` is 0, else `IndexHNSWFlat(M=hnsw_m)`."""
    if hnsw_m <= 0:
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    return index


def bundled_embeddings(fingerprint: str, encoder_key: str) -> Path | None:
    """The shipped fp16 embeddings of this corpus and encoder (`retrievers/data/*/embeddings.npy`), if any."""
    for meta_path in sorted(BUNDLED_DIR.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("corpus_fingerprint") == fingerprint and meta.get("encoder_key") == encoder_key:
            return meta_path.parent / "embeddings.npy"
    return None


def _save_atomic(path: Path, write) -> None:
    """Call `write(tmp_path)` and rename the result to `path`, so readers never see a partial file."""
    with atomic_file(path) as tmp:
        write(str(tmp))


class DenseRetriever(SharedIndex):
    """Top-k passages by cosine similarity of encoder embeddings, searched with FAISS.

    Args:
        corpus: the paragraphs; FAISS row i is corpus row i.
        encoder: an `HFEncoder`, a model id/dir for one (no prefixes), or None for all-MiniLM-L6-v2.
        index: an existing FAISS index file or `build_index` directory over `corpus`; built and cached if None.
        kind: "flat" (exact `IndexFlatIP`) or "hnsw" (`IndexHNSWFlat`, approximate, faster on big corpora);
            ignored when `index` is given (the file decides).
        hnsw_m: HNSW graph degree M.
        ef_construction: HNSW build-time beam width.
        ef_search: HNSW search-time beam width (raised to k when k is larger).
        use_gpu: move a flat index to the GPU; None means "when faiss has GPU support and CUDA exists".

    Raises:
        ValueError: when a given index does not match the corpus size or the encoder's dimension.

    Threads: torch and FAISS use all cores for every query. On a CPU shared with other busy processes their
    OpenMP spin-waits make one-query calls 20-40x slower (measured: 1.2 s vs 33 ms per query on 2 shared
    cores); call `torch.set_num_threads(1)` and `faiss.omp_set_num_threads(1)` there.
    """

    def __init__(
        self,
        corpus: Corpus,
        encoder: HFEncoder | str | None = None,
        *,
        index: str | os.PathLike | None = None,
        kind: str = "flat",
        hnsw_m: int = 32,
        ef_construction: int = 200,
        ef_search: int = 128,
        use_gpu: bool | None = None,
    ) -> None:
        if kind not in INDEX_KINDS:
            raise ValueError(f"kind must be one of {INDEX_KINDS}, got {kind!r}")
        self.corpus = corpus
        self.encoder = encoder if isinstance(encoder, HFEncoder) else HFEncoder(encoder or "all-MiniLM-L6-v2")
        self.kind = kind
        self.ef_search = ef_search
        self.cache_dir = cache_root() / "dense" / f"{corpus.fingerprint}-{self.encoder.key}"
        self.build_seconds = 0.0
        """Seconds spent encoding and indexing in this constructor (0 when everything came from disk)."""
        if index is not None:
            self.index = self._load_index(Path(index))
        else:
            name = "index-flat.faiss" if kind == "flat" else f"index-hnsw{hnsw_m}-efc{ef_construction}.faiss"
            self.index_path = self.cache_dir / name
            if self.index_path.exists():
                self.index = faiss.read_index(str(self.index_path))
            else:
                vectors = self.embeddings().astype(np.float32)  # adds its own encoding time, if any
                start = time.perf_counter()
                self.index = new_index(self.encoder.dim, hnsw_m if kind == "hnsw" else 0, ef_construction)
                self.index.add(vectors)
                self.build_seconds += time.perf_counter() - start
                _save_atomic(self.index_path, lambda tmp: faiss.write_index(self.index, tmp))
        if self.index.ntotal != len(corpus):
            raise ValueError(f"the FAISS index holds {self.index.ntotal} vectors but the corpus {len(corpus)} rows")
        if self.index.d != self.encoder.dim:
            raise ValueError(f"the FAISS index has dimension {self.index.d}, the encoder {self.encoder.dim}")
        self._hnsw = isinstance(self.index, faiss.IndexHNSW)
        if use_gpu is None:
            use_gpu = gpu_available() and not self._hnsw
        if use_gpu:
            self._to_gpu()

    @classmethod
    def for_corpus(cls, corpus: Corpus, kind: str = "flat") -> DenseRetriever:
        """The process-wide shared retriever (default encoder) for this corpus: one index for all envs."""
        key = (corpus.fingerprint, kind)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls(corpus, kind=kind)
            return _SHARED[key]

    def embeddings(self) -> np.ndarray:
        """The corpus embeddings, (len(corpus), dim) fp16: from the cache, the bundled file, or encoded now."""
        path = self.cache_dir / "embeddings.npy"
        if path.exists():
            return np.load(path)
        bundled = bundled_embeddings(self.corpus.fingerprint, self.encoder.key)
        if bundled is not None:
            return np.load(bundled)
        start = time.perf_counter()
        vectors = self.encoder.encode_passages([self.corpus.contents(i) for i in range(len(self.corpus))])
        vectors = vectors.astype(np.float16)
        self.build_seconds += time.perf_counter() - start

        def write(tmp: str) -> None:
            with open(tmp, "wb") as handle:  # a handle, since np.save would append ".npy" to a bare name
                np.save(handle, vectors)

        _save_atomic(path, write)
        return vectors

    def _load_index(self, path: Path) -> faiss.Index:
        if path.is_dir():
            meta_path = path / "meta.json"
            if meta_path.exists():
                meta = json.loads(meta_path.read_text())
                if meta.get("encoder_key") not in (None, self.encoder.key):
                    raise ValueError(
                        f"index {path} was built with encoder {meta.get('encoder')!r} "
                        f"(query prefix {meta.get('query_prefix')!r}); pass the same encoder to search it"
                    )
                if meta.get("corpus_fingerprint") not in (None, self.corpus.fingerprint):
                    warnings.warn(
                        f"index {path} was built from another corpus file; rows are matched by position", stacklevel=3
                    )
            path = path / "index.faiss"
        if not path.exists():
            raise FileNotFoundError(f"no FAISS index at {path}; build one with python -m retrievers.build_index")
        self.index_path = path
        return faiss.read_index(str(path))

    def _to_gpu(self) -> None:
        if not gpu_available():
            raise RuntimeError("use_gpu=True needs faiss with GPU support (pip install faiss-gpu) and a CUDA device")
        if self._hnsw:
            raise ValueError("FAISS has no GPU HNSW; use kind='flat' on the GPU")
        self._gpu_resources = faiss.StandardGpuResources()
        self.index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, self.index)

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Passage]]:
        """Top-k passages for each row of `vectors` ((n, dim) float32, unit norm), best first."""
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, k)) if self._hnsw else None
        scores, ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k, params=params)
        corpus = self.corpus
        return [
            [
                Passage(corpus.doc_ids[i], corpus.titles[i], corpus.texts[i], float(s))
                for i, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True)
                if i >= 0  # FAISS pads with -1 when it finds fewer than k
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def search(self, query: str, k: int) -> list[Passage]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not queries:
            return []
        live = [i for i, q in enumerate(queries) if q.strip()]
        results: list[list[Passage]] = [[] for _ in queries]
        if live:
            hits = self.search_vectors(self.encoder.encode_queries([queries[i] for i in live]), k)
            for i, passages in zip(live, hits, strict=True):
                results[i] = passages
        return results
