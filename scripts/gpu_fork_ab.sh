#!/usr/bin/env bash
# A branched A/B on a GPU machine: phase 1 trains every run of PLAN1 up to its ForkPoint (a checkpoint per
# seed), phase 2 continues each checkpoint under every arm of PLAN2 (``{seed}`` in a plan's overrides is the
# run's seed), so the arms of one seed differ only after the fork. The GPU tests run beside phase 1 (tests
# are not timed). Runs spread over the visible GPUs. Results: $OUT/{phase1,phase2}_summary.md, the per-run
# metrics in $OUT/metrics.tar.gz, the test log in $OUT/gpu_tests.log (TEST_PATHS: which tests, default all;
# TESTS=0: none).
#
#   OUT=/tmp/out bash scripts/gpu_fork_ab.sh docs/benchmarks/plans/gpu_ab_round14_fork_phase{1,2}.json
#
# Environment (PYTHONPATH, NVLink multicast off, wheels from .whl/): scripts/gpu_env.sh.
set -uo pipefail
plan1=${1:?phase-1 plan JSON}
plan2=${2:?phase-2 plan JSON}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
ngpu=$(nvidia-smi -L | wc -l)
ab() {  # ab <plan> <dir> <timeout per run>
  python3 scripts/retrieval_ab.py --plan "$1" --parallel 32 --gpus "$ngpu" --threads 1 --timeout "$3" --out "$2"
}
ab "$plan1" /tmp/fork_ab/phase1 "${PHASE1_TIMEOUT:-300}" > "$OUT/phase1_stdout.txt" 2>&1 &
phase1=$!
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -rfEs --durations=12 -m gpu ${TEST_PATHS:-tests} > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
fi
wait "$phase1"
ab "$plan2" /tmp/fork_ab/phase2 "${PHASE2_TIMEOUT:-240}" > "$OUT/phase2_stdout.txt" 2>&1
for phase in phase1 phase2; do cp "/tmp/fork_ab/$phase/summary.md" "$OUT/${phase}_summary.md" 2>/dev/null; done
(cd /tmp/fork_ab && find . -name metrics.csv -o -name log.txt | tar czf "$OUT/metrics.tar.gz" -T -)
tail -n 4 "$OUT/gpu_tests.log" 2>/dev/null
tail -n 12 "$OUT/phase2_stdout.txt"
