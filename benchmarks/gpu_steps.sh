#!/usr/bin/env bash
# One CUDA training step (two, the first warms up) of each algorithm, and the train-step time split, on a GPU
# machine without network access or a JVM. Recorded in benchmarks/README.md.
#
# What travels: this repository, Python wheels of the pure-Python dependencies the GPU image lacks (in .whl/),
# and SmolLM2-135M-Instruct's config and tokenizer (in .gpu/smollm2-config/). The model's weights are not
# shipped (the bundled GGUF is larger than what can be carried), so the model is SmolLM2-135M's exact
# architecture with random weights: the timings are those of SmolLM2-135M, the rewards are meaningless.
# Without a JVM the env uses the distractor corpus (in-memory BM25 over each question's own paragraphs).
# Make the config folder on a machine with the project installed (it reads the cached SmolLM2 conversion):
#   python -c "from agents.models import ensure_smollm2_cache as e; from transformers import AutoConfig as C, \
#     AutoTokenizer as T; d = e(); C.from_pretrained(d).save_pretrained('.gpu/smollm2-config'); \
#     T.from_pretrained(d).save_pretrained('.gpu/smollm2-config')"
# With real weights at hand (a network, or a copied folder), put their path in place of /tmp/smollm2-arch.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-steps}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export REDCODA_CACHE=/tmp/redcoda-cache WANDB_MODE=disabled PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
config = AutoConfig.from_pretrained(".gpu/smollm2-config")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
model.save_pretrained("/tmp/smollm2-arch")
AutoTokenizer.from_pretrained(".gpu/smollm2-config").save_pretrained("/tmp/smollm2-arch")
print(torch.cuda.get_device_name(0), sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
COMMON=(--preset gpu --model /tmp/smollm2-arch --corpus distractor --steps 2 --sft-num-demos 256 --save-every 0)
for algo in ${ALGOS-grpo grpo_sft red_grpo}; do  # ALGOS="" runs only the train-step split
  python3 -m algos.$algo "${COMMON[@]}" --run-dir "$OUT/$algo" 2>&1 | grep -vE "Warning|warn" | tail -n 14
  python3 - "$OUT/$algo/metrics.jsonl" "$algo" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = rows[-1]
keys = ["time/step", "time/generation", "time/env_and_retrieval", "time/old_logp", "time/forward_backward",
        "time/optimizer", "tokens/trained", "tokens/s", "tokens/s_generation", "sft/weight", "red/final_weight"]
print(sys.argv[2], "step 2:", {k: round(last[k], 3) for k in keys if k in last})
PY
done
python3 -m benchmarks.train_step "${COMMON[@]}" 2>&1 | tail -n 25
