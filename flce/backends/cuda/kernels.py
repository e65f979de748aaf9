"""Triton kernels for one chunk of logits rows (device code only).

Every kernel runs one program per logits row and streams the row in BLOCK_V
column blocks, so no kernel holds more than BLOCK_V values of a row at a time.
Logits arrive in the compute dtype (bf16/fp16/fp32) straight from cuBLAS; all
arithmetic is fp32. Shared arguments:

    logits_ptr   [n, V] raw logits u = x @ W.T + b, row stride stride_row, unit column stride
    target_ptr   [n] int64 global class ids (ignore_index on ignored rows)
    V            columns in this (shard of the) vocabulary; vocab_offset = global id of column 0
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce.backends.online_softmax import _moved_to
from flce.backends.softcap import _tanh


@triton.jit
def _capped_scaled(u, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """z = cap(u) / T in fp32."""
    if HAS_SOFTCAP:
        u = softcap * _tanh(u / softcap)
    return u * inv_temperature


@triton.jit
def _write_plain_grad_row(row_ptr, target, lse, scale, first, V, BLOCK_V: tl.constexpr):
    """Overwrite columns [first, V) of one row of logits u with (softmax(u) - onehot(target)) * scale."""
    cols = tl.arange(0, BLOCK_V)
    for start in range(first, V, BLOCK_V):
        mask = start + cols < V
        u = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(u - lse) - tl.where(start + cols == target, 1.0, 0.0)
        tl.store(row_ptr + start + cols, (grad * scale).to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _plain_forward_kernel(
    logits_ptr, stride_row, target_ptr, grad_scale_ptr, stride_scale,
    loss_ptr, lse_ptr, V, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row: lse and loss = lse - u[y]; with WRITE_GRAD, overwrite the row with
    (softmax(u) - onehot(y)) * grad_scale[row] (zero on ignored rows).

    grad_scale_ptr [n] fp32 with stride stride_scale (0 broadcasts one scalar); loss_ptr, lse_ptr [n] fp32.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)

    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        u = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(u, 0))
        running_sum = _moved_to(running_max, running_sum, running_sum, new_max, False, False)[0]
        running_sum += tl.sum(tl.exp(u - new_max), 0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    safe_target = tl.where(valid, target, 0)
    target_u = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_u, 0.0))

    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(grad_scale_ptr + row * stride_scale), 0.0)
        _write_plain_grad_row(row_ptr, target, lse, scale, 0, V, BLOCK_V)


@triton.jit
def _plain_grad_kernel(
    logits_ptr, stride_row, target_ptr, lse_ptr, grad_scale_ptr, stride_scale, V, ignore_index,
    SPAN: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Overwrite each row with (softmax(u) - onehot(y)) * grad_scale[row], given its lse; program
    (row, s) takes columns [s * SPAN, (s + 1) * SPAN). The columns are independent once the lse is
    known, so a chunk's rows split into many short programs: one program a row left a tail wave
    (1536 rows of 300 KB on 132 SMs) on a pass that only streams memory."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * SPAN
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    scale = tl.where(valid, tl.load(grad_scale_ptr + row * stride_scale), 0.0)
    _write_plain_grad_row(row_ptr, target, tl.load(lse_ptr + row), scale, first, tl.minimum(first + SPAN, V), BLOCK_V)


@triton.jit
def _row_stats_kernel(
    logits_ptr, stride_row, target_ptr, class_weight_ptr,
    row_max_ptr, sum_exp_ptr, target_z_ptr, sum_exp_dz_ptr, weighted_sum_z_ptr, argmax_ptr, row_min_ptr, sum_z_ptr,
    V, vocab_offset, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    NEED_SUM_EXP_DZ: tl.constexpr, NEED_WEIGHTED_SUM_Z: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    NEED_LOGIT_STATS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Partial row statistics of z = cap(u)/T over this shard (semantics.PartialRowStats):
    row max, sum exp(z - max), z at the target (0 when not in this shard),
    sum exp(z - max) * (z - max), sum w[c] z[c] (class_weight_ptr: [V] of this shard), first argmax
    as a global index, min z and sum z (the logit statistics). Outputs are [n] fp32 (argmax
    int64). With ACCUMULATE the outputs hold the statistics of the columns before vocab_offset,
    and this block's are merged into them."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)

    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    running_sum_dz = tl.zeros((), tl.float32)
    weighted_sum = tl.zeros((), tl.float32)
    best_index = tl.zeros((), tl.int64)
    running_min = tl.full((), float("inf"), tl.float32)
    plain_sum_z = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        u = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, _capped_scaled(u, softcap, inv_temperature, HAS_SOFTCAP), float("-inf"))
        block_max = tl.max(z, 0)
        new_max = tl.maximum(running_max, block_max)
        e = tl.exp(z - new_max)
        # The earlier blocks' sums moved to the new max, then this block's added.
        running_sum, running_sum_dz = _moved_to(running_max, running_sum, running_sum_dz, new_max, NEED_SUM_EXP_DZ,
                                                False)
        if NEED_SUM_EXP_DZ:
            running_sum_dz += tl.sum(e * tl.where(mask, z - new_max, 0.0), 0)
        running_sum += tl.sum(e, 0)
        if NEED_WEIGHTED_SUM_Z:
            if HAS_CLASS_WEIGHT:
                w = tl.load(class_weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                w = tl.where(mask, 1.0, 0.0)
            weighted_sum += tl.sum(tl.where(mask, w * z, 0.0), 0)
        if NEED_ARGMAX:
            block_first = tl.min(tl.where(z == block_max, start + cols, V), 0).to(tl.int64)
            # Strictly greater: an earlier block keeps ties, so the first maximal index wins.
            best_index = tl.where(block_max > running_max, block_first, best_index)
        if NEED_LOGIT_STATS:
            running_min = tl.minimum(running_min, tl.min(tl.where(mask, z, float("inf")), 0))
            plain_sum_z += tl.sum(tl.where(mask, z, 0.0), 0)
        running_max = new_max

    local_target = tl.load(target_ptr + row) - vocab_offset
    in_shard = (local_target >= 0) & (local_target < V)
    target_u = tl.load(row_ptr + tl.where(in_shard, local_target, 0)).to(tl.float32)
    target_z = tl.where(in_shard, _capped_scaled(target_u, softcap, inv_temperature, HAS_SOFTCAP), 0.0)
    best_index += vocab_offset
    if ACCUMULATE:
        # Merge with the earlier columns' statistics: both moved to the merged max.
        earlier_max = tl.load(row_max_ptr + row)
        merged_max = tl.maximum(earlier_max, running_max)
        earlier_sum, earlier_sum_dz = _moved_to(earlier_max, tl.load(sum_exp_ptr + row),
                                                tl.load(sum_exp_dz_ptr + row) if NEED_SUM_EXP_DZ else running_sum,
                                                merged_max, NEED_SUM_EXP_DZ, False)
        block_sum, block_sum_dz = _moved_to(running_max, running_sum, running_sum_dz, merged_max, NEED_SUM_EXP_DZ,
                                            False)
        running_sum = earlier_sum + block_sum
        if NEED_SUM_EXP_DZ:
            running_sum_dz = earlier_sum_dz + block_sum_dz
        target_z += tl.load(target_z_ptr + row)
        if NEED_WEIGHTED_SUM_Z:
            weighted_sum += tl.load(weighted_sum_z_ptr + row)
        if NEED_ARGMAX:
            # Strictly greater: earlier columns keep ties, so the first maximal index wins.
            best_index = tl.where(running_max > earlier_max, best_index, tl.load(argmax_ptr + row))
        if NEED_LOGIT_STATS:
            running_min = tl.minimum(running_min, tl.load(row_min_ptr + row))
            plain_sum_z += tl.load(sum_z_ptr + row)
        running_max = merged_max
    tl.store(row_max_ptr + row, running_max)
    tl.store(sum_exp_ptr + row, running_sum)
    tl.store(target_z_ptr + row, target_z)
    if NEED_SUM_EXP_DZ:
        tl.store(sum_exp_dz_ptr + row, running_sum_dz)
    if NEED_WEIGHTED_SUM_Z:
        tl.store(weighted_sum_z_ptr + row, weighted_sum)
    if NEED_ARGMAX:
        tl.store(argmax_ptr + row, best_index)
    if NEED_LOGIT_STATS:
        tl.store(row_min_ptr + row, running_min)
        tl.store(sum_z_ptr + row, plain_sum_z)


@triton.jit
def _full_grad_kernel(
    logits_ptr, stride_row, target_ptr, class_weight_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr,
    V, vocab_offset, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, HAS_H: tl.constexpr, HAS_E: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Overwrite each row of raw logits u with d loss / d u:
    grad_z[c] = p[c] * (a - h (z[c] - lse)) - (c == y) d - e w[c]   (semantics.py), then
    d/du = grad_z * cap'(u) / T with cap'(u) = 1 - (z T / softcap)^2.
    lse, a, h, d, e: [n] fp32 per-row values (h, e only read when HAS_H / HAS_E)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    a = tl.load(a_ptr + row)
    d = tl.load(d_ptr + row)
    h = tl.load(h_ptr + row) if HAS_H else 0.0
    e = tl.load(e_ptr + row) if HAS_E else 0.0
    local_target = tl.load(target_ptr + row) - vocab_offset
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        u = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        z = _capped_scaled(u, softcap, inv_temperature, HAS_SOFTCAP)
        log_p = z - lse
        p = tl.exp(log_p)
        if HAS_H:
            grad = p * (a - h * log_p)
        else:
            grad = p * a
        grad -= tl.where(start + cols == local_target, d, 0.0)
        if HAS_E:
            if HAS_CLASS_WEIGHT:
                w = tl.load(class_weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                grad -= e * w
            else:
                grad -= e
        if HAS_SOFTCAP:
            # tanh(u / softcap) = cap(u) / softcap = z * T / softcap
            t = z / (softcap * inv_temperature)
            grad = grad * (1.0 - t * t)
        grad = grad * inv_temperature
        tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    """ptr[:numel] *= scale, skipped entirely (no load, no store) when the device scalar is exactly 1."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        values = tl.load(ptr + offsets, mask=mask).to(tl.float32)
        tl.store(ptr + offsets, (values * scale).to(ptr.dtype.element_ty), mask=mask)
