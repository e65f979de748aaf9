#!/usr/bin/env bash
# One device call: install carried peer wheels, run the tests a GPU runs (cuda-marked, and triton-marked: the Triton
# kernels' tests, interpreted on a CPU, compiled here), the compile and CUDA-graph tests, in lanes side by side,
# then (only when arguments are given) the peers benchmark with those arguments.
#   bash tools/gpu_checks.sh                      the tests (about 5 minutes on two H200s, the lanes spread over them)
#   bash tools/gpu_checks.sh --quick              the tests, then tools/benchmarks/peers.py --quick
# Results under $OUT when set. LANE_TIMEOUT (seconds, default 540) bounds each lane, so a slow lane still leaves
# every lane's log.
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
LANE_TIMEOUT=${LANE_TIMEOUT:-540}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# Pytest processes side by side on the one GPU (the whole suite in one process takes over 330 s, and pytest-xdist
# is not on every GPU image), each lane a few test files of similar length. tests/test_ws_gemm.py runs alone in its
# lane: its float64 oracles at V = 130k-150k hold up to ~30 GB each (xdist workers beside it ran out of an H100's
# memory). tests/conftest.py hands cached memory back after each test. Each lane's log is written outside $OUT and
# joined into $OUT/tests.log, their tails into $OUT/tests.txt: the device returns at most 8 files from $OUT.
LANES=$(mktemp -d)
declare -A LANE_FILES=(
  [ws-gemm]="tests/test_ws_gemm.py"
  [softcap-precision]="tests/test_softcap.py tests/test_precision.py"
  [cuda-backend]="tests/test_cuda_backend.py tests/test_detach_extras.py tests/test_targets.py tests/test_measure.py"
  [generic-path]="tests/test_generic_path_gpu.py"
  [losses]="tests/test_distillation_gpu.py tests/test_distillation_compile.py tests/test_policy_loss.py tests/test_policy_explain.py tests/test_policy_compile.py tests/test_rl_objective.py tests/test_rl_options.py"
  [explain-forward]="tests/test_explain_gpu.py tests/test_cuda_fused_forward.py"
  [distillation-cuda]="tests/test_distillation_cuda.py tests/test_distillation_autograd.py tests/test_distillation_trainers.py tests/test_distillation_liger.py tests/test_distillation_entropy.py"
)
ALL_NAMED=" ${LANE_FILES[*]} "
# On a host of several GPUs the lanes take them in turn (each lane sees one, as its device 0).
GPUS=$(nvidia-smi -L | wc -l)
LANE_INDEX=0
run_lane() {  # name, pytest arguments...
  local name=$1
  shift
  CUDA_VISIBLE_DEVICES=$((LANE_INDEX % GPUS)) timeout "$LANE_TIMEOUT" python3 -m pytest -p no:cacheprovider -q -rfE "$@" > "$LANES/$name.log" 2>&1
  echo "exit $?" >> "$LANES/$name.log"
}
for lane in "${!LANE_FILES[@]}"; do
  # shellcheck disable=SC2086
  run_lane "$lane" ${LANE_FILES[$lane]} -m "cuda or triton" &
  LANE_INDEX=$((LANE_INDEX + 1))
done
# Every other such test (a file added later and not yet in a lane), then the compile and graph tests.
run_lane others tests -m "cuda or triton" $(printf -- '--ignore=%s ' ${ALL_NAMED}) --ignore=tests/test_compile.py --ignore=tests/test_cuda_graphs.py &
LANE_INDEX=$((LANE_INDEX + 1))
run_lane compile tests/test_compile.py tests/test_cuda_graphs.py &
wait
NAMES=("${!LANE_FILES[@]}" others compile)
for lane in "${NAMES[@]}"; do
  echo "=== $lane"
  cat "$LANES/$lane.log"
done > "$OUT/tests.log"
for lane in "${NAMES[@]}"; do
  echo "=== $lane"
  tail -15 "$LANES/$lane.log"
done | tee "$OUT/tests.txt"
if (($#)); then
  python3 tools/benchmarks/peers.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
