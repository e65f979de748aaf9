"""The softcap's tanh in Triton, every Triton kernel's one copy of it (the CUDA backend's row kernels and
statistics GEMM, the Ascend backend's row kernels; cuda/ws_stats_kernels.py's Gluon epilogue keeps its own
explicit-layout form of the same formula). Device code only: imported by kernel modules."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """tanh(x) within a few fp32 ulps of it for every x (2.6e-7 relative at most against float64 with an exact
    exp, 6e-7 with the GPU's approximate one), so that softcap * tanh(u / softcap) stays within fp32 rounding
    of u at any softcap. (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1] (no overflow; +-1 at +-inf, NaN at
    NaN), the sign restored; below |x| = 0.25, where 1 - e cancels (the former 1 - 2 / (exp(2x) + 1) lost
    softcap * 1e-7 on each logit), tanh's Taylor series to x^9 (truncated 1e-8 relative there). Built from exp
    because triton-ascend, CUDA Triton and the interpreter all provide exp, not the same tanh."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    s = a * a
    series = -0.05396825396825397 + s * 0.021869488536155203
    series = 0.13333333333333333 + s * series
    series = -0.3333333333333333 + s * series
    t = tl.where(a < 0.25, a + a * s * series, far)
    return tl.where(x < 0.0, -t, t)
