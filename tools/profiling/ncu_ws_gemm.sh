#!/usr/bin/env bash
# Nsight Compute on the LM-head GEMMs of tools/benchmarks/ws_gemm_profile.py (one launch each, after a warm-up
# launch): speed of light, warp states (stall reasons), memory workload and scheduler statistics, as text.
#
#   bash tools/profiling/ncu_ws_gemm.sh SHAPE PRODUCT [TAG]
#       e.g. 1536x2048x151936 kept (the statistics GEMM of a training chunk keeping nothing / logits /
#       exponentials) or 1536x2048x151936 logits (cuBLAS, then flce's plain ws GEMM)
#
# FLCE_CHECKOUT=DIR profiles another checkout (holding flce/ and tools/, e.g. a baseline unpacked by
#   git archive main flce tools | tar -x -C build/ab/main); the report goes to $OUT/ncu-TAG-PRODUCT-SHAPE.txt,
# with the torch, Triton and flce it ran under on its first line.
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
shape=${1:?usage: ncu_ws_gemm.sh SHAPE PRODUCT [TAG]}
product=${2:?usage: ncu_ws_gemm.sh SHAPE PRODUCT [TAG]}
tag=${3:-run}
here=${FLCE_CHECKOUT:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$here" && pwd)
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
report=$OUT/ncu-$tag-$product-$shape.txt
mkdir -p "$OUT"
python3 -c "import torch, triton, flce; print('torch', torch.__version__, 'triton', triton.__version__, 'flce', flce.__file__)" > "$report"
ncu --profile-from-start off --clock-control none -k 'regex:nvjet|gemm|_ws_gemm' \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section LaunchStats --page details \
    python3 "$here/tools/benchmarks/ws_gemm_profile.py" "$shape" "$product" >> "$report" 2>&1
echo "ncu $tag $product $shape: rc $? -> $report"
