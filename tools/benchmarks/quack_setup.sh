#!/usr/bin/env bash
# Make quack 0.6.5 and the CUTLASS DSL 4.7.1 importable from carried wheels, without pip or a registry:
#   source tools/benchmarks/quack_setup.sh WHEEL_DIR [TARGET]      (TARGET: /tmp/cute-site)
#
# WHEEL_DIR holds quack-kernels==0.6.5, nvidia-cutlass-dsl==4.7.1 with nvidia-cutlass-dsl-libs-base,
# -libs-core and -libs-cu12 of 4.7.1 (4.8.1 breaks quack 0.6.5 at import), apache-tvm-ffi,
# torch-c-dlpack-ext and, for Liger's CuTe paths, liger-kernel; download them for the device with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d WHEEL_DIR NAME==VERSION
# A wheel too large for one transfer may come as `split` parts (NAME.whl.part-aa, -ab, ...), joined here,
# or already unpacked as NAME.tar.xz (its folders at the archive's top), extracted here.
#
# All wheels go into ONE folder: pip --target would replace the nvidia_cutlass_dsl/ folder that the DSL's
# wheels share, and the DSL's .pth (which adds nvidia_cutlass_dsl/dsl_packages to the path) is only read
# in site-packages, so both folders go on PYTHONPATH instead.
wheels=${1:?usage: source quack_setup.sh WHEEL_DIR [TARGET]}
target=${2:-/tmp/cute-site}
mkdir -p "$target"
for first in "$wheels"/*.whl.part-aa; do
  [ -e "$first" ] || continue
  cat "${first%aa}"* > "$target/$(basename "${first%.part-aa}")"
done
for archive in "$wheels"/*.tar.xz; do
  [ -e "$archive" ] && tar -xJf "$archive" -C "$target"
done
for wheel in "$wheels"/*.whl "$target"/*.whl; do
  [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" "$target"
done
rm -f "$target"/*.whl
export PYTHONPATH="$target:$target/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import quack, cutlass.cute; print('quack', quack.__version__, 'imports with the CUTLASS DSL')" \
  || echo "quack_setup: quack does not import (see above)" >&2
