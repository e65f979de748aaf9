"""One pass over a call's targets on the GPU: the non-ignored tokens the means divide by, and the range check.

PyTorch's form (semantics.count_tokens and inputs.assert_targets_in_range) is 13 small launches, this kernel
and the assertion two: host time that a short call, whose GPU work is a few milliseconds, spends before its
first GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.inputs import out_of_range_message
from flce.semantics import TokenCounts

_MAX_BLOCK = 4096


@triton.jit
def _count_tokens_kernel(target_ptr, n, vocab, ignore_index, values_ptr, flags_ptr, CHECK: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program: values = (count, max(count, 1), 0) in the statistics dtype, flags = (count > 0, every
    non-ignored target in [0, vocab)). Integer sums, so the count does not depend on the order."""
    offsets = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        t = tl.load(target_ptr + start + offsets, mask=start + offsets < n, other=ignore_index)
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


def count_tokens(target: torch.Tensor, ignore_index: int, dtype: torch.dtype, vocab: int | None) -> TokenCounts:
    """semantics.TokenCounts of a contiguous [n] int64 target on the GPU, and with ``vocab`` a device-side
    assertion that every non-ignored target is in [0, vocab). Counts past 2^31 tokens are not expected in one
    call (int32 sums)."""
    n = target.shape[0]
    values = torch.empty(3, dtype=dtype, device=target.device)
    flags = torch.empty(2, dtype=torch.bool, device=target.device)
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(n, 16)))
    _count_tokens_kernel[(1,)](target, n, vocab or 0, ignore_index, values, flags, CHECK=vocab is not None,
                               BLOCK=block, num_warps=8 if block >= 2048 else 4)
    if vocab is not None:
        torch._assert_async(flags[1], out_of_range_message(vocab, ignore_index))
    return TokenCounts(values[0], flags[0], values[1], values[2])
