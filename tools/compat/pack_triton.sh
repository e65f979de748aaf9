#!/usr/bin/env bash
# Pack a Triton release for a machine without internet that takes files in pieces of at most 60 MB:
# the wheel is unpacked, trimmed to what an NVIDIA GPU needs (no AMD backend, no profiler libraries, no
# test plugins or FileCheck; libtriton.so without its debug sections), packed with xz and split. Both ptxas binaries stay: Triton
# 3.9 compiles sm_90 with the one named ptxas-blackwell, 3.8 with ptxas.
#   tools/compat/pack_triton.sh 3.9.0      -> .whl/triton-3.9.0.tar.xz.part-aa, -ab, ... and .whl/triton-3.9.0.sha256
# On the other machine tools/compat/gpu_triton_check.sh joins and unpacks the pieces (checking the sha256).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:?usage: tools/compat/pack_triton.sh TRITON_VERSION}
work=build/pack-triton-$version
rm -rf "$work" .whl/triton-"$version".*
mkdir -p "$work/tree" .whl
# The machine's pip constraint file and mirror hold only some releases: PyPI's, for this one download.
PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d "$work" "triton==$version"
unzip -q "$work"/triton-"$version"-*.whl -d "$work/tree"
rm -rf "$work/tree/triton/backends/amd" "$work/tree/triton/_C/libproton.so" \
    "$work/tree/triton/backends/nvidia/lib/cupti" "$work/tree/triton/backends/nvidia/lib/cupti-blackwell" \
    "$work/tree/triton/instrumentation" "$work/tree/triton/plugins" "$work/tree/triton/FileCheck"
# Triton finds its backends through the wheel's entry points: the AMD one is gone.
sed -i '/^amd = /d' "$work"/tree/triton-*.dist-info/entry_points.txt
strip --strip-debug "$work/tree/triton/_C/libtriton.so"
tar -C "$work/tree" -cf - . | xz -9 -T0 > "$work/triton-$version.tar.xz"
(cd "$work" && sha256sum "triton-$version.tar.xz") > ".whl/triton-$version.sha256"
split -b 60M "$work/triton-$version.tar.xz" ".whl/triton-$version.tar.xz.part-"
ls -la .whl/triton-"$version".*
