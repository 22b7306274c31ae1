"""Checks of a training step's episodes before the update: a step whose searches or generations failed too often
stops the run (`algos.run.training_run.TrainingStopped`) instead of training on episodes that say "Search failed"
or hold empty turns. The GRPO learner's `collect_rollouts` (`algos.learners.trainer.Trainer`) calls both with the run's
settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from algos.run.training_run import TrainingStopped

__all__ = ["check_retrieval", "check_sampler"]


def check_retrieval(infos: Sequence[dict[str, Any]], step: int, config: Any) -> tuple[int, float]:
    """Count the failed searches of a step's episodes; stop the run when too many failed.

    Args:
        infos: The episodes' terminal infos (``num_searches`` counts searches that returned results,
            ``retrieval_errors`` those the retriever failed).
        step: The step the episodes are for (named in the message).
        config: The run's settings (``max_retrieval_error_rate``, ``retriever``).

    Returns:
        (failed searches, their share of all searches).

    Raises:
        TrainingStopped: more than ``max_retrieval_error_rate`` of the searches failed: training on episodes
            whose searches all said "Search failed" would teach the policy that searching is useless.
    """
    errors = sum(int(i.get("retrieval_errors", 0)) for i in infos)
    searches = errors + sum(int(i.get("num_searches", 0)) for i in infos)
    rate = errors / searches if searches else 0.0
    if rate > config.env.max_retrieval_error_rate:
        last = next((i["retrieval_error"] for i in reversed(infos) if i.get("retrieval_error")), "unknown")
        raise TrainingStopped(
            f"step {step}: {errors} of {searches} searches failed ({rate:.0%}, over "
            f"--max-retrieval-error-rate {config.env.max_retrieval_error_rate}); last failure: {last}. "
            f"Check the retriever ({config.env.retriever}), then run again with --resume"
        )
    return errors, rate


def check_sampler(infos: Sequence[dict[str, Any]], step: int, config: Any) -> float:
    """The share of a step's episodes in which a generation failed; stop the run when it passes
    ``max_sampler_error_rate`` (an engine that cannot run the model would otherwise train on empty turns).

    Args:
        infos: The episodes' terminal infos (``sampler_errors``, ``sampler_error``).
        step: The step the episodes are for (named in the message).
        config: The run's settings (``max_sampler_error_rate``, ``sampler``).

    Raises:
        TrainingStopped: too many episodes had a failed generation; names the first error.
    """
    failed = [i for i in infos if int(i.get("sampler_errors", 0)) > 0]
    rate = len(failed) / len(infos) if infos else 0.0
    if rate > config.model.max_sampler_error_rate:
        raise TrainingStopped(
            f"step {step}: generation failed in {len(failed)} of {len(infos)} episodes ({rate:.0%}, over "
            f"--max-sampler-error-rate {config.model.max_sampler_error_rate}); first failure: "
            f"{failed[0].get('sampler_error', 'unknown')}. Check --sampler {config.model.sampler}"
        )
    return rate
