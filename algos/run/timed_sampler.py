"""The training run's sampler wrapper: it times each step's generation and counts what the sampler's levers did."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from agents.records import Completion, SamplingParams
from agents.samplers import SamplerWrapper
from algos.run.learner import sync

__all__ = ["TimedSampler"]


class TimedSampler(SamplerWrapper):
    """Wraps a sampler to time its `generate` calls, so a rollout's time splits into generation and the rest."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(sampler)
        self.seconds = 0.0
        self.tokens = 0
        self._levers_since = self._lever_counts()  # the inner sampler's running counts at the step's start

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        sync()
        start = time.perf_counter()
        completions = self.inner.generate(prompts, params)
        sync()
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def reset(self) -> None:  # the step's count of generation seconds and sampled tokens starts
        self.seconds, self.tokens = 0.0, 0
        self._levers_since = self._lever_counts()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave the block's generations out of the step's counts (an expert learner's resampling)."""
        seconds, tokens, levers = self.seconds, self.tokens, self._lever_counts()
        try:
            yield
        finally:
            self.seconds, self.tokens = seconds, tokens
            after = self._lever_counts()
            self._levers_since = {k: v + after[k] - levers[k] for k, v in self._levers_since.items()}

    def _lever_counts(self) -> dict[str, float]:
        counts = getattr(self.inner, "lever_counts", None)  # the transformers sampler's; others have none
        return counts() if callable(counts) else {}

    def lever_metrics(self) -> dict[str, float]:
        """What the transformers sampler's decoding levers did since the step began (`HFSampler.lever_counts`), as
        ``sampler/*`` metrics: its rows per batch, the live rows and the rows run per decode step (fewer run where
        finished rows left the row bucket), the prompt tokens prefilled and those prefix sharing saved; {} for
        other samplers."""
        now = self._lever_counts()
        if not now:
            return {}
        step = {k: now[k] - self._levers_since.get(k, 0.0) for k in now}
        steps = step["decode_steps"]
        return {
            "sampler/rows_per_batch": now["rows_per_batch"],
            "sampler/decode_steps": steps,
            "sampler/live_rows_per_step": step["live_row_steps"] / steps if steps else 0.0,
            "sampler/stepped_rows_per_step": step["stepped_row_steps"] / steps if steps else 0.0,
            "sampler/prefill_tokens": step["prefilled_tokens"],
            "sampler/prefill_tokens_saved": step["prefill_tokens_saved"],
        }
