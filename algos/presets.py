"""The named presets of the training settings: each a set of changes to `algos.config.Config`'s defaults.

Flags given after a preset override single fields:

- ``gpu``: the seed's training defaults (32 prompts per step, group size 2, 2 search turns, 480 steps,
  lr 1e-6, sft_coef 0.1, RED G=5 with EMA decay 0.99), SmolLM2-135M-Instruct, bf16 autocast.
- ``cpu``: SmolLM2-135M-Instruct and the bundled data on 2 CPU cores, the CoDA protocol (the flat agent with
  ``--protocol flat``; benchmarks/README.md has why): a 25-minute training budget (the budget, not a step count,
  ends it), spent mostly where RED's early phase learns (8 grounded demonstrations per step, under CoDA 2 of
  them the planner's and 6 the executors', at lr 1e-4, answering without an evidence quote, the gradient through
  the model's own tokens only; while every rollout group ties, a 1-question probe batch instead of 2
  questions), then the before/after evaluation on 100 dev questions (how long a run takes: benchmarks/README.md).
  PPO and ArCHer keep the flat protocol.
- ``tiny``: a tiny random model with the real tokenizer, 2 steps; for tests and smoke runs.

With no ``--preset``, the entry points pick ``gpu`` when CUDA is available and ``cpu`` otherwise
(`algos.config.default_preset`).
"""

from __future__ import annotations

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, object]] = {
    "gpu": {},
    "cpu": {
        "preset": "cpu",
        "protocol": "coda",
        "steps": 400,
        "max_train_minutes": 25.0,
        "questions_per_step": 2,
        "group_size": 2,
        "tie_probe_questions": 1,
        "top_k": 3,
        "max_passage_words": 40,
        "max_new_tokens": 64,
        "max_context_tokens": 2048,
        "sft_batch_size": 8,
        "sft_planner_share": 0.25,
        "sft_num_demos": None,
        "quote_words": 0,
        "question_after_results": True,
        "lr": 1e-4,
        "micro_batch_tokens": 4096,
        "context_grad": False,
        "torch_threads": None,
        "save_every": 5,
        "eval_questions": 100,
        # the final model is the last step's, as in most trainers: choosing among the kept checkpoints on 50
        # held-out training questions (--validation-questions 50) cost 5 of the tail's minutes and did not beat
        # the last step on average (docs/results/main-job.md)
    },
    "tiny": {
        "preset": "tiny",
        "model": "tiny",
        "steps": 2,
        "questions_per_step": 2,
        "group_size": 2,
        "top_k": 2,
        "max_passage_words": 20,
        "max_new_tokens": 16,
        "max_context_tokens": 1024,
        "num_questions": 16,
        "sft_batch_size": 2,
        "sft_num_demos": 8,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "micro_batch_tokens": 2048,
        "torch_threads": 1,
        "save_every": 1,
        "keep_checkpoints": 2,
        "wandb": False,
        "progress": False,
        "eval_questions": 4,
        "eval_batch_size": 4,
    },
}
"""Each preset's changes to the dataclass defaults (gpu: none, the seed's defaults)."""
