#!/usr/bin/env bash
# Every multi-GPU measurement of docs/distributed.md in one call, one torchrun per part, NCCL, as many ranks
# as GPUs (2 or 4; the parts adapt: TP up to the GPU count, the 2-D mesh at 4 and more).
#   bash tools/distributed/gpu_run.sh              # results under $OUT: results.json, summary.md, run.log,
#                                                  # memory_snapshot_tp_{torch,flce}.pickle.gz
#   bash tools/distributed/gpu_run.sh --dry-run    # the same parts on CPU ranks with gloo, tiny sizes
# megatron-core is needed for the Megatron parts (carried as a wheel: pip install --target, PYTHONPATH);
# without it they are skipped and the log says so. Each part has its own time limit (seconds, overridable:
# FLCE_T_VOCAB, FLCE_T_MEGATRON, FLCE_T_REALISTIC, FLCE_T_CLIENT), so one failure does not eat the run.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/build/gpu_run_out}
PYTHON=${PYTHON:-python3}
PARTS=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/run.log"
: > "$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NVLink multicast stays off (the machines' rule: it can take the host's shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

if [ $DRY = 1 ]; then
  NPROC=${NPROC:-4}
  VOCAB_ARGS=(--device cpu --shapes 512x64x4000:even,512x64x4100:uneven --iters 2 --warmup 1)
  MEGATRON_ARGS=(--device cpu --steps 2 --iters 2 --warmup 1)
  REALISTIC_ARGS=(--device cpu --steps 2 --modes tp,fsdp,fsdp_tp --mixed --vocab 1000 --dim 64 --heads 4
                  --layers 1 --seq 32 --batch 2)
  CLIENT_ARGS=(--device cpu --steps 2 --vocab 96 --dim 32 --layers 2 --heads 4 --seq 16 --batch 2)
else
  NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
  VOCAB_ARGS=()
  MEGATRON_ARGS=()
  REALISTIC_ARGS=(--realistic --steps 4 --snapshot tp)
  CLIENT_ARGS=(--steps 5)
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nvidia-smi topo -m
  } >> "$LOG" 2>&1
fi
"$PYTHON" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" >> "$LOG" 2>&1
HAVE_MEGATRON=1
"$PYTHON" -c "import megatron.core; print('megatron-core', megatron.core.__version__)" >> "$LOG" 2>&1 || HAVE_MEGATRON=0
echo "ranks: $NPROC, megatron-core importable: $HAVE_MEGATRON, results: $OUT" | tee -a "$LOG"

part() {  # part NAME LIMIT SCRIPT ARGS...: one torchrun, its output in the log, its files in $PARTS/NAME
  local name=$1 limit=$2 script=$3
  shift 3
  local start=$SECONDS
  mkdir -p "$PARTS/$name"
  echo "=== $name (limit ${limit}s): $script $*" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "$limit" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" "$script" --out "$PARTS/$name" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
}

part vocab_parallel "${FLCE_T_VOCAB:-160}" tools/distributed/vocab_parallel.py ${VOCAB_ARGS[@]+"${VOCAB_ARGS[@]}"}
if [ $HAVE_MEGATRON = 1 ]; then
  part megatron "${FLCE_T_MEGATRON:-160}" tools/distributed/megatron_client.py ${MEGATRON_ARGS[@]+"${MEGATRON_ARGS[@]}"}
else
  echo "=== megatron: skipped, megatron-core is not importable" | tee -a "$LOG"
fi
part client_realistic "${FLCE_T_REALISTIC:-140}" tools/distributed/dtensor_client.py "${REALISTIC_ARGS[@]}"
part client "${FLCE_T_CLIENT:-80}" tools/distributed/dtensor_client.py "${CLIENT_ARGS[@]}"

# Snapshots come back only under 15 MiB each (the transfer's limit is 16 MiB a file).
for snapshot in "$PARTS"/client_realistic/memory_snapshot_*.pickle.gz; do
  [ -f "$snapshot" ] || continue
  if [ "$(stat -c %s "$snapshot")" -lt $((15 * 1024 * 1024)) ]; then
    cp "$snapshot" "$OUT/"
  else
    echo "$(basename "$snapshot"): $(stat -c %s "$snapshot") bytes, too large to bring back" | tee -a "$LOG"
  fi
done
"$PYTHON" tools/distributed/gpu_summary.py "$PARTS" "$OUT" 2>&1 | tee -a "$LOG"
rm -rf "$PARTS"
