"""exp2 and log2 as one MUFU instruction each on an NVIDIA GPU (device code, plus the launchers' test of where it
applies).

tl.exp2 and tl.log2 lower to PTX's ex2.approx.f32 and lg2.approx.f32, which keep subnormal results and inputs:
ptxas wraps each MUFU in a compare, a select and a rescale. A row sweep that forms three transcendentals a column
from two 16-bit loads is bound by instruction issue, not memory: linear distillation's JSD sweeps over a
1024 x 128256 chunk pair took 0.547 ms on an H200 (81% of issue slots busy, 37% of DRAM bandwidth) and 0.35 ms
with the .ftz forms below, about what the same bytes take through three elementwise passes (0.38 ms). The .ftz
forms flush subnormals to zero, which the callers allow for: a probability below 2^-126 is 0 (its terms are below
1e-36), and a logarithm's argument is held at fp32's smallest normal. Their error on normal numbers is the
non-ftz forms' (the same MUFU).

The Triton interpreter runs no PTX: a kernel takes these forms only where PTX is true (``ptx_math``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def ptx_math(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` compile to PTX, not run in the interpreter: a GPU's tensor, or a meta tensor that
    tools/compat/compile_for_gpus.py compiles a GPU's kernels for (the interpreter runs on CPU tensors)."""
    return t.device.type != "cpu" and torch.version.hip is None


@triton.jit
def exp2(x, PTX: tl.constexpr):
    """2 ** x, subnormal results flushed to 0 where PTX."""
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@triton.jit
def log2(x, PTX: tl.constexpr):
    """log2 x for x >= fp32's smallest normal (a subnormal x reads as 0 where PTX)."""
    if PTX:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)
