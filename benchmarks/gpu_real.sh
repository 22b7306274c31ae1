#!/usr/bin/env bash
# On a CUDA machine without network access: the real SmolLM2-135M-Instruct (its GGUF, carried in pieces made by
# `benchmarks/gpu_kit.sh`), the pooled corpus searched by the pure-Python BM25 (no JVM there), and
#   stash   - copy the pieces this call carried (.gpu/*) to $PARTS, where they outlast the call: a path carried to
#             the device machine is there only during the call that carries it;
#   check   - the CUDA-graph decode test, each decode path's logits against a float64 reference, and the sampler
#             against model.generate with and without graphs (fp32, then bf16 as the gpu preset samples);
#   steps   - two steps of the seed's configuration (the gpu preset: 32 questions x 2 episodes, 256 new tokens a
#             turn; STEP_COUNT steps, 3 by default) with the dynamic cache, then with CUDA graphs: each step after the
#             first split by part, and their mean (the first warms up; so can the first backward pass, which runs
#             only once a group's rewards differ);
#   curves  - the main job's trainer on the gpu preset for STEPS steps (20 by default) with CUDA graphs, its reward,
#             F1, valid-answer and SFT-weight curves (metrics.jsonl, curves.png) and its before/after table;
#   budget  - the main job's own recipe (the cpu preset, float32 as on a CPU) for BUDGET_MINUTES of training (5),
#             more steps than a CPU makes in its 25 minutes, a checkpoint every BUDGET_EVERY steps (20), each scored
#             greedily on BUDGET_QUESTIONS held-out training questions (100; the run's own validation choice):
#             whether the recipe keeps learning past the CPU's budget, on questions no report uses.
#
#   bash benchmarks/gpu_real.sh stash check steps curves budget  # any subset, in this order; output under $OUT (or /tmp)
#
# Knobs (environment): STEPS (curves' steps, 20), CURVES_FLAGS (more trainer flags for curves, e.g. "--lr 1e-4
# --max-train-minutes 5"), DECODE (curves' sampler, graphs), DTYPES (the sampler benchmark's, "fp32 bf16"),
# STEP_DECODES (the steps phase's samplers, "dynamic graphs"), SAMPLER_FLAGS (more flags for the sampler benchmark,
# e.g. --profile). Runs are written under /tmp/gpu-real-runs; only the
# logs, metrics, curves and evaluation tables are copied to $OUT (what comes back from a device call is limited).
#
# The pieces are carried one call at a time, each call stashing its own (see "Bringing the real model" in
# benchmarks/README.md); the wheels in .whl/ (carried by every call that runs Python) are installed into /tmp/site.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-real}
STEPS=${STEPS:-20}
DECODE=${DECODE:-graphs}
DTYPES=${DTYPES:-fp32 bf16}
STEP_DECODES=${STEP_DECODES:-dynamic graphs}
RUNS=/tmp/gpu-real-runs
PARTS=${PARTS:-/tmp/gguf-parts}
mkdir -p "$OUT" "$RUNS" "$PARTS"
# stash comes before the set-up below, which needs every piece: a call that only carries a piece stops after it
if [ "${1:-}" = stash ]; then
  shift
  cp .gpu/smollm2.gguf.* "$PARTS"/
  ls -l "$PARTS"
  [ $# -gt 0 ] || exit 0
fi
export REDCODA_CACHE=/tmp/redcoda-cache WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# converted where the project looks for its default model, so --model can stay unset and the tests' tiny models
# find the real tokenizer
model=$(python3 -c "from agents.models import smollm2_cache_dir; print(smollm2_cache_dir())")
if [ ! -f "$model/model.safetensors" ]; then
  cat "$PARTS"/smollm2.gguf.part* >/tmp/smollm2.gguf
  if [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" != "$(cat "$PARTS"/smollm2.gguf.sha256)" ]; then
    echo "the joined GGUF does not match its checksum: a piece is missing or stale" >&2
    ls -l "$PARTS" >&2
    exit 1
  fi
  # float32 and on the CPU, as `ensure_smollm2_cache` converts it: load_model's default on a CUDA machine is
  # bfloat16, and a folder saved so would hand bfloat16-rounded weights to everything that loads it
  python3 -c "from agents.models import load_model; m, t = load_model('/tmp/smollm2.gguf', dtype='float32', device='cpu'); \
m.save_pretrained('$model'); t.save_pretrained('$model'); print(sum(p.numel() for p in m.parameters()) / 1e6, 'M')"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
COMMON=(--preset gpu --model "$model" --retriever bm25-python --save-every 0)
split() {  # each step's time split of a run's metrics.jsonl after the first, and their mean
  python3 - "$1" <<'PY'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])][1:]
keys = ["step", "time/step", "time/generation", "time/env_and_retrieval", "time/old_logp", "time/forward_backward",
        "tokens/sampled", "tokens/trained", "tokens/s_generation", "critic/rewards/mean", "answer_f1/mean", "env/answered"]
for step in steps:
    print({k: round(step[k], 3) if isinstance(step[k], float) else step[k] for k in keys if k in step})
means = {k: round(sum(s[k] for s in steps) / len(steps), 3) for k in keys[1:] if all(k in s for s in steps)}
print(f"mean of steps 2-{len(steps) + 1}:", means)
PY
}
for phase in "$@"; do
  case $phase in
    check)
      # a failing test is reported, not fatal: the benchmark below shows how far the graphs are off
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_static_decode.py >"$OUT/gpu_test.log" 2>&1 ||
        echo "THE GPU TEST FAILED (gpu_test.log)"
      tail -n 3 "$OUT/gpu_test.log"
      # each decode path's logits against a float64 reference, the same tokens fed: rounding or a bug
      python3 -m benchmarks.decode_parity --model "$model" --device cuda 2>&1 | tee "$OUT/decode_parity.log" |
        grep -v Warning
      for dtype in $DTYPES; do
        flag=$([ "$dtype" = bf16 ] && echo --bf16 || true)
        # shellcheck disable=SC2086  # SAMPLER_FLAGS is a list of flags (--profile, say)
        python3 -m benchmarks.sampler_gpu --model "$model" $flag ${SAMPLER_FLAGS:-} 2>&1 |
          tee "$OUT/sampler_gpu_$dtype.log" | grep -v Warning
      done
      ;;
    steps)
      for decode in $STEP_DECODES; do
        python3 -m algos.grpo "${COMMON[@]}" --steps "${STEP_COUNT:-3}" --eval-questions 0 --sampler-decode $decode \
          --run-dir "$RUNS/steps-$decode" >"$OUT/steps-$decode.log" 2>&1 || { tail -n 30 "$OUT/steps-$decode.log"; exit 1; }
        cp "$RUNS/steps-$decode/metrics.jsonl" "$OUT/steps-$decode.metrics.jsonl"
        echo "grpo, gpu preset, sampler $decode, steps 2-${STEP_COUNT:-3}:"
        split "$RUNS/steps-$decode/metrics.jsonl"
      done
      ;;
    curves)
      # shellcheck disable=SC2086  # CURVES_FLAGS is a list of flags
      python3 -m algos.red_grpo "${COMMON[@]}" --steps "$STEPS" --sampler-decode "$DECODE" ${CURVES_FLAGS:-} \
        --run-dir "$RUNS/curves" >"$OUT/curves.log" 2>&1 || status=$?
      for f in metrics.jsonl curves.png eval.md eval.json; do
        [ -f "$RUNS/curves/$f" ] && cp "$RUNS/curves/$f" "$OUT/curves.$f"
      done
      tail -n 25 "$OUT/curves.log"
      [ -z "${status:-}" ] || exit "$status"
      ;;
    budget)
      # the gpu preset's flags first, then the cpu preset's (the last --preset wins); --eval-questions 0: the
      # report's dev questions are not looked at, the validation questions are the measurement
      python3 -m algos.red_grpo "${COMMON[@]}" --preset cpu --bf16 False --sampler-decode "$DECODE" \
        --max-train-minutes "${BUDGET_MINUTES:-5}" --save-every "${BUDGET_EVERY:-20}" --keep-checkpoints 100 \
        --validation-questions "${BUDGET_QUESTIONS:-100}" --eval-questions 0 --run-dir "$RUNS/budget" \
        >"$OUT/budget.log" 2>&1 || status=$?
      for f in metrics.jsonl curves.png validation.json; do
        [ -f "$RUNS/budget/$f" ] && cp "$RUNS/budget/$f" "$OUT/budget.$f"
      done
      grep -E "validation:|steps? in|selected" "$OUT/budget.log" | tail -n 30
      [ -z "${status:-}" ] || exit "$status"
      ;;
    *) echo "unknown phase $phase (stash first, then check, steps, curves, budget)" >&2; exit 2 ;;
  esac
done
