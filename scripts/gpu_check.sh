#!/usr/bin/env bash
# One device call: GPU tests, compiled-output checks and the benchmark, logs under $OUT.
# Usage (device): OUT=/some/dir bash scripts/gpu_check.sh [bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
T_TESTS=${T_TESTS:-240}; T_BENCH=${T_BENCH:-300}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1 | tee -a "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$T_TESTS" python3 -m pytest -q -rA -s -m gpu tests/test_gpu_kernels.py 2>&1 | tee "$OUT/gpu_tests.log"
  echo "gpu tests rc=$?" | tee -a "$OUT/env.txt"
fi
timeout "$T_BENCH" python3 scripts/bench_attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?" | tee -a "$OUT/env.txt"
echo "==== summary ===="
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -5
cat "$OUT"/*_h200_attention.md 2>/dev/null | head -60
