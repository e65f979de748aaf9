#!/usr/bin/env bash
# GPU check of a newer Triton than the GPU image's own (torch 2.11 + Triton 3.6), carried in as the pieces
# tools/compat/pack_triton.sh makes (.whl/triton-<version>.tar.xz.part-*, .whl/triton-<version>.sha256).
#
#   bash tools/compat/gpu_triton_check.sh tests VERSION
#       the GPU tests under the carried Triton: pytest -m cuda (tests/test_ws_gemm.py serially), the compile
#       and CUDA-graph tests, the compat probe; results in $OUT/tests-<version>.txt
#   bash tools/compat/gpu_triton_check.sh bench VERSION [SHAPES]
#       one round of flce, torch.compile and the cuBLAS 3-GEMM floor (tools/benchmarks/peers.py): a process
#       under the image's Triton, then one under the carried Triton. Call it again for another round (the
#       rounds are kept in /tmp/flce-compat-bench while the machine stays up); every call writes the table of
#       all rounds so far, side by side, to $OUT/compare-<version>.md
#
# The carried Triton is unpacked once into /tmp/triton-<version> and put first on PYTHONPATH; each step
# prints which torch and Triton it ran with. torch 2.11's inductor may not work with a Triton it was not
# built against: a torch.compile row that fails under the carried Triton shows that error.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flce-out}
mkdir -p "$OUT"
step=${1:?usage: gpu_triton_check.sh tests|bench VERSION [SHAPES]}
version=${2:?usage: gpu_triton_check.sh tests|bench VERSION [SHAPES]}
new_site=/tmp/triton-$version

unpack() {
    if [ -f "$new_site/.unpacked" ]; then
        return 0
    fi
    local parts=(.whl/triton-"$version".tar.xz.part-*)
    [ -e "${parts[0]}" ] || { echo "no .whl/triton-$version.tar.xz.part-* here: carry them first" >&2; exit 1; }
    cat "${parts[@]}" > "/tmp/triton-$version.tar.xz"
    if ! (cd /tmp && sha256sum -c "$OLDPWD/.whl/triton-$version.sha256"); then
        echo "the joined pieces (${#parts[@]}: ${parts[*]}) do not match .whl/triton-$version.sha256: a piece is" \
             "missing or stale" >&2
        exit 1
    fi
    rm -rf "$new_site" && mkdir -p "$new_site"
    xz -dc "/tmp/triton-$version.tar.xz" | tar -x -C "$new_site" && touch "$new_site/.unpacked"
}

versions() {  # the torch and Triton a PYTHONPATH gives
    PYTHONPATH=$1 python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__} ({triton.__file__})')"
}

unpack
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "$step" = tests ]; then
    export PYTHONPATH=$new_site:$PWD
    log=$OUT/tests-$version.txt
    versions "$PYTHONPATH" | tee "$log"
    python3 -m flce info 2>&1 | sed -n '/cuda kernels:/,/^$/p' | tee -a "$log"
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 2)
    # tests/test_ws_gemm.py serially: its float64 oracles hold up to ~30 GB each (see tools/gpu_checks.sh).
    timeout 330 python3 -m pytest -p no:cacheprovider tests -m cuda -q "${workers[@]}" \
        --ignore=tests/test_ws_gemm.py 2>&1 | tail -15 | tee -a "$log"
    timeout 150 python3 -m pytest -p no:cacheprovider tests/test_ws_gemm.py -q 2>&1 | tail -8 | tee -a "$log"
    timeout 90 python3 -m pytest -p no:cacheprovider tests/test_compile.py tests/test_cuda_graphs.py \
        tests/test_gluon_compat.py -q 2>&1 | tail -8 | tee -a "$log"
    echo "--- summary (triton $version)"; grep -E "passed|failed|error" "$log"
elif [ "$step" = bench ]; then
    shapes=${3:-8192x4096x128256,16384x2048x151936}
    results=/tmp/flce-compat-bench
    mkdir -p "$results"
    round=$(( $(find "$results" -name "bench-image-r*.json" | wc -l) + 1 ))
    for side in image "$version"; do
        path=$PWD
        [ "$side" = image ] || path=$new_site:$PWD
        label=$(versions "$path" | tee -a "$results/bench-versions.txt")
        echo "round $round: $label"
        PYTHONPATH=$path timeout 270 python3 tools/benchmarks/peers.py --methods flce,torch_compile \
            --shapes "$shapes" --json "$results/bench-$side-r$round.json" > "$OUT/bench-$side-r$round.log" 2>&1 \
            || echo "  (exit $?: see bench-$side-r$round.log)"
    done
    cp "$results"/*.json "$OUT/" 2>/dev/null
    python3 - "$results" "$version" <<'PY' | tee "$OUT/compare-$version.md"
import glob, json, statistics, sys
out, version = sys.argv[1], sys.argv[2]
rows, tritons = {}, {}
for side in ("image", version):
    for path in sorted(glob.glob(f"{out}/bench-{side}-r*.json")):
        run = json.load(open(path))  # peers.py --json: the rows with the GPU and the versions they ran with
        tritons.setdefault(side, set()).add(f"{run['gpu']}, torch {run['versions']['torch']}, "
                                            f"triton {run['versions'].get('triton', '?')}")
        for row in run["rows"]:
            rows.setdefault((row["shape"], row["method"]), {}).setdefault(side, []).append(row)
def cell(measured):
    if not measured:
        return "not run"
    errors = [r["error"] for r in measured if "error" in r]
    if errors:
        return f"error: {errors[0][:60]}"
    ms = statistics.median(r["fwd_bwd_ms"] for r in measured)
    ratio = statistics.median(r.get("ratio", 1.0) for r in measured)
    return f"{ms:.2f} ms ({ratio:.3f}x floor, {len(measured)} rounds)"
print(f"fwd+bwd, bf16, median over rounds (one process per Triton and round, alternating); image Triton vs {version}")
for side, runs in tritons.items():
    print(f"- {side}: {'; '.join(sorted(runs))}")
print()
print(f"| shape | method | image Triton | triton {version} | {version} / image |")
print("|---|---|---|---|---|")
for (shape, method), sides in sorted(rows.items()):
    a, b = sides.get("image", []), sides.get(version, [])
    ok = all("error" not in r for r in a + b) and a and b
    change = f"{statistics.median(r['fwd_bwd_ms'] for r in b) / statistics.median(r['fwd_bwd_ms'] for r in a):.3f}" if ok else ""
    print(f"| {shape} | {method} | {cell(a)} | {cell(b)} | {change} |")
PY
    sort -u "$results/bench-versions.txt"
else
    echo "unknown step '$step' (expected tests or bench)" >&2
    exit 2
fi
