"""The online-softmax merge in Triton, every Triton kernel's one copy of it (the CUDA backend's row kernels, its
statistics GEMM's epilogue and split merge, the Ascend backend's row kernels; flce.semantics.moved_to is the same
algebra in torch, the Gluon epilogue of cuda/ws_stats_kernels.py keeps its own explicit-layout form). Device code
only: imported by kernel modules."""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _moved_to(part_max, part_sum, part_sum_dz, shift, NEED_SUM_DZ: tl.constexpr, BASE2: tl.constexpr):
    """A partial's sum of exp(z - max) and (NEED_SUM_DZ) the entropy's sum of exp(z - max) * (z - max), both
    moved to ``shift`` >= max (finite: a caller whose rows may hold no column passes 0 for those). The sum scales
    by exp(max - shift); the entropy's sum also moves by (max - shift) times the sum of exp, nothing where the
    partial has no columns (sum 0, max -inf). BASE2: max and shift are base-2 maxima (y = z * log2 e; exp2
    scales) and the entropy's sums are taken against r = max * ln 2, as its kernel computes them. Returns (sum,
    sum_dz) relative to shift."""
    if BASE2:
        scale = tl.exp2(part_max - shift)
        moved = tl.where(part_sum > 0.0, part_max * LN2 - shift * LN2, 0.0)
    else:
        scale = tl.exp(part_max - shift)
        moved = tl.where(part_sum > 0.0, part_max - shift, 0.0)
    sum_dz = part_sum
    if NEED_SUM_DZ:
        sum_dz = (part_sum_dz + moved * part_sum) * scale
    return part_sum * scale, sum_dz
