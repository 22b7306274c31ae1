"""Merge a trained peft LoRA adapter into its base model and save a plain Hugging Face model directory.

The result loads anywhere a full model does (`agents.models.load_model(OUT)`, vLLM, the HF sampler) with
no peft at inference time:

    python -m algos.merge_lora --adapter runs/lora-step480 --out models/merged              # bundled SmolLM2
    python -m algos.merge_lora --base HuggingFaceTB/SmolLM2-360M-Instruct --adapter DIR --out DIR

The base is loaded with `agents.models.load_model` (None: the bundled SmolLM2-135M-Instruct; a local
directory; a .gguf file; or a hub id), on CPU in float32 by default so the merge itself is exact. The
tokenizer comes from the adapter directory when the trainer saved one there, else from the base. The output
is written to a temporary sibling directory and renamed into place, so a failed merge leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeConfig:
    """Merge a peft LoRA adapter into its base model."""

    adapter: str
    """Directory of the trained adapter (adapter_config.json and adapter weights, as peft saves them)."""
    out: str
    """Directory to write the merged model and tokenizer to."""
    base: str | None = None
    """Base model: None for the bundled SmolLM2-135M-Instruct, a local directory or .gguf file, or a hub id."""
    dtype: str = "float32"
    """Dtype to load the base in, merge in and save in (float32, bfloat16, float16)."""
    device: str = "cpu"
    """Device to merge on."""
    overwrite: bool = False
    """Replace `out` when it already exists and is not empty."""


def merge_lora(config: MergeConfig) -> Path:
    """Load the base, apply the adapter, merge it into the weights and save model and tokenizer to `config.out`.

    Returns:
        The output directory.

    Raises:
        FileNotFoundError: the adapter directory has no adapter_config.json.
        FileExistsError: `out` exists and is not empty, and `overwrite` is False.
        ValueError: the adapter adapts the input or output embeddings of a model that ties them (merging
            would change both).
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoTokenizer

    from agents.models import fix_pad_token, load_model

    adapter, out = Path(config.adapter).expanduser(), Path(config.out).expanduser()
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no peft adapter at {adapter}: expected adapter_config.json (peft's save_pretrained)")
    if out.exists() and any(out.iterdir()) and not config.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    trained_on = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    logger.info("merging %s (trained on %s) into %s", adapter, trained_on, config.base or "the bundled SmolLM2")

    model, tokenizer = load_model(config.base, dtype=config.dtype, device=config.device)
    peft_model = PeftModel.from_pretrained(model, str(adapter))
    adapted = [name for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)]
    if getattr(model.config, "tie_word_embeddings", False) and any(
        name.endswith(("lm_head", "embed_tokens")) for name in adapted
    ):
        raise ValueError(
            "the adapter adapts the embeddings or lm_head of a model whose input and output embeddings are tied; "
            "merging would change both. Train the adapter on the other modules, or untie the embeddings first"
        )
    merged = peft_model.merge_and_unload(safe_merge=True)
    if (adapter / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    fix_pad_token(merged, tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("saved the merged model to %s", out)
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    """Command line entry point: `python -m algos.merge_lora --help`."""
    import tyro

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = tyro.cli(MergeConfig, args=argv, prog="python -m algos.merge_lora", description=__doc__.splitlines()[0])
    out = merge_lora(config)
    print(f"merged model saved to {out}")
    return out


if __name__ == "__main__":
    main()
