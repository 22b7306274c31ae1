"""What one more prefill pass costs on this machine: the price per group behind `PREFILL_SPLIT_TOKENS`.

    python -m benchmarks.investigations.prefill_pass [--threads 2] [--repeats 3]

A prefill pass of the real SmolLM2-135M (no past, no padding, only the last position's logits, as the sampler
prefills) is timed for one row of 64 to 540 tokens and for batches of 270-token rows. Printed side by side: the
milliseconds and tokens/s of each shape, then a line fitted to the one-row passes, whose intercept is the cost of
a pass beyond its tokens, in milliseconds and in prefill tokens, beside the sampler's `PREFILL_SPLIT_TOKENS`.
If one row of a few hundred tokens runs as fast per token as a batch, splitting a batch's prefill into groups
costs only that intercept per group.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import best_seconds

ONE_ROW = (64, 128, 270, 540)
BATCHES = ((4, 270), (20, 270))


def pass_seconds(model: torch.nn.Module, rows: int, tokens: int, repeats: int) -> float:
    """The fastest of `repeats` prefill passes of `rows` rows of `tokens` random token ids."""
    ids = torch.randint(100, 40000, (rows, tokens), generator=torch.Generator().manual_seed(rows * tokens))

    @torch.inference_mode()
    def run() -> None:
        model(input_ids=ids, logits_to_keep=1)

    return best_seconds(run, repeats, warmup=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2: the main job's on 2 cores)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per shape (the fastest is kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from agents.models import load_model
    from agents.samplers.prefill import PREFILL_SPLIT_TOKENS

    model, _ = load_model(None)
    model.eval()
    print(f"| rows | tokens a row | ms | tokens/s |  ({args.threads} threads)")
    print("|---|---|---|---|")
    single = []
    for rows, tokens in [(1, n) for n in ONE_ROW] + list(BATCHES):
        seconds = pass_seconds(model, rows, tokens, args.repeats)
        if rows == 1:
            single.append((tokens, seconds))
        print(f"| {rows} | {tokens} | {seconds * 1000:.0f} | {rows * tokens / seconds:.0f} |")
    xs, ys = torch.tensor([float(t) for t, _ in single]), torch.tensor([s for _, s in single])
    slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
    intercept = float(ys.mean()) - slope * float(xs.mean())
    print(
        f"\none pass beyond its tokens: {intercept * 1000:.0f} ms = {intercept / slope:.0f} prefill tokens "
        f"({slope * 1000:.2f} ms a token); PREFILL_SPLIT_TOKENS = {PREFILL_SPLIT_TOKENS}"
    )


if __name__ == "__main__":
    main()
