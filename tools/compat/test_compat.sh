#!/usr/bin/env bash
# `make test-compat`: flce at both ends of its supported range (pyproject.toml's bounds), each in an
# environment of its own under build/compat/, built once from wheels cached in build/compat/wheels/<pair>
# and reused on later runs (rebuilt when this script's requirements change):
#
#   oldest   torch 2.9.1 + triton 3.5.1 (the Triton it pins), Python 3.10
#   newest   torch 2.15.0 + triton 3.9.0 (the Triton it pins), Python 3.13
#
# In each: flce's wheel is installed with pip's ordinary dependency resolution, and pip must leave that
# torch and Triton as they are; then the public contract on the reference backend, the Triton kernels
# through the interpreter, and the sm_90a compile tests of every Gluon/TMA kernel variant run there.
# The torch wheels are PyPI's (CUDA builds, with their nvidia-* libraries: about 7 GB for both pairs, once; no
# CPU build of these releases is on the package index). The machine's pip constraint that caps torch
# (/etc/xdg/pip) is lifted for these environments only (PIP_CONSTRAINT=/dev/null).
# Usage: tools/compat/test_compat.sh [oldest] [newest]   (PYTHON: the interpreter that builds flce's wheel)
#
# COMPAT_DISCARD=1 (CI, whose clone is thrown away afterwards) keeps nothing: each pair's wheels are deleted
# once its environment is installed and the environment once its tests end (about 10 GB a pair at its peak).
# Where less than 30 GB is free it also runs the pairs one after the other instead of side by side, so that
# at most one pair is on disk at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
DISCARD=${COMPAT_DISCARD:-0}
ROOT=build/compat
WHEELS=$ROOT/wheels
# What the tests need beside torch and Triton (the test extra's, without transformers: no test here uses it).
TEST_PACKAGES=("pytest>=8" "hypothesis>=6" "numpy<2.3" "pyyaml>=6")

pair() {  # name -> "torch triton python"
    case $1 in
        oldest) echo "2.9.1 3.5.1 3.10" ;;
        newest) echo "2.15.0 3.9.0 3.13" ;;
        *) echo "unknown pair '$1' (expected oldest or newest)" >&2; return 1 ;;
    esac
}

find_python() {  # an interpreter of Python $1 (on PATH, or pyenv's), else python3 with a note on stderr
    local candidate
    for candidate in "python$1" "$(pyenv root 2>/dev/null || echo /nonexistent)/versions/$1"*/bin/"python$1"; do
        if "$candidate" -c "" 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    echo "test-compat: no Python $1 here; using $(python3 --version 2>&1)" >&2
    echo python3
}

build_env() {  # name torch triton python -> the environment's directory, built unless already there
    local name=$1 torch=$2 triton=$3 python wheels=$WHEELS/$1
    python=$(find_python "$4")
    local requirements=("torch==$torch" "triton==$triton" "${TEST_PACKAGES[@]}")
    local env=$ROOT/$name-torch$torch-triton$triton-py$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    local stamp
    stamp="$env/.built-$(echo "${requirements[*]}" | md5sum | cut -c1-8)"
    if [ ! -f "$stamp" ]; then
        local log=$env.log
        echo "test-compat: building $env (once; reused on later runs; pip's output in $log)" >&2
        rm -rf "$env"
        mkdir -p "$wheels"
        {
            "$python" -m venv "$env" &&
            PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip download --no-cache-dir -d "$wheels" \
                "${requirements[@]}" &&
            PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install --no-index --find-links "$wheels" \
                "${requirements[@]}"
        } > "$log" 2>&1 || { tail -30 "$log" >&2; echo "test-compat: building $env failed (above)" >&2; return 1; }
        touch "$stamp"
        [ "$DISCARD" != 1 ] || rm -rf "$wheels"
    fi
    echo "$env"
}

check_pair() {
    local name=$1 torch triton python_version env wheel
    read -r torch triton python_version < <(pair "$name")
    env=$(build_env "$name" "$torch" "$triton" "$python_version")
    wheel=$(ls "$ROOT"/dist/flce-*.whl)
    # Ordinary resolution (dependencies included, nothing but the cached wheels to choose from): pip must
    # find this torch and Triton within flce's bounds and keep them.
    "$env/bin/python" -m pip uninstall -q -y flce 2> /dev/null || true
    PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q --no-index --find-links "$WHEELS/$name" \
        "$wheel[triton]"
    "$env/bin/python" - "$torch" "$triton" <<'PY'
import sys
from importlib.metadata import version
want = {"torch": sys.argv[1], "triton": sys.argv[2]}
got = {name: version(name).split("+")[0] for name in want}
assert got == want, f"installing flce changed {want} into {got}"
print(f"test-compat: flce {version('flce')} installed next to torch {got['torch']} + triton {got['triton']}, "
      f"Python {sys.version.split()[0]}: both kept")
PY
    echo "test-compat: $name: tests" >&2
    # The checkout's flce (PYTHONPATH), so the tests see the sources they were written against.
    local status=0
    PYTHONPATH=$PWD "$env/bin/python" -m pytest -q -rfEs -p no:cacheprovider "${TESTS[@]}" || status=$?
    if [ "$DISCARD" = 1 ]; then
        echo "test-compat: $name: removing $env ($(du -sh "$env" | cut -f1))"
        rm -rf "$env"
    fi
    return $status
}

# The contract on the reference backend, the interpreted Triton kernels, the sm_90a compile tests.
TESTS=(
    tests/test_reference_contract.py tests/test_inputs.py tests/test_module.py tests/test_registry.py
    tests/test_autograd_contract.py tests/test_compile.py
    tests/test_cuda_backend.py tests/test_cuda_fused_forward.py tests/test_exp_grad.py tests/test_targets.py
    tests/test_ws_gemm.py tests/test_gluon_compat.py tests/test_packaging.py
)

rm -rf "$ROOT/dist"
mkdir -p "$ROOT/dist"
"$PYTHON" -c "from setuptools import build_meta as hooks; hooks.build_wheel('$ROOT/dist')" > "$ROOT/dist/build.log" 2>&1 \
    || { cat "$ROOT/dist/build.log" >&2; exit 1; }
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(oldest newest)

run_pair() {  # name: its build and tests, output to build/compat/<name>.out
    local start=$SECONDS
    echo "test-compat: $1 starts; free disk: $(df -h --output=avail . | tail -1 | tr -d ' ')"
    check_pair "$1"
    echo "test-compat: $1 done in $((SECONDS - start)) s"
}

# Each pair in a background process of its own (where `set -e` holds, which a `||` would switch off),
# its output in build/compat/<pair>.out, printed when it ends. Side by side (the Triton compiler and
# interpreter keep about one core busy each, CI has two, and one pair's download overlaps the other's
# tests), unless COMPAT_DISCARD=1 on a disk with less than SIDE_BY_SIDE_GB free: then one after the other,
# so that at most one pair is on disk.
SIDE_BY_SIDE_GB=30
free_gb=$(df -BG --output=avail "$ROOT" | tail -1 | tr -dc '0-9')
sequential=0
if [ "$DISCARD" = 1 ] && [ "$free_gb" -lt "$SIDE_BY_SIDE_GB" ]; then
    sequential=1
fi
echo "test-compat: ${free_gb} GB free: the pairs run $([ $sequential = 1 ] && echo 'one after the other' || echo 'side by side')"
status=0
pids=()
report() {  # index: wait for that pair, print its output
    wait "${pids[$1]}" || { status=1; echo "test-compat: ${pairs[$1]} FAILED" >&2; }
    echo "=== test-compat: ${pairs[$1]} (build/compat/${pairs[$1]}.out)"
    cat "$ROOT/${pairs[$1]}.out"
}
for i in "${!pairs[@]}"; do
    run_pair "${pairs[$i]}" > "$ROOT/${pairs[$i]}.out" 2>&1 &
    pids+=($!)
    [ "$sequential" != 1 ] || report "$i"
done
if [ "$sequential" != 1 ]; then
    for i in "${!pairs[@]}"; do report "$i"; done
fi
exit $status
