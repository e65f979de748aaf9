"""One pass over a call's targets on the GPU: the non-ignored tokens the means divide by, and the range check.

PyTorch's form (semantics.count_tokens and inputs.assert_targets_in_range) is 13 small launches, this kernel
and the assertion two: host time that a short call, whose GPU work is a few milliseconds, spends before its
first GEMM.
"""

from __future__ import annotations

import torch
import triton

from flce.backends.cuda import target_kernels as k
from flce.inputs import out_of_range_message
from flce.semantics import TokenCounts

_MAX_BLOCK = 4096


def count_tokens(target: torch.Tensor, ignore_index: int, dtype: torch.dtype, vocab: int | None) -> TokenCounts:
    """semantics.TokenCounts of an [n] int64 target on the GPU, and with ``vocab`` a device-side
    assertion that every non-ignored target is in [0, vocab). Counts past 2^31 tokens are not expected in one
    call (int32 sums)."""
    n = target.shape[0]
    values = torch.empty(3, dtype=dtype, device=target.device)
    flags = torch.empty(2, dtype=torch.bool, device=target.device)
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(n, 16)))
    k._count_tokens_kernel[(1,)](target, target.stride(0) if n else 1, n, vocab or 0, ignore_index, values, flags,
                                 CHECK=vocab is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    if vocab is not None:
        torch._assert_async(flags[1], out_of_range_message(vocab, ignore_index))
    return TokenCounts(values[0], flags[0], values[1], values[2])
