"""This machine's bounds beside our figures: forward+backward FLOP/s against the fp32 matmul peak, batch-1
decode tokens/s against memory bandwidth / weight bytes, measured in one run.

    python -m benchmarks.roofline [--model smollm2-135m] [--threads 1] [--lengths 512 512] [--decode-tokens 64]

What it measures, all with the same torch thread count (`--threads`, default 1: the figures are per core):

* matmul peak: the best fp32 `torch.mm` FLOP/s over square 2048 products and the model's own projection
  shapes (1,024 token rows through its q, MLP and LM-head weights).
* memory bandwidth: the best read rate of a 512 MiB `sum` (decode streams the weights once per step).
* forward+backward: one micro-batch of `--lengths` rows of real tokens (no padding), the training model's
  forward, cross-entropy and backward, as `benchmarks.train_step`'s bare pass does; its useful FLOPs
  (`train_flops`: 6 per linear weight per token, plus causal attention) per second, as a share of the
  matmul peak (target >= 0.5).
* batch-1 decode: `HFSampler` sampling one row (temperature 1, no stop) from a 128-token prompt; decode tokens/s
  from the difference of a `--decode-tokens` + 1 and a 1-token generation, as a share of bandwidth / weight
  bytes (target >= 0.5): every decode step must read every weight once. Three times: as the trainer's sampler
  runs on a CPU (`decode="auto"`: static steps, `agents.samplers.static_decode`, few-row products as W @ x^T),
  the model's own forward over a dynamic cache (`agents.samplers.hf`, few-row layers as W @ x^T), and the
  dynamic cache with `narrow_rows=0` (every layer `F.linear`).
* the rate at which the model's own linear layers stream their weights with 1, 2, 8 and 32 token rows, as
  `F.linear` (x @ W^T) and as W @ x^T (one row doubled, as the sampler does): the BLAS's bound on a decode step.

CPU only: on a GPU the shares would need the device's own peak and bandwidth, which this script does not measure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.timing import best_seconds

TRAIN_SHARE_TARGET = 0.5
DECODE_SHARE_TARGET = 0.5


def matmul_peak(model: torch.nn.Module | None = None, repeats: int = 3) -> dict[str, float]:
    """Best fp32 matmul FLOP/s: square 2048 products and, given a model, its own projection shapes.

    Returns:
        GFLOP/s by shape name, and ``peak`` (their maximum) in FLOP/s.
    """
    shapes = {"square 2048": (2048, 2048, 2048)}
    if model is not None:
        config = model.config
        hidden, inner = config.hidden_size, config.intermediate_size
        shapes.update(
            {
                f"1024 x {hidden} x {hidden}": (1024, hidden, hidden),
                f"1024 x {hidden} x {inner}": (1024, hidden, inner),
                f"1024 x {inner} x {hidden}": (1024, inner, hidden),
                f"1024 x {hidden} x {config.vocab_size}": (1024, hidden, config.vocab_size),
            }
        )
    out: dict[str, float] = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        out[name] = 2 * m * k * n / best_seconds(lambda a=a, b=b: a @ b, repeats, warmup=True) / 1e9
    out["peak"] = max(out.values()) * 1e9
    return out


def memory_bandwidth(mib: int = 512, repeats: int = 3) -> float:
    """Best read bandwidth (bytes/s) of a `sum` over a `mib` MiB float32 tensor (far bigger than any cache)."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), repeats, warmup=True)


def linear_read_rate(model: torch.nn.Module, rows: int, repeats: int = 3, narrow: bool = False) -> float:
    """Bytes/s at which the model's own linear layers stream their weights for `rows` token rows (a decode step's
    matmuls: each weight is read once per step, whatever the number of rows): as `F.linear`, or with `narrow`
    as W @ x^T with one row doubled (the sampler's few-row form)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    if narrow:
        inputs = {k: (torch.cat((x, x)) if rows == 1 else x).t() for k, x in inputs.items()}
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def step() -> None:
        with torch.inference_mode():
            for m in linears:
                if narrow:
                    torch.mm(m.weight, inputs[m.in_features])
                else:
                    F.linear(inputs[m.in_features], m.weight)

    return nbytes / best_seconds(step, repeats, warmup=True)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, tied weights counted once (what a decode step reads)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def train_flops(model: torch.nn.Module, lengths: Sequence[int], head_positions: int | None = None) -> float:
    """Useful FLOPs of one forward+backward over rows of real `lengths` (padding is not useful work).

    Linear layers cost 2 FLOPs per weight per token forward and 4 backward (input and weight gradients);
    causal attention 2 x L^2 x (heads x head_dim) per layer forward (scores and values, half the square), twice
    that backward. The LM head runs on every position, or on `head_positions` positions in all (the
    trainer's masked head).

    Args:
        model: A Hugging Face causal LM whose linear layers are `torch.nn.Linear`.
        lengths: Real length of each row.
        head_positions: Positions the LM head runs on; None: every token.
    """
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    tokens = sum(lengths)
    config = model.config
    attention_width = config.num_attention_heads * getattr(
        config, "head_dim", config.hidden_size // config.num_attention_heads
    )
    attention = 6 * config.num_hidden_layers * attention_width * sum(length * length for length in lengths)
    positions = tokens if head_positions is None else head_positions
    return 6 * body * tokens + 6 * head.weight.numel() * positions + attention


def forward_backward_seconds(model: torch.nn.Module, lengths: Sequence[int], repeats: int = 2) -> float:
    """Best time of forward + cross-entropy + backward over one micro-batch of unpadded random-token rows.

    Rows of unequal length are run one micro-batch each (no padding), like `micro_batches` groups them.
    """
    generator = torch.Generator().manual_seed(0)
    groups: dict[int, list[torch.Tensor]] = {}
    for length in lengths:
        groups.setdefault(length, []).append(torch.randint(0, model.config.vocab_size, (length,), generator=generator))
    batches = [torch.stack(rows) for rows in groups.values()]
    model.train()

    def step() -> None:
        for ids in batches:
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    try:
        return best_seconds(step, repeats, warmup=True)
    finally:
        model.eval()


def decode_tokens_per_s(
    model: torch.nn.Module,
    tokenizer: Any,
    new_tokens: int = 64,
    repeats: int = 3,
    narrow_rows: int | None = None,
    decode: str = "auto",
) -> float:
    """Batch-1 decode tokens/s of `HFSampler` (temperature 1, no stop), prefill excluded; `narrow_rows` and
    `decode` as the sampler takes them (narrow_rows None: its default; 0: every linear layer through `F.linear`)."""
    from agents.records import SamplingParams
    from agents.samplers.hf import HFSampler

    sampler = HFSampler(model, tokenizer, stop_token_ids=[], cache_tokens=0, narrow_rows=narrow_rows, decode=decode)
    prompt = torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(n: int) -> Callable[[], Any]:
        return lambda: sampler.generate([prompt], SamplingParams(max_new_tokens=n, temperature=1.0, seed=0))

    prefill = best_seconds(run(1), repeats, warmup=True)
    whole = best_seconds(run(new_tokens + 1), repeats, warmup=True)
    return new_tokens / (whole - prefill)


def run(
    model_name: str | None = None, lengths: Sequence[int] = (512, 512), decode_tokens: int = 64, repeats: int = 3
) -> dict[str, Any]:
    """Measure the bounds and our figures; return them with the shares."""
    from agents.models import load_model

    model, tokenizer = load_model(model_name)
    model.eval()
    peak = matmul_peak(model, repeats)
    bandwidth = memory_bandwidth(repeats=repeats)
    seconds = forward_backward_seconds(model, lengths, repeats=max(1, repeats - 1))
    flops = train_flops(model, lengths)
    decode = decode_tokens_per_s(model, tokenizer, decode_tokens, repeats)
    decode_dynamic = decode_tokens_per_s(model, tokenizer, decode_tokens, repeats, decode="dynamic")
    decode_f_linear = decode_tokens_per_s(model, tokenizer, decode_tokens, repeats, narrow_rows=0, decode="dynamic")
    weights = weight_bytes(model)
    decode_bound = bandwidth / weights
    linear_rates = {rows: linear_read_rate(model, rows, repeats) for rows in (1, 2, 8, 32)}
    narrow_rates = {rows: linear_read_rate(model, rows, repeats, narrow=True) for rows in (1, 2, 8, 32)}
    return {
        "model": model_name or "smollm2-135m",
        "threads": torch.get_num_threads(),
        "matmul_gflops": {k: v for k, v in peak.items() if k != "peak"},
        "matmul_peak_flops": peak["peak"],
        "read_bandwidth_bytes_per_s": bandwidth,
        "lengths": list(lengths),
        "fwd_bwd_seconds": seconds,
        "fwd_bwd_tokens_per_s": sum(lengths) / seconds,
        "fwd_bwd_flops_per_s": flops / seconds,
        "fwd_bwd_share_of_peak": flops / seconds / peak["peak"],
        "weight_bytes": weights,
        "decode_tokens_per_s": decode,
        "decode_bound_tokens_per_s": decode_bound,
        "decode_share_of_bound": decode / decode_bound,
        "decode_dynamic_tokens_per_s": decode_dynamic,
        "decode_dynamic_share_of_bound": decode_dynamic / decode_bound,
        "decode_f_linear_tokens_per_s": decode_f_linear,
        "decode_f_linear_share_of_bound": decode_f_linear / decode_bound,
        "linear_read_bytes_per_s": linear_rates,
        "narrow_linear_read_bytes_per_s": narrow_rates,
        "decode_share_of_gemv_bound": decode / (max(linear_rates[1], narrow_rates[1]) / weights),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="None (bundled SmolLM2-135M-Instruct), a local dir or an HF id")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for every measurement")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 512], help="rows of the fwd+bwd micro-batch")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings of each measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.model, args.lengths, args.decode_tokens, args.repeats)
    verdict = lambda ok: "ok" if ok else "MISSED"  # noqa: E731
    print(f"model {result['model']} | torch threads {result['threads']} | fp32 | CPU")
    for name, gflops in result["matmul_gflops"].items():
        print(f"matmul {name:<24} {gflops:7.1f} GFLOP/s")
    print(f"matmul peak (best of the above)  {result['matmul_peak_flops'] / 1e9:7.1f} GFLOP/s")
    print(f"memory read bandwidth            {result['read_bandwidth_bytes_per_s'] / 1e9:7.1f} GB/s")
    share = result["fwd_bwd_share_of_peak"]
    print(
        f"forward+backward, rows {result['lengths']}: {result['fwd_bwd_tokens_per_s']:.1f} tokens/s = "
        f"{result['fwd_bwd_flops_per_s'] / 1e9:.1f} GFLOP/s = {share:.2f} of the matmul peak "
        f"(target >= {TRAIN_SHARE_TARGET}: {verdict(share >= TRAIN_SHARE_TARGET)})"
    )
    share = result["decode_share_of_bound"]
    print(
        f"batch-1 decode (the trainer's sampler, static steps): {result['decode_tokens_per_s']:.1f} tokens/s; "
        f"bound bandwidth / weights "
        f"({result['weight_bytes'] / 1e6:.0f} MB) = {result['decode_bound_tokens_per_s']:.1f} tokens/s; "
        f"share {share:.2f} (target >= {DECODE_SHARE_TARGET}: {verdict(share >= DECODE_SHARE_TARGET)})"
    )
    print(
        f"batch-1 decode, the model's forward over a dynamic cache: {result['decode_dynamic_tokens_per_s']:.1f} "
        f"tokens/s, share {result['decode_dynamic_share_of_bound']:.2f}; static steps "
        f"{result['decode_tokens_per_s'] / result['decode_dynamic_tokens_per_s']:.2f}x that"
    )
    print(
        f"batch-1 decode, dynamic cache, every layer F.linear (narrow_rows=0): "
        f"{result['decode_f_linear_tokens_per_s']:.1f} tokens/s, share {result['decode_f_linear_share_of_bound']:.2f}; "
        f"its few-row form is "
        f"{result['decode_dynamic_tokens_per_s'] / result['decode_f_linear_tokens_per_s']:.2f}x that"
    )
    forms = (("F.linear (x @ W^T)", "linear_read_bytes_per_s"), ("W @ x^T", "narrow_linear_read_bytes_per_s"))
    for label, key in forms:
        rates = ", ".join(f"{rows} rows {rate / 1e9:.1f}" for rows, rate in result[key].items())
        print(f"the model's linear layers stream their weights, {label} (GB/s): {rates}")
    print(
        f"batch-1 decode as a share of what the faster 1-row matmuls allow (weights / their rate): "
        f"{result['decode_share_of_gemv_bound']:.2f}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
