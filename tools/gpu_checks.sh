#!/usr/bin/env bash
# One device call: install carried peer wheels, run the cuda-marked, compile and CUDA-graph tests, then the benchmark.
#   bash tools/gpu_checks.sh [bench args...]      (results under $OUT when set)
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# Three pytest processes side by side on the one GPU (the whole suite in one process takes over 330 s, and
# pytest-xdist is not on every GPU image): tests/test_ws_gemm.py alone in its own (its float64 oracles at V = 130k-
# 150k hold up to ~30 GB each; xdist workers beside it ran out of an H100's memory, 2026-11-25/26), the other
# cuda-marked tests in a second, the compile and CUDA-graph tests in a third. tests/conftest.py hands cached memory
# back after each test. Each lane's log is written outside $OUT and joined into $OUT/tests.log, their tails into
# $OUT/tests.txt: the device returns at most 8 files from $OUT.
LANES=$(mktemp -d)
run_lane() {  # name, pytest arguments...
  local name=$1
  shift
  python3 -m pytest -p no:cacheprovider -q "$@" > "$LANES/$name.log" 2>&1
  echo "exit $?" >> "$LANES/$name.log"
}
run_lane ws-gemm tests/test_ws_gemm.py -m cuda &
run_lane cuda tests -m cuda --ignore=tests/test_ws_gemm.py --ignore=tests/test_compile.py --ignore=tests/test_cuda_graphs.py &
run_lane compile tests/test_compile.py tests/test_cuda_graphs.py &
wait
for lane in ws-gemm cuda compile; do
  echo "=== $lane"
  cat "$LANES/$lane.log"
done > "$OUT/tests.log"
for lane in ws-gemm cuda compile; do
  echo "=== $lane"
  tail -25 "$LANES/$lane.log"
done | tee "$OUT/tests.txt"
python3 tools/benchmarks/peers.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
