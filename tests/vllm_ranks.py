"""A `--sampler vllm` run of the command line, under ``torchrun`` or alone, that records what each rank's engine holds
after every weight push (tests/test_vllm_ranks.py).

    python tests/vllm_ranks.py OUT MODEL_DIR [trainer flags]                                   # one process
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/vllm_ranks.py OUT MODEL_DIR [--fsdp]

The run is `algos.run.launch.main` of red_grpo's tiny preset on the real engine, with two things added: AdamW's eps at
1e-6 (as tests/distributed_runs.py, so that float32 rounding between one process's and two ranks' gradient sums is
not turned into full steps), and after each push a sha256 of the engine's own parameters, read inside the engine
(`vllm.LLM.apply_model`), appended to OUT/engine-rank<R>.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

ADAM_EPS = 1e-6


def _engine_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(out: Path, model: str, *flags: str) -> None:
    from agents.samplers.vllm_engine import VLLMSampler
    from algos.run import setup
    from algos.run.launch import main as train

    rank = int(os.environ.get("RANK", "0"))
    log = out / f"engine-rank{rank}.jsonl"
    real_push, real_optimizer = VLLMSampler.load_weights, setup.make_optimizer

    def push_and_record(self: VLLMSampler, weights: Any) -> None:
        real_push(self, weights)
        (digest,) = self.llm.apply_model(_engine_digest)  # one worker: the engine runs in this process
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"digest": digest}) + "\n")

    def small_eps(*args: Any, **kwargs: Any) -> Any:
        optimizer = real_optimizer(*args, **kwargs)
        for group in optimizer.param_groups:
            group["eps"] = ADAM_EPS
        return optimizer

    VLLMSampler.load_weights = push_and_record  # type: ignore[method-assign]
    setup.make_optimizer = small_eps
    argv = ["--preset", "tiny", "--model", model, "--sampler", "vllm", "--vllm-kv-cache-gib", "0.25", "--steps", "3"]
    argv += ["--eval-questions", "0", "--run-dir", str(out / "run"), "--no-progress", *flags]
    train(argv, algo="red_grpo")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
