#!/usr/bin/env bash
# The GPU checks of the engines in one run, for a lent GPU machine (CI has none). Writes each script's JSON, the
# engine tests' log and one stderr log to $OUT (default: ./gpu_results) and prints a short summary last.
#   bash benchmarks/gpu_suite.sh            # PYTHON=python3 by default: the machine's own torch + CUDA
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name" >> "$OUT/stderr.log"
  timeout "$limit" "$@" > "$OUT/$name.json" 2>> "$OUT/stderr.log"
  echo "== $name: exit $? in $((SECONDS - start)) s"
}
step gpu_check 90 "$PY" benchmarks/gpu_check.py
step rollout_throughput 150 "$PY" benchmarks/rollout_throughput.py --backends hf,native,native:eager --dtypes fp32,bf16 --batch-sizes 1,16,64,256 --repeats 2
step rollout_throughput_grpo 60 "$PY" benchmarks/rollout_throughput.py --backends hf,native,native:eager --dtypes bf16 --batch-sizes 64 --n 8 --prompt-len 240,256 --repeats 2
step train_throughput 90 "$PY" benchmarks/train_throughput.py --dtypes fp32,bf16
timeout 100 "$PY" -m pytest -q -p no:cacheprovider --timeout 60 tests/engines/test_train_engine.py \
  tests/engines/test_rollout_engines.py tests/engines/test_rollout_sampling.py tests/engines/test_rollout_static.py > "$OUT/pytest.log" 2>&1
echo "== pytest engines: exit $?"; tail -n 25 "$OUT/pytest.log"

"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except Exception as err:
        return {"unreadable": str(err)}
g = load("gpu_check")
print("gpu_check:", json.dumps({k: g.get(k) for k in ("device", "offload", "hybrid", "greedy")}))
for name in ("rollout_throughput", "rollout_throughput_grpo"):
    r = load(name)
    print(name, json.dumps(r.get("speedups")), json.dumps([(x["backend"], x["dtype"], x["batch"], x["new_tokens_per_s"]) for x in r.get("results", [])]))
t = load("train_throughput")
for k in ("fp32", "bf16"):
    v = t.get("results", {}).get(k, {})
    print("train", k, "tokens/s", round(v.get("tokens_per_s", 0)), "mfu", round(v.get("mfu", 0), 4), "peak TFLOP/s", round(v.get("matmul_peak_flops_per_s", 0) / 1e12, 1))
PYEOF
