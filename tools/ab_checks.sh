#!/usr/bin/env bash
# One device call for a change that must not change speed: the cuda-marked tests (the explain-versus-profiler
# test tests/test_explain_gpu.py among them), the compile and CUDA-graph tests, then benchmarks/ab.py against a
# baseline checkout unpacked into an ignored folder (carried to the device):
#   mkdir -p build/ab/main && git -C <repo> archive main flce | tar -x -C build/ab/main
#   bash tools/ab_checks.sh build/ab/main [ab.py args]      (results under $OUT when set)
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
BASELINE=${1:?usage: bash tools/ab_checks.sh BASELINE_DIR [ab.py args]}
shift
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 3)
python3 -m pytest -p no:cacheprovider tests -m cuda -q "${workers[@]}" --ignore=tests/test_ws_gemm.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
python3 -m pytest -p no:cacheprovider tests/test_ws_gemm.py -m cuda -q 2>&1 | tail -25 | tee -a "$OUT/tests.txt"
python3 -m pytest -p no:cacheprovider tests/test_compile.py tests/test_cuda_graphs.py -q 2>&1 | tail -5 | tee -a "$OUT/tests.txt"
python3 tools/benchmarks/ab.py --baseline "$BASELINE" --json "$OUT/ab.json" --markdown "$OUT/ab.md" "$@" 2>&1 | tee "$OUT/ab.log" | tail -20
