#!/usr/bin/env bash
# For a change that must not change speed, in two device calls (each within a call's 10 minutes):
#   bash tools/ab_checks.sh tests                         the cuda-marked tests (tests/test_explain_gpu.py among
#                                                         them: the kernels that ran are the ones explain named),
#                                                         then the compile and CUDA-graph tests
#   bash tools/ab_checks.sh ab BASELINE_DIR [ab.py args]  benchmarks/ab.py: this checkout against a baseline
#                                                         unpacked into an ignored folder and carried, e.g.
#       mkdir -p build/ab/main && git archive main flce | tar -x -C build/ab/main
# Results under $OUT when set.
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
PART=${1:?usage: bash tools/ab_checks.sh tests | ab BASELINE_DIR [ab.py args]}
shift
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$PART" = tests ]; then
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n 2)
  python3 -m pytest -p no:cacheprovider tests -m cuda -q "${workers[@]}" --ignore=tests/test_ws_gemm.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
  python3 -m pytest -p no:cacheprovider tests/test_ws_gemm.py -m cuda -q 2>&1 | tail -25 | tee -a "$OUT/tests.txt"
  python3 -m pytest -p no:cacheprovider tests/test_compile.py tests/test_cuda_graphs.py -q 2>&1 | tail -5 | tee -a "$OUT/tests.txt"
elif [ "$PART" = ab ]; then
  BASELINE=${1:?usage: bash tools/ab_checks.sh ab BASELINE_DIR [ab.py args]}
  shift
  python3 tools/benchmarks/ab.py --baseline "$BASELINE" --json "$OUT/ab.json" --markdown "$OUT/ab.md" "$@" 2>&1 | tee "$OUT/ab.log" | tail -20
else
  echo "unknown part $PART: expected tests or ab" >&2
  exit 2
fi
