"""log2 as one MUFU instruction on an NVIDIA GPU (device code, plus the launchers' test of where it applies).

Triton lowers an fp32 tl.exp2 to PTX's ex2.approx.ftz.f32, one MUFU instruction, but tl.log2 to libdevice's
__nv_log2f, a software logarithm of about 35 instructions. A row sweep that forms a logarithm a column from two
16-bit loads is then bound by instruction issue, not memory: linear distillation's JSD sweeps over a 1024 x 128256
chunk pair took 0.547 ms on an H200 (81% of issue slots busy, 37% of DRAM bandwidth) and 0.35 ms with
lg2.approx.ftz.f32, about what the same bytes take through three elementwise passes (0.38 ms). Its error (the PTX
ISA bounds it near 2^-22) is below what the fp32 sums round to, and tests/test_distillation_precision.py holds on the
GPU with it; it reads a subnormal argument as 0, which the callers rule out (the mixture is held at fp32's smallest
normal).

The Triton interpreter runs no PTX: a kernel takes this form only where PTX is true (``compiles_to_ptx``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def compiles_to_ptx(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` compile to PTX, not run in the interpreter: a GPU's tensor, or a meta tensor that
    tools/compat/compile_for_gpus.py compiles a GPU's kernels for (the interpreter runs on CPU tensors)."""
    return t.device.type != "cpu" and torch.version.hip is None


@triton.jit
def log2(x, PTX: tl.constexpr):
    """log2 x for x >= fp32's smallest normal: lg2.approx.ftz.f32 where PTX, else tl.log2."""
    if PTX:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)
