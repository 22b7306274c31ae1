"""Where a result comes from: the command, the code (commit and whether the tree had changes), the packages, the
machine, the hashes of the questions, corpus, index settings and model, and the seed.

    from envs.provenance import provenance
    record = provenance(seed=0, env_kwargs={"split": "dev"}, model="runs/red/final")

The trainer's summary and model card, `benchmarks.evaluate`'s eval.json and `benchmarks.compare`'s report carry
this record; `python -m benchmarks.report ingest RUN_DIR` copies it into the results store. Imports no torch: the
GPU is read from ``nvidia-smi`` where there is one. Hashes are the first 16 hex digits of SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The source tree whose commit is recorded."""
PACKAGES = ("redcoda", "torch", "transformers", "gymnasium", "numpy", "scipy", "pyserini", "faiss-cpu", "vllm")
"""The packages whose versions a record names (those installed)."""
INDEX_KEYS = ("retriever", "top_k", "max_passage_words", "observation_format", "query_cache", "encoder")
"""The env settings that decide what a search returns: hashed together as the index settings."""
MODEL_FILES = ("*.safetensors", "*.bin", "*.gguf", "config.json")
"""The files of a model directory that its hash covers."""


def digest(data: bytes) -> str:
    """First 16 hex digits of the SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()[:16]


def file_hash(path: str | os.PathLike[str]) -> str:
    """The hash of a file's bytes, read in 1 MiB pieces."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()[:16]


def value_hash(value: Any) -> str:
    """The hash of a JSON value (keys sorted), e.g. a settings dict."""
    return digest(json.dumps(value, sort_keys=True, default=str).encode())


def code_version(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the source tree (tracked files changed: dirty); both None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Installed versions of `names` (absent packages are left out)."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    """CPU model and cores, memory, OS, Python; the GPUs and driver from ``nvidia-smi`` (None without one)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        fields = ("name", "driver", "memory")
        gpu = [dict(zip(fields, (c.strip() for c in row.split(",")), strict=False)) for row in out.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpu": gpu,
    }


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def data_hashes(env_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Hashes of the question file, the corpus file and the index settings an env was built with.

    The bundled files stand for themselves when the settings name no path (``dataset``/``split``, HotpotQA's corpus).
    A file that cannot be found is recorded as None, never guessed.
    """
    from envs.data import bundled_path

    kwargs = dict(env_kwargs or {})
    dataset, split = kwargs.get("dataset", "hotpotqa"), kwargs.get("split", "train")

    def hashed(path: Any, bundled: tuple[str, str]) -> dict[str, Any]:
        try:
            file = Path(path) if path else bundled_path(*bundled)
            return {"file": str(path) if path else f"bundled:{bundled[0]}/{bundled[1]}", "hash": file_hash(file)}
        except (OSError, ValueError):
            return {"file": str(path) if path else None, "hash": None}

    return {
        "questions": hashed(kwargs.get("data_path"), (dataset, split)),
        "corpus": hashed(kwargs.get("corpus_path"), ("hotpotqa", "corpus")),
        "index_settings": {k: kwargs[k] for k in INDEX_KEYS if k in kwargs},
        "index_settings_hash": value_hash({k: kwargs.get(k) for k in INDEX_KEYS}),
    }


def model_hash(model: Any) -> dict[str, Any]:
    """``{"model", "hash"}``: a model directory's weights and config hashed; a name or an object: hash None."""
    name = model if isinstance(model, str | os.PathLike) or model is None else type(model).__name__
    path = Path(name) if isinstance(name, str | os.PathLike) and name else None
    if path is None or not path.is_dir():
        return {"model": None if name is None else str(name), "hash": None}
    files = sorted(f for pattern in MODEL_FILES for f in path.glob(pattern))
    return {"model": str(name), "hash": value_hash([[f.name, file_hash(f)] for f in files]) if files else None}


def provenance(
    *,
    seed: int | None,
    command: Sequence[str] | str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    model: Any = None,
    held_out_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The provenance record of a run or an evaluation (JSON values only).

    Args:
        seed: the run's seed.
        command: the command line (default: this process's, ``python -m ...`` as typed).
        env_kwargs: the env's settings (questions, corpus, retriever...), hashed by `data_hashes`.
        model: the model's directory or name (a directory is hashed).
        held_out_kwargs: the held-out env's settings, when they differ from `env_kwargs` (a trainer's): its question
            file's hash goes in as ``data.held_out_questions``.
    """
    if command is None:
        command = shlex.join(_this_command())
    elif not isinstance(command, str):
        command = shlex.join(command)
    data = data_hashes(env_kwargs)
    if held_out_kwargs is not None:
        data["held_out_questions"] = data_hashes(held_out_kwargs)["questions"]
    return {
        "command": command,
        "seed": seed,
        "code": code_version(),
        "packages": package_versions(),
        "machine": machine(),
        "data": data,
        "model": model_hash(model),
    }


def _this_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return ["python", *sys.argv]
