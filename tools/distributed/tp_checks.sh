#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs, NCCL, under 8 minutes (each part has its own time limit):
#   1. tools/distributed/vocab_parallel.py --tp 1,2: its correctness checks (the sharded calls against the unsharded
#      op and float64, grad_hidden's all-reduce now started beside the last weight-gradient product), then TP = 2
#      against TP = 1 at 16384x4096x128256 (even shards) and 16384x4096x151936 (uneven), time and memory;
#   2. tools/distributed/tp_fp32_probe.py: the fp32 client's output layer and loss alone, torch against flce
#      (DTensor, plain tensors, a 2-D (dp=1, tp) mesh with FSDP2), TF32 off and on, and the top CUDA kernels;
#   3. tools/distributed/dtensor_client.py --modes tp: the fp32 client's whole TP step, torch against flce.
#   bash tools/distributed/tp_checks.sh     # results under $OUT (default build/tp_checks_out): *.md, *.json, run.log
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/build/tp_checks_out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: > "$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NVLink multicast stays off (the machines' rule: it can take the host's shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1

part() {  # part NAME LIMIT SCRIPT ARGS...
  local name=$1 limit=$2 script=$3
  shift 3
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $script $*" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "$limit" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node 2 "$script" --out "$OUT" "$@" >> "$LOG" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s" | tee -a "$LOG"
}

part vocab_parallel "${FLCE_T_VOCAB:-240}" tools/distributed/vocab_parallel.py --tp 1,2 --no-peer
part tp_fp32_probe "${FLCE_T_PROBE:-120}" tools/distributed/tp_fp32_probe.py
part client_tp "${FLCE_T_CLIENT:-100}" tools/distributed/dtensor_client.py --modes tp --steps 5
tail -n +1 "$OUT"/vocab_parallel.md "$OUT"/tp_fp32_probe.md "$OUT"/dtensor_client.md 2>/dev/null | tee -a "$LOG"
