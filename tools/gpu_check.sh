#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in one call: build, CUDA tests, the main job on the GPU (alone and under
# torchrun as a world of 1 over NCCL), and the issues' GPU benchmarks. Each phase has its own time limit and log
# (under $OUT, else ./gpu-out); a phase that fails or times out does not stop the next.
#
#     bash tools/gpu_check.sh [PHASE...]     phases: setup cuda_tests train benches disk suite
#                                           (default: setup cuda_tests train benches)
#
# Environment: BENCH_STEPS (default 5), SUITE_WORKERS (pytest-xdist workers for `suite`, default 8), SUITE_LIMIT (s),
# SUITE_TESTS (test files for `suite`, default all),
# TESTS (pytest arguments for `cuda_tests`, default tests/test_cuda.py), ZERO_ARGS (extra arguments for the zero bench).
# Phase `disk` runs the CPU-side checkpoint and SSD-engine benches on that machine's disk.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/angel-gpu.XXXX)
PHASES=${*:-setup cuda_tests train benches}
STEPS=${BENCH_STEPS:-5}
SUMMARY="$OUT/summary.txt"


phase() {  # phase NAME LIMIT_S COMMAND...: runs COMMAND with a time limit, logging to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$(date +%s)
    timeout -k 10 "$limit" bash -c "$*" >>"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc $(( $(date +%s) - start ))s :: $*" | cut -c1-240 | tee -a "$SUMMARY"
}

for p in $PHASES; do
  case $p in
    setup)
      phase setup 60 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V; \
        python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))'"
      phase setup 240 "python3 -m pip install -q --no-build-isolation --no-deps -e . && \
        python3 -c 'import angel_ptm._native as n; print(\"native:\", n.crc32c_impl())'" ;;
    cuda_tests)
      phase cuda_tests 300 "python3 -m pytest -q -p no:cacheprovider -o addopts= --timeout 120 -rfE ${TESTS:-tests/test_cuda.py}" ;;
    train)
      phase train 120 "cd $WORK && angel-ptm train --set trainer.steps=30 --set run.dir=$WORK/runs && ls $WORK/runs/*"
      phase train 120 "cd $WORK && torchrun --nproc-per-node 1 -m angel_ptm train --set trainer.steps=30 \
        --set run.dir=$WORK/torchrun --set memory.device_budget=16MiB --set memory.host_budget=16MiB" ;;
    benches)
      phase benches 150 "python3 -m tools.bench.zero --nproc 1 --device cuda --dir $WORK/zero --steps $STEPS --warmup 2 ${ZERO_ARGS:-}"
      phase benches 120 "python3 -m tools.bench.tp --nproc 1 --device cuda --dir $WORK/tp --steps $STEPS --warmup 2"
      phase benches 150 "python3 -m tools.bench.activations --device cuda --dir $WORK/act --repeats $STEPS" ;;
    disk)
      phase disk 150 "python3 -m tools.bench.checkpoint --dir $WORK/ckpt"
      phase disk 120 "python3 -m tools.bench.io --dir $WORK/io --repeats 3" ;;
    suite)
      # failures logged as they happen ($OUT/failures.log): a suite cut off by its limit still names them
      phase suite ${SUITE_LIMIT:-420} "OUT=$OUT python3 -m pytest -q -p no:cacheprovider -p tools.pytest_failures \
        -n ${SUITE_WORKERS:-8} --timeout 300 -rfE ${SUITE_TESTS:-}" ;;
    *) echo "unknown phase $p" | tee -a "$SUMMARY" ;;
  esac
done
echo "=== summary"; cat "$SUMMARY"
for f in "$OUT"/*.log; do echo "=== tail $f"; tail -n 15 "$f"; done | tail -c 9000
