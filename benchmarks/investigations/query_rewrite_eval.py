"""Mean recall@5 of a model's rewritten queries on the query-rewrite env, against the question as the query.

    python -m benchmarks.investigations.query_rewrite_eval [--model DIR_OR_ID] [--split dev] [--limit 50] \
        [--action-format tag|raw] [--out RESULT.json] [--compare EARLIER_RESULT.json]

For each of the first ``--limit`` questions of the split, the model writes one action greedily (the same
context agent and ``</query>`` stop as `algos.ppo`'s training rollouts) in RedCoda-QueryRewrite-v0; the
env's recall@5 (BM25 over the bundled corpus) is the score, 0 for an action without a valid ``<query>``
(``--action-format raw``: the env's raw format, where the whole reply is the query).
The baseline sends each question itself as the query. Prints one JSON object: both means with 95% BCa
bootstrap intervals (`envs.stats`, inside [0, 1]), the share of valid actions, a few sample queries and the
per-question recalls; with ``--compare`` (an earlier run's ``--out`` file on the same questions) also the paired
difference of the model's recall, this run minus that one, with its 95% bootstrap interval (inside [-1, 1]).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from envs.stats import mean_ci, paired_difference


def evaluate(
    model: str | None,
    split: str = "dev",
    limit: int = 50,
    max_new_tokens: int = 48,
    batch: int = 25,
    action_format: str = "tag",
) -> dict[str, Any]:
    """Recall@5 of the model's greedy queries and of the raw question, over the first `limit` questions."""
    import gymnasium as gym
    import torch

    import envs  # noqa: F401  (registers the ids)
    from agents.models import load_model
    from agents.records import SamplingParams
    from agents.samplers.hf import HFSampler
    from agents.search_agents import ContextAgent

    policy, tokenizer = load_model(model, dtype=torch.float32, device="cpu")
    env_list = [
        gym.make("RedCoda-QueryRewrite-v0", split=split, action_format=action_format, disable_env_checker=True)
        for _ in range(batch)
    ]
    indices = list(range(min(limit, env_list[0].unwrapped.num_examples)))
    sampler = HFSampler(policy, tokenizer, max_context=1024, max_batch_size=batch, seed=0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=("</query>",))
    agent = ContextAgent(sampler, params, max_context_tokens=1024)
    start = time.perf_counter()
    model_recall, valid, samples = [], [], []
    for first in range(0, len(indices), batch):
        chunk = indices[first : first + batch]
        for trajectory in agent.rollout(env_list[: len(chunk)], chunk, seed=0):
            model_recall.append(float(trajectory.info["recall_at_k"]))
            valid.append(float(not trajectory.info["invalid_action"]))
            if len(samples) < 5:
                samples.append(trajectory.actions[0])
    seconds = time.perf_counter() - start
    baseline = []
    env = env_list[0]
    for index in indices:
        _, info = env.reset(options={"index": index})
        question = info["question"]
        *_, step_info = env.step(f"<query>{question}</query>" if action_format == "tag" else question)
        baseline.append(float(step_info["recall_at_k"]))

    def ci(values: Sequence[float]) -> dict[str, float]:
        interval = mean_ci(values)
        return interval.as_dict()

    return {
        "model": model or "smollm2-135m",
        "split": split,
        "action_format": action_format,
        "questions": len(indices),
        "recall_at_5_model": ci(model_recall),
        "recall_at_5_question_as_query": ci(baseline),
        "valid_actions": sum(valid) / len(valid),
        "generation_seconds": seconds,
        "sample_actions": samples,
        "per_question_model": model_recall,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the command line, evaluate, print the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or id; default: bundled SmolLM2-135M")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--action-format", choices=("tag", "raw"), default="tag")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="also write the result JSON here")
    parser.add_argument("--compare", default=None, help="an earlier --out file: report the paired difference")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    result = evaluate(args.model, args.split, args.limit, args.max_new_tokens, action_format=args.action_format)
    if args.compare:
        with open(args.compare, encoding="utf-8") as handle:
            earlier = json.load(handle)["per_question_model"]
        if len(earlier) != len(result["per_question_model"]):
            raise ValueError(f"{args.compare} scores {len(earlier)} questions, this run {result['questions']}")
        diff = paired_difference(result["per_question_model"], earlier)
        result["paired_difference_vs_compare"] = {"mean": diff.mean, "low": diff.low, "high": diff.high}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
