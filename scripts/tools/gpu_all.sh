#!/usr/bin/env bash
# Every GPU check and benchmark of the project, one phase per invocation, on a machine with one or two
# GPUs (two GPUs run two tracks side by side; on one GPU the tracks run in turn and the DDP step is
# skipped). Each command has its own timeout so a phase ends in about ten minutes. Logs and results are
# tarred to $OUT/results-<phase>.tar.gz, the main result files are also copied to $OUT, and a summary
# prints last.
#
# Run from the repository root:
#
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh tests       # every GPU test, in five pytest processes side by side
#                                                           # (three kernel parts, torch.compile, the rest; 280 s
#                                                           # each), then on two GPUs the two-GPU tests with both
#                                                           # visible
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh checks      # attention (64K; BENCH_NS="..." for more), selector
#                                                           # (with CUDA-graph capture), step (64K, --profile)
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh step        # 1.1B step: 64K with kernel tables and 128K, the
#                                                           # checkpoint policy (attention kept / recomputed) and
#                                                           # distillation off; 16K with 10 repeats and its kernel
#                                                           # table; kernel tables come with attention windows
#                                                           # (scripts/tools/trace_attention_windows.py), clocks
#                                                           # sampled
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh retrieval   # 16K retrieval A/B (sparse and dense twin side by side),
#                                                           # then block-mass GPU tests, selector and step benchmarks
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh token       # the token selector (also with 32 candidates) against
#                                                           # the pooled one at 64K: the selection and the 1.1B
#                                                           # step with its dense twin
#                                                           # (docs/benchmarks/selector_heldout)
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh heldout     # token selector with candidate blocks against exact
#                                                           # token scores on the held-out families, 2K, two seeds
#                                                           # (HELDOUT_LEN=8192: needles and copy at 8K with the
#                                                           # dense twin and the oracle, more than one call: split
#                                                           # it with HELDOUT_MODES, e.g. "dense,oracle" then
#                                                           # "token_kl,token_cand"); results straight to $OUT
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh seeds2k     # needles and vartrack at 2K with the dense twin, the block
#                                                           # oracle and the module's default selector over eight
#                                                           # seeds (SEEDS, default 0-7), the spread of two seeds being
#                                                           # as large as the ratios' margins; no job starts after 6
#                                                           # minutes, and a rerun with the same OUT resumes
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh vartrack8k  # what the shared selection costs on 8K variable tracking:
#                                                           # the token selector and the block oracle with twice the
#                                                           # budget (top_k 8) and with 16-row query blocks, two seeds,
#                                                           # the 8K schedule of docs/benchmarks/selector_heldout (8
#                                                           # jobs side by side); results straight to $OUT
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh vartrack_exact  # variable tracking at 8K with exact token scores
#                                                           # (the 8K schedule, two seeds), trained by the token-level
#                                                           # KL (token_kl: content only) and by the block-level KL
#                                                           # with its block-distance bias (token: sees position),
#                                                           # beside the row oracle at 2K (four seeds): whether the
#                                                           # candidates, the selector's blindness to position or the
#                                                           # block sharing cost the learned selector its gap
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh multihop    # multi-hop with the dense twin, the block oracle and the
#                                                           # module's default: 2K over eight seeds beside 8K (the
#                                                           # 3000-step 8K schedule) over two
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh assoc8k     # associative recall at 8K on the 8K vartrack schedule
#                                                           # (3000 steps; dense, oracle, the module's default; two
#                                                           # seeds); ASSOC_MID_STEPS sets the 2K stage's steps
#                                                           # (default 2000), ASSOC_BATCH the rows per step of every
#                                                           # stage (default 16; at 8 rows the dense twin stays at
#                                                           # chance, with 700 or 2000 steps at 2K)
#                                                           # The held-out phases write each finished job to $OUT at
#                                                           # once; HELDOUT_TIMEOUT (s, default 560) fits them to a
#                                                           # shorter device call.
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh token_kl    # the token-level distillation: its kernel and module GPU
#                                                           # tests, the kernels against the PyTorch reference at 64K
#                                                           # (scripts/bench/token_kl.py), the module with 32
#                                                           # candidate blocks, the 1.1B step with them and its dense
#                                                           # twin (STEP_TIMEOUT s, default 200)
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh token_compile  # the token selector's kernels as custom ops: their GPU
#                                                           # tests (compiled module against eager), then the 64K
#                                                           # selection and token-level distillation eager against
#                                                           # torch.compile, exact scores and 32 candidate blocks
#                                                           # (scripts/bench/selector.py --compile)
#   OUT=/tmp/out bash scripts/tools/gpu_all.sh limits      # one head dim (HEAD_DIM, default 128): the 64K attention
#                                                           # benchmark with its sustained (power-capped) column,
#                                                           # then Nsight Compute over one forward + backward per
#                                                           # pattern (NCU_PATTERNS, default "P128 P64", "" for none;
#                                                           # NCU_TIMEOUT s each; scripts/tools/ncu_kernel_limits.py),
#                                                           # summarised to JSON and md
#
# Environment (PYTHONPATH, NVLink multicast off, wheels from .whl/): scripts/tools/gpu_env.sh.
set -uo pipefail
phase=${1:-checks}
# shellcheck source=scripts/tools/gpu_env.sh
source scripts/tools/gpu_env.sh
OUT=${OUT:-/tmp/gpu_out}
R=/tmp/gpu_work_$$   # everything goes here; $OUT gets the tarball and the main result files only
mkdir -p "$R" "$OUT"
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$R/env_$phase.txt" 2>&1
gpu_b=$(( ngpu > 1 ? 1 : 0 ))

track() {  # track <gpu> <commands...>: run a command list on one GPU in the background
  local gpu=$1; shift
  ( export CUDA_VISIBLE_DEVICES=$gpu; "$@" ) &
}

gpu_tests() {  # gpu_tests <log name> <timeout> <pytest paths...>
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rA -s -m gpu "$@" > "$R/$name.log" 2>&1
  echo "gpu tests rc=$?" >> "$R/$name.log"
}

checks_gpu_a() {
  timeout 220 python3 -m scripts.bench.attention --out "$R/bench_attention" --no-sweep \
    --n ${BENCH_NS:-65536} > "$R/bench_attention.log" 2>&1
  echo "bench_attention rc=$?" >> "$R/bench_attention.log"
}

checks_gpu_b() {
  timeout 120 python3 -m scripts.bench.selector --graph --out "$R/bench_selector.json" > "$R/bench_selector.log" 2>&1
  echo "bench_selector rc=$?" >> "$R/bench_selector.log"
  timeout 300 python3 -m scripts.bench.step --profile --contexts 65536 --out "$R/bench_step.json" --repeats 4 \
    --warmup 2 > "$R/bench_step.log" 2>&1
  echo "bench_step rc=$?" >> "$R/bench_step.log"
}

retrieval_run() {  # retrieval_run <recipe>
  timeout 230 python3 -m sparse_train.cli fit --config "recipes/$1.yaml" --logger_backend csv \
    --trainer.max_steps=900 --trainer.val_check_interval=150 --trainer.default_root_dir="$R/$1" > "$R/$1.log" 2>&1
  echo "$1 rc=$?" >> "$R/$1.log"
}

case "$phase" in
  tests)
    # Most of the suite's time is Triton compiling on the CPU, so parts side by side share one GPU well.
    kernel_part1="tests/kernels/test_kernel_backward.py"
    kernel_part2="tests/kernels/test_kernel_forward.py tests/kernels/test_kernel_tma.py tests/kernels/test_kernel_documents.py"
    kernel_part3=$(ls tests/kernels/test_*.py | grep -v -E "tests/kernels/test_kernel_(backward|forward|tma|documents)\.py")
    # torch.compile's tests (inductor compiles on the CPU) take a part of their own
    other_tests=$(ls tests/test_*.py tests/*/test_*.py | grep -v -E "^tests/kernels/|^tests/test_compile\.py$")
    track 0 gpu_tests gpu_tests_kernels_part1 280 $kernel_part1
    track 0 gpu_tests gpu_tests_kernels_part2 280 $kernel_part2
    track 0 gpu_tests gpu_tests_compile 280 tests/test_compile.py
    track "$gpu_b" gpu_tests gpu_tests_kernels_part3 280 $kernel_part3
    track "$gpu_b" gpu_tests gpu_tests_rest 280 $other_tests
    wait
    if [ "$ngpu" -ge 2 ]; then
      # each part sees one GPU, so the two-GPU tests skipped there: run them with both visible
      gpu_tests gpu_tests_two_gpus 150 tests/kernels/test_kernel_query_blocks.py -k two_gpus
    fi
    cp "$R"/gpu_tests_*.log "$OUT"/ 2>/dev/null
    ;;
  checks)
    if [ "$ngpu" -ge 2 ]; then
      track 0 checks_gpu_a; track 1 checks_gpu_b; wait
    else
      checks_gpu_a; checks_gpu_b
    fi
    cp -r "$R"/bench_attention "$R"/bench_selector.json "$R"/bench_step.json "$OUT"/ 2>/dev/null
    ;;
  retrieval)
    after_sparse() {
      retrieval_run retrieval_16k
      timeout 60 python3 -m pytest -q -rA -s -m gpu tests/kernels/test_kernel_block_mass.py > "$R/gpu_tests_block_mass.log" 2>&1
      echo "block mass gpu tests rc=$?" >> "$R/gpu_tests_block_mass.log"
      timeout 90 python3 -m scripts.bench.selector --out "$R/bench_selector.json" > "$R/bench_selector.log" 2>&1
      echo "bench_selector rc=$?" >> "$R/bench_selector.log"
    }
    after_dense() {
      retrieval_run retrieval_16k_dense
      timeout 240 python3 -m scripts.bench.step --out "$R/bench_step.json" --repeats 4 --warmup 2 > "$R/bench_step.log" 2>&1
      echo "bench_step rc=$?" >> "$R/bench_step.log"
    }
    track 0 after_sparse; track "$gpu_b" after_dense; wait
    for run in retrieval_16k retrieval_16k_dense; do
      m=$(find "$R/$run" -name metrics.csv 2>/dev/null | head -n 1)
      [ -n "$m" ] && cp "$m" "$OUT/${run}_metrics.csv"
    done
    cp "$R"/bench_selector.json "$R"/bench_step.json "$R"/gpu_tests_block_mass.log "$OUT"/ 2>/dev/null
    ;;
  limits)
    d=${HEAD_DIM:-128}
    timeout "${BENCH_TIMEOUT:-300}" python3 -m scripts.bench.attention --out "$R/bench_attention_d$d" --no-sweep \
      --n 65536 --head-dim "$d" > "$R/bench_attention_d$d.log" 2>&1
    echo "bench_attention rc=$?" >> "$R/bench_attention_d$d.log"
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    if [ -z "$ncu_bin" ]; then
      echo "no ncu on this machine" > "$R/ncu_missing.txt"
    fi
    for pattern in ${NCU_PATTERNS-P128 P64}; do
      [ -n "$ncu_bin" ] || break
      name="ncu_d${d}_$pattern"
      # --clock-control none: the card's clocks stay as they are
      timeout "${NCU_TIMEOUT:-150}" "$ncu_bin" --clock-control none --profile-from-start off --print-units base --csv --page raw \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 -m scripts.tools.ncu_kernel_limits run --head-dim "$d" --pattern "$pattern" > "$R/$name.csv" 2> "$R/$name.log"
      echo "ncu rc=$?" >> "$R/$name.log"
      python3 -m scripts.tools.ncu_kernel_limits summarize "$R/$name.csv" --out "$R/$name.json" > "$R/$name.md" 2>> "$R/$name.log"
    done
    # the device tool returns 8 files: the tarball has every log and raw CSV
    cp "$R"/bench_attention_d*/*.json "$R"/bench_attention_d*/*.md "$R"/ncu_*.json "$OUT"/ 2>/dev/null
    ;;
  step)
    # the card's clocks and power through the runs: at the power cap the step's kernels run below the benchmark's
    # clock
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 250 > "$R/clocks_step.csv" &
    clocks_pid=$!
    step() {  # step <name> <timeout> <bench_step arguments...>
      local name=$1 limit=$2; shift 2
      timeout "$limit" python3 -m scripts.bench.step --act-ckpt on --out "$R/step_$name.json" "$@" > "$R/step_$name.log" 2>&1
      echo "bench_step $name rc=$?" >> "$R/step_$name.log"
    }
    step 64k_keep 150 --contexts 65536 --repeats 4 --warmup 2 --profile --keep-attention on \
      --kernel-table "$R/kernels_64k_keep"
    step 64k_recompute 150 --contexts 65536 --repeats 4 --warmup 2 --profile --keep-attention off \
      --kernel-table "$R/kernels_64k_recompute"
    step 64k_distill_off 60 --contexts 65536 --variants sparse --repeats 4 --warmup 2 --profile --distill off
    step 128k_keep 200 --contexts 131072 --repeats 3 --warmup 1 --profile --keep-attention on
    # 16K is partly host-bound, so its step time varies more: 10 repeats
    step 16k 130 --contexts 16384 --repeats 10 --warmup 3 --kernel-table "$R/kernels_16k"
    kill "$clocks_pid"
    cp "$R"/step_*.json "$OUT"/ 2>/dev/null
    ;;
  token)
    # the token selector against the pooled one at 64K: the selection (CUDA-graph replay) and the 1.1B step with
    # the dense twin; the tables of docs/benchmarks/selector_heldout/README.md
    for s in token pooled; do
      # the token selector with exact scores here, with candidate blocks below
      timeout 100 python3 -m scripts.bench.selector --selector "$s" --candidates none --graph \
        --out "$R/selection_64k_$s.json" > "$R/selection_64k_$s.log" 2>&1
      echo "bench_selector $s rc=$?" >> "$R/selection_64k_$s.log"
    done
    timeout 60 python3 -m scripts.bench.selector --selector token --candidates 32 --graph --selector-only \
      --out "$R/selection_64k_token_cand.json" > "$R/selection_64k_token_cand.log" 2>&1
    echo "bench_selector token_cand rc=$?" >> "$R/selection_64k_token_cand.log"
    timeout 240 python3 -m scripts.bench.step --selector pooled --contexts 65536 --variants sparse dense --repeats 4 \
      --warmup 2 --out "$R/step_1p1b_64k_pooled_dense.json" > "$R/step_1p1b_64k_pooled_dense.log" 2>&1
    echo "bench_step pooled_dense rc=$?" >> "$R/step_1p1b_64k_pooled_dense.log"
    timeout 150 python3 -m scripts.bench.step --contexts 65536 --variants sparse --selector token \
      --selector-distill block --repeats 4 --warmup 2 --out "$R/step_1p1b_64k_token.json" > "$R/step_1p1b_64k_token.log" 2>&1
    echo "bench_step token rc=$?" >> "$R/step_1p1b_64k_token.log"
    cp "$R"/selection_64k_*.json "$R"/step_1p1b_64k_*.json "$OUT"/ 2>/dev/null
    ;;
  heldout)
    # candidate blocks against exact token scores on the held-out families at 2K (HELDOUT_LEN=8192 for 8K: needles
    # and copy, with the dense twin and the oracle); each finished job is appended to results.jsonl at once, so a
    # run cut by its timeout keeps what finished (a rerun with the same --out resumes)
    if [ "${HELDOUT_LEN:-2048}" = 2048 ]; then
      args="--families needles,vartrack,copy,assoc --modes token_kl,token_cand --seq-len 2048 --jobs 16"
    else
      args="--families needles,copy --modes ${HELDOUT_MODES:-dense,token_kl,token_cand,oracle} --seq-len $HELDOUT_LEN"
      args="$args --batch 8 --steps ${HELDOUT_STEPS:-1600} --jobs 16"
    fi
    # shellcheck disable=SC2086
    timeout 540 python3 -m scripts.eval.heldout $args --seeds 0,1 --device cuda --out "$OUT/heldout" \
      > "$OUT/heldout.log" 2>&1
    echo "heldout rc=$?" >> "$OUT/heldout.log"
    rm -f "$OUT/heldout/plot.png"  # the device tool returns 8 files: results.jsonl, summary.md, summary.json, the log
    ;;
  seeds2k)
    timeout 580 python3 -m scripts.eval.heldout --families needles,vartrack --modes dense,oracle,token_cand \
      --seeds "${SEEDS:-0,1,2,3,4,5,6,7}" --seq-len 2048 --jobs 16 --stop-after-min 6 --device cuda \
      --out "$OUT/seeds2k" > "$OUT/seeds2k.log" 2>&1
    echo "heldout seeds2k rc=$?" >> "$OUT/seeds2k.log"
    rm -f "$OUT/seeds2k/plot.png" "$OUT/seeds2k/summary.json"
    [ -s "$OUT/seeds2k/errors.jsonl" ] || rm -f "$OUT/seeds2k/errors.jsonl"
    tail -n 3 "$OUT/seeds2k.log"; cat "$OUT/seeds2k/summary.md" 2>/dev/null
    ;;
  vartrack8k)
    # the two splits of docs/benchmarks/selector_heldout's 8K vartrack section, side by side; each finished job is
    # appended to its results.jsonl at once, and a rerun with the same --out resumes
    split() {  # split <name> <heldout options...>
      local name=$1; shift
      timeout 560 python3 -m scripts.eval.heldout --families vartrack --modes token_cand,oracle --seeds 0,1 \
        --seq-len 8192 --batch 8 --steps 3000 --short-steps 300 --mid-steps 700 --mid-len 2048 --jobs 4 \
        --device cuda --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
      echo "heldout $name rc=$?" >> "$OUT/$name.log"
      # the device tool returns 8 files: results.jsonl, summary.md, the log, and errors.jsonl when a job failed
      rm -f "$OUT/$name/plot.png" "$OUT/$name/summary.json"
      [ -s "$OUT/$name/errors.jsonl" ] || rm -f "$OUT/$name/errors.jsonl"
    }
    split vartrack8k_top8 --top-k 8 &
    split vartrack8k_bq16 --block-q 16 &
    wait
    for name in vartrack8k_top8 vartrack8k_bq16; do
      tail -n 3 "$OUT/$name.log"; cat "$OUT/$name/summary.md" 2>/dev/null
    done
    ;;
  vartrack_exact|multihop|assoc8k)
    # held-out runs straight to $OUT; each finished job is appended to its results.jsonl at once, and a rerun with
    # the same OUT resumes
    heldout_run() {  # heldout_run <name> <heldout options...>
      local name=$1; shift
      timeout "${HELDOUT_TIMEOUT:-560}" python3 -m scripts.eval.heldout --device cuda --out "$OUT/$name" "$@" \
        > "$OUT/$name.log" 2>&1
      echo "heldout $name rc=$?" >> "$OUT/$name.log"
      rm -f "$OUT/$name/plot.png" "$OUT/$name/summary.json"  # the device tool returns 8 files
      [ -s "$OUT/$name/errors.jsonl" ] || rm -f "$OUT/$name/errors.jsonl"
    }
    long8k() {  # long8k [2K steps] [batch]: the 8K schedule's options (default 700 steps at 2K, batch 8)
      echo "--seq-len 8192 --batch ${2:-8} --steps 3000 --short-steps 300 --mid-steps ${1:-700} --mid-len 2048"
    }
    if [ "$phase" = vartrack_exact ]; then
      names="vartrack8k_exact vartrack2k_row"
      # shellcheck disable=SC2046
      heldout_run vartrack8k_exact --families vartrack --modes token_kl,token --seeds 0,1 $(long8k) --jobs 4 &
      heldout_run vartrack2k_row --families vartrack --modes row_oracle --seeds 0,1,2,3 --seq-len 2048 --jobs 4 &
    elif [ "$phase" = assoc8k ]; then
      names="assoc8k"
      # shellcheck disable=SC2046
      heldout_run assoc8k --families assoc --modes dense,oracle,default --seeds 0,1 \
        $(long8k "${ASSOC_MID_STEPS:-2000}" "${ASSOC_BATCH:-16}") --jobs 6 &
    else
      names="multihop2k multihop8k"
      heldout_run multihop2k --families multihop --modes dense,oracle,default --seeds 0,1,2,3,4,5,6,7 \
        --seq-len 2048 --jobs 12 &
      # shellcheck disable=SC2046
      heldout_run multihop8k --families multihop --modes dense,oracle,default --seeds 0,1 $(long8k) --jobs 6 &
    fi
    wait
    for name in $names; do
      tail -n 3 "$OUT/$name.log"; cat "$OUT/$name/summary.md" 2>/dev/null
    done
    ;;
  token_kl)
    # the token-level distillation kernels: their GPU tests and the module's; the kernels against the reference at
    # 64K; the module's selection and sampled distillation with 32 candidate blocks; the 1.1B step with that
    # configuration and its dense twin. Each result goes to $OUT as it finishes.
    gpu_tests gpu_tests_token_kl 200 tests/kernels/test_kernel_token_kl.py tests/selection/test_selector_indexer.py \
      tests/module/test_checkpoint_replay.py
    cp "$R"/gpu_tests_token_kl.log "$OUT"/
    timeout 100 python3 -m scripts.bench.token_kl --spans 1024 4096 --out "$R/token_kl_64k.json" \
      > "$R/token_kl_64k.log" 2>&1
    echo "bench_token_kl rc=$?" >> "$R/token_kl_64k.log"
    cp "$R"/token_kl_64k.json "$R"/token_kl_64k.log "$OUT"/ 2>/dev/null
    timeout 90 python3 -m scripts.bench.selector --selector token --candidates 32 --graph \
      --out "$R/module_64k_token_cand.json" > "$R/module_64k_token_cand.log" 2>&1
    echo "bench_selector token_cand rc=$?" >> "$R/module_64k_token_cand.log"
    cp "$R"/module_64k_token_cand.json "$OUT"/ 2>/dev/null
    timeout "${STEP_TIMEOUT:-200}" python3 -m scripts.bench.step --contexts 65536 --variants sparse dense \
      --selector token --candidates 32 --selector-distill token --repeats 4 --warmup 2 \
      --out "$R/step_1p1b_64k_token_cand_dense.json" > "$R/step_1p1b_64k_token_cand_dense.log" 2>&1
    echo "bench_step token_cand rc=$?" >> "$R/step_1p1b_64k_token_cand_dense.log"
    cp "$R"/step_1p1b_64k_token_cand_dense.json "$OUT"/ 2>/dev/null
    ;;
  token_compile)
    # the token selector's kernels under torch.compile (custom ops): the compiled module against eager, then at 64K
    # the selection and the token-level distillation eager against compiled, with exact scores and with candidates
    gpu_tests gpu_tests_token_compile 300 tests/test_compile.py -k token_selector
    cp "$R"/gpu_tests_token_compile.log "$OUT"/
    for c in exact 32; do
      cand="--candidates $c"; [ "$c" = exact ] && cand="--candidates none"
      # shellcheck disable=SC2086
      timeout 240 python3 -m scripts.bench.selector --selector token $cand --compile --selector-only \
        --out "$R/token_compile_64k_$c.json" > "$R/token_compile_64k_$c.log" 2>&1
      echo "bench_selector token_compile $c rc=$?" >> "$R/token_compile_64k_$c.log"
      cp "$R/token_compile_64k_$c.json" "$R/token_compile_64k_$c.log" "$OUT"/ 2>/dev/null
    done
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac

tar czf "$OUT/results-$phase.tar.gz" --exclude='*.ckpt' -C "$R" . 2>/dev/null
echo "==== summary ($phase) ===="
cat "$R/env_$phase.txt"
for f in "$R"/*.log; do echo "--- $(basename "$f")"; grep -E "rc=|passed|failed|Error|error:" "$f" | tail -n 6; done
[ -f "$R/bench_selector.log" ] && tail -n 25 "$R/bench_selector.log"
[ -f "$R/bench_step.log" ] && tail -n 15 "$R/bench_step.log"
for f in "$R"/selection_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; sed -n 2,9p "$f"; }; done
for f in "$R"/step_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -vE "^ {4}" "$f" | tail -n 6; }; done
ls "$R"/bench_attention/*.md >/dev/null 2>&1 && head -n 20 "$R"/bench_attention/*.md
for f in "$R"/bench_attention_d*/*.md; do [ -f "$f" ] && sed -n '/^| N | pattern | density/,$p' "$f" | head -n 40; done
[ -f "$OUT/heldout.log" ] && { tail -n 5 "$OUT/heldout.log"; cat "$OUT/heldout/summary.md" 2>/dev/null; }
for f in "$R"/ncu_*.md; do [ -f "$f" ] && { echo "--- $(basename "$f")"; cat "$f"; }; done
for run in retrieval_16k retrieval_16k_dense; do
  m=$(find "$R/$run" -name metrics.csv 2>/dev/null | head -n 1)
  [ -n "$m" ] && { echo "--- $run metrics (val rows)"; head -n 1 "$m" | cut -c1-300; grep -E "val" "$m" | tail -n 3 | cut -c1-300; }
done
exit 0
