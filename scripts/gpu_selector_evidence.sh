#!/usr/bin/env bash
# The selector-quality evidence in one run on a GPU machine (the committed evidence is from an H200):
# the GPU tests, then the learning A/B plan (runs side by side on the one GPU), then the step time of
# each LM variant measured alone (runs that share a GPU do not give step times worth reporting).
# Results go to $OUT.
#
#   OUT=/tmp/out bash scripts/gpu_selector_evidence.sh docs/benchmarks/plans/gpu_ab_round4.json
#
# The GPU tests run while the A/B trains (tests are not timed); every benchmark runs after both, alone.
# BENCH=1 also runs the attention benchmark at 64K (ours and cuDNN, no Flex), to check kernel timings
# against the committed ones; PACKED=1 the packed-documents benchmark at 64K (ours with and without the
# document mask, Flex with a document mask_mod, same selection); STEP_TIMES=0 skips the LM step times.
#
# Environment (PYTHONPATH, NVLink multicast off, wheels from .whl/): scripts/gpu_env.sh.
set -uo pipefail
plan=${1:?plan JSON}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
python3 scripts/retrieval_ab.py --plan "$plan" --parallel 16 --threads 1 --timeout "${RUN_TIMEOUT:-330}" \
  --out /tmp/ab > "$OUT/ab_stdout.txt" 2>&1 &
ab_pid=$!
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rfEs -m gpu tests > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
tail -3 "$OUT/gpu_tests.log"
wait "$ab_pid"
cp /tmp/ab/summary.md /tmp/ab/summary.json "$OUT/" 2>/dev/null

if [ "${BENCH:-0}" = 1 ]; then
  timeout 150 python3 scripts/bench_attention.py --n 65536 --no-sweep --no-flex --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"
fi
if [ "${PACKED:-0}" = 1 ]; then
  timeout "${PACKED_TIMEOUT:-150}" python3 scripts/bench_attention.py --packed 2048:16384 --n 65536 --no-sweep \
    --out "$OUT/packed" > "$OUT/packed.log" 2>&1
  echo "packed bench rc=$?" >> "$OUT/packed.log"
  tail -30 "$OUT/packed.log"
fi

if [ "${STEP_TIMES:-1}" = 1 ]; then
  lm="--trainer.accelerator=gpu --trainer.precision=bf16-mixed --data.init_args.seq_len=8192 --data.init_args.batch_size=4
      --trainer.max_steps=40 --trainer.limit_val_batches=0 --trainer.enable_progress_bar=false --trainer.log_every_n_steps=1"
  sp="--model.init_args.model.sparse.top_k=8 --model.init_args.model.sparse.window=4"
  i=0
  for variant in "lm_bytes_dense:" "lm_bytes:$sp" "lm_bytes:$sp --model.init_args.model.sparse.distill=off"; do
    config=${variant%%:*}; extra=${variant#*:}; i=$((i + 1))
    dir=/tmp/steptime/$i-$config
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    timeout 60 python3 -m sparse_train.cli fit --config "$config" $lm $extra --trainer.default_root_dir="$dir" > "$dir.log" 2>&1
    python3 - "$dir" "$config $extra" >> "$OUT/step_times.txt" <<'EOF'
import csv, pathlib, statistics, sys
rows = [r for p in pathlib.Path(sys.argv[1]).rglob("metrics.csv") for r in csv.DictReader(open(p))]
steps = [float(r["time/step_ms"]) for r in rows if r.get("time/step_ms")][5:]
print(f"{sys.argv[2]!r}: median step {statistics.median(steps):.1f} ms over {len(steps)} logged steps" if steps
      else f"{sys.argv[2]!r}: no step times")
EOF
  done
  cat "$OUT/step_times.txt"
fi
cd /tmp/ab && tar czf "$OUT/runs.tgz" --exclude='*.ckpt' --exclude='wandb' .
tail -25 "$OUT/summary.md"
