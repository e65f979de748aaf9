"""The Triton kernel of the call's first pass over its targets (device code; launcher: target_ops.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _count_tokens_kernel(target_ptr, stride, n, vocab, ignore_index, values_ptr, flags_ptr, CHECK: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program: values = (count, max(count, 1), 0) in the statistics dtype, flags = (count > 0, every
    non-ignored target in [0, vocab)) of target [n] (``stride`` elements apart). Integer sums: the count does
    not depend on the order."""
    offsets = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        t = tl.load(target_ptr + (start + offsets) * stride, mask=start + offsets < n, other=ignore_index)
        valid = t != ignore_index
        count += valid.to(tl.int32)
        if CHECK:
            bad = tl.maximum(bad, (valid & ((t < 0) | (t >= vocab))).to(tl.int32))
    total = tl.sum(count, axis=0)
    out_dtype = values_ptr.dtype.element_ty
    tl.store(values_ptr, total.to(out_dtype))
    tl.store(values_ptr + 1, tl.maximum(total, 1).to(out_dtype))
    tl.store(values_ptr + 2, tl.zeros([], dtype=out_dtype))
    tl.store(flags_ptr, total > 0)
    if CHECK:
        tl.store(flags_ptr + 1, tl.max(bad, axis=0) == 0)
