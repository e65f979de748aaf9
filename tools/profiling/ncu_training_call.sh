#!/usr/bin/env bash
# Nsight Compute, clocks locked at base (durations are cycles, whatever the power cap does): every kernel of the
# floor's three cuBLAS products and of one flce default training call (or one within MEMORY_BUDGET_MIB), each side
# in its own process between profiler marks; the table (training_call_profile.py table) to $OUT/ncu-call-SHAPE.md.
#
#   bash tools/profiling/ncu_training_call.sh SHAPE [MEMORY_BUDGET_MIB]
set -uo pipefail
OUT=${OUT:-/tmp/flce-out}
shape=${1:?usage: ncu_training_call.sh SHAPE [MEMORY_BUDGET_MIB]}
budget=${2:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
tag=$shape${budget:+-${budget}MiB}
mkdir -p "$OUT"
metrics=$(python3 "$here/tools/profiling/training_call_profile.py" metrics)
for side in floor call; do
  ncu --profile-from-start off --clock-control base --metrics "$metrics" --csv --page raw \
      python3 "$here/tools/profiling/training_call_profile.py" run "$shape" "$side" ${budget:+--budget-mib "$budget"} \
      > "/tmp/ncu-$side-$tag.csv" 2> "/tmp/ncu-$side-$tag.err" || { echo "ncu $side failed:"; tail -5 "/tmp/ncu-$side-$tag.err"; }
done
{
  echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $shape${budget:+, memory_budget $budget MiB},"
  echo "ncu --clock-control base; $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
  echo
  python3 "$here/tools/profiling/training_call_profile.py" table "/tmp/ncu-floor-$tag.csv" "/tmp/ncu-call-$tag.csv"
} > "$OUT/ncu-call-$tag.md"
cat "$OUT/ncu-call-$tag.md"
