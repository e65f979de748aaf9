"""Triton kernels of the loss's gradient from kept exponentials (exp_grad_ops.py says how they fit), for losses
whose gradient is a per-row multiple of softmax - onehot (flce.gradients.gradient_is_row_scaled_softmax).

A chunk's fused statistics GEMM keeps E = exp2(y - c) per row instead of its logits (y the base-2 logit
z log2(e), z = u / temperature of the GEMM's u; c a per-row offset chosen before the GEMM from the target's
logit), so that the gradient G = softmax - onehot = s * E with s = exp2(c - lse2) per row (times the row's
upstream scale and 1 / temperature): the two gradient GEMMs read E and scale rows, and no pass over the logits
turns them into G. The target's column is overwritten with
(p_t - 1) / s, so G is s * E exactly there too (no cancellation between the GEMM's p_t and the onehot).
Rows whose logits exceed c + 64 (a target logit more than ~84 nats below the row's lse) were capped in
the GEMM, and so were their statistics, which the warp-specialised GEMM takes relative to c; they are
recomputed here as their gradient, with their own lse, which replaces the GEMM's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce.backends.online_softmax import LOG2E, _moved_to

# c = the target's base-2 logit + this: E of the target is 2^-58, the largest E of a row stays below 2^64
# (the GEMM's cap) while the row's loss is under (58 + 64) ln 2 = 84.6 nats, and E of logits more than
# (133 - 58) ln 2 = 52 nats below the target's flushes to 0 in bf16 (p below 2^-75 of the target's).
OFFSET_ABOVE_TARGET = tl.constexpr(58.0)
# The GEMM caps exp2(y - c) at 2^CAP (ws_stats_kernels._exp_chunk, which imports it): rows past it are
# recomputed.
CAP = tl.constexpr(64.0)
# A row is recomputed where its lse2 - c exceeds this: a row holding a capped value sums at least 2^CAP (its
# lse2 - c at least CAP up to the merge's rounding), and one at most 2^(CAP - 1) holds none.
REDO_ABOVE = tl.constexpr(63.0)
# A row's scale comes from its target's stored exponential where p_t - 1 is at least this far from 0 (its fp32
# value then holds 18 bits or more): _exp_rows_finish_kernel says why.
STORED_TARGET_MIN_GAP = tl.constexpr(1.0 / 64.0)


@triton.jit
def _exp_offsets_kernel(x_ptr, stride_x, w_ptr, stride_w, target_ptr, offset_ptr, hidden, vocab, ignore_index,
                        inv_temperature, BLOCK_H: tl.constexpr):
    """offset[row] = x[row] . w[target] * log2(e) / temperature + OFFSET_ABOVE_TARGET in fp32 (0 for an ignored row,
    whose gradient row is 0); grid (rows,). Within a few ulps of the GEMM's rounded logit, which is all c needs."""
    row = tl.program_id(0)
    t = tl.load(target_ptr + row)
    valid = (t != ignore_index) & (t >= 0) & (t < vocab)
    safe_t = tl.where(valid, t, 0).to(tl.int64)
    # An ignored row reads no weights: its weight columns end at 0. (A bound, not `mask & valid`: Triton 3.9's
    # interpreter turns a block mask & a scalar mask into int32, which it then refuses as a load mask.)
    w_cols = tl.where(valid, hidden, 0)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + safe_t * stride_w + cols, mask=cols < w_cols, other=0.0).to(tl.float32)
        acc += x * w
    offset = tl.sum(acc, axis=0) * (LOG2E * inv_temperature) + OFFSET_ABOVE_TARGET
    tl.store(offset_ptr + row, tl.where(valid, offset, 0.0))


@triton.jit
def _exp_logits_kernel(logits_ptr, stride, offset_ptr, vocab, inv_temperature, BLOCK_V: tl.constexpr):
    """E = exp2(min(u * log2(e) / temperature - offset, CAP)) over a row of logits u in place (the exponentials where
    no fused GEMM wrote them: the interpreter, a GEMM that failed to compile); grid (rows, V blocks)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    offset = tl.load(offset_ptr + row)
    u = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp2(tl.minimum(u * (LOG2E * inv_temperature) - offset, CAP))
    tl.store(logits_ptr + row * stride + cols, e.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _exp_rows_finish_kernel(exp_ptr, stride, target_ptr, row_max_ptr, sum_exp_ptr, lse_ptr, target_z_ptr, offset_ptr,
                            grad_scale_ptr, grad_scale_stride, inv_temperature, row_scale_ptr, redo_rows_ptr,
                            redo_count_ptr, n_rows, vocab, ignore_index, BLOCK: tl.constexpr):
    """Per row, from the merged statistics (row max and sum of exponentials of z = u / temperature, natural): the
    lse into lse_ptr, the scale s (the gradient of the raw logits u is s * E) into row_scale, the target's column of
    E overwritten with (p_t - 1) / exp2(c - lse2); rows past the cap are listed in redo_rows (count in redo_count,
    any order) with s = grad_scale / temperature, for _exp_rows_redo_kernel (which also replaces their lse);
    ignored rows get s = 0. grid (cdiv(rows, BLOCK),)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < n_rows
    t = tl.load(target_ptr + rows, mask=in_range, other=ignore_index)
    valid = in_range & (t != ignore_index) & (t >= 0) & (t < vocab)
    row_max = tl.load(row_max_ptr + rows, mask=in_range, other=0.0)
    lse = row_max + tl.log(tl.load(sum_exp_ptr + rows, mask=in_range, other=1.0))
    tl.store(lse_ptr + rows, lse, mask=in_range)
    lse2 = lse * LOG2E
    offset = tl.load(offset_ptr + rows, mask=in_range, other=0.0)
    # d z / d u = 1 / temperature
    scale = tl.load(grad_scale_ptr + rows * grad_scale_stride, mask=in_range, other=0.0) * inv_temperature
    redo = valid & (lse2 - offset > REDO_ABOVE)
    keep = valid & ~redo
    p_target = tl.exp2(tl.load(target_z_ptr + rows, mask=in_range, other=0.0) * LOG2E - lse2)
    # (p_t - 1) / exp2(c - lse2), at most 2^CAP in magnitude on the rows kept
    target_e = (p_target - 1.0) * tl.exp2(tl.minimum(lse2 - offset, CAP))
    stored = target_e.to(exp_ptr.dtype.element_ty)
    safe_t = tl.where(valid, t, 0).to(tl.int64)
    tl.store(exp_ptr + rows.to(tl.int64) * stride + safe_t, stored, mask=keep)
    # The row's scale from the target's stored (rounded) value, so that s * E is p_t - 1 at the target to fp32's
    # precision: where p_t is small that column carries the row's gradient, and eager PyTorch rounds it as
    # p_t - 1 ~ -1, almost exactly, where a scaled E rounded to bf16 would be off by up to 2^-9 (1.7x eager's error
    # in grad_hidden and grad_weight, H200, 4096 x 1024 x 32000 at random logits). Not where p_t nears 1: p_t - 1
    # has few significant bits there; the scale the statistics give is as good.
    stored_e = stored.to(tl.float32)
    exact_scale = scale * (p_target - 1.0) / tl.where(stored_e != 0.0, stored_e, 1.0)
    kept_scale = tl.where((1.0 - p_target >= STORED_TARGET_MIN_GAP) & (stored_e != 0.0), exact_scale,
                          scale * tl.exp2(offset - lse2))
    row_scale = tl.where(keep, kept_scale, tl.where(redo, scale, 0.0))
    tl.store(row_scale_ptr + rows, row_scale, mask=in_range)
    slot = tl.atomic_add(redo_count_ptr + tl.zeros([BLOCK], dtype=tl.int32), 1, mask=redo)
    tl.store(redo_rows_ptr + slot, rows, mask=redo)


@triton.jit
def _redo_logits(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, hidden, inv_temperature,
                 BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """z[rows, cols] = x[rows] @ w[cols].T rounded to the inputs' dtype (as the GEMM's logits), then divided by
    the temperature; -inf past V."""
    acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    z = acc.to(x_ptr.dtype.element_ty).to(tl.float32) * inv_temperature
    return tl.where(col_ok[None, :], z, float("-inf"))


@triton.jit
def _exp_rows_redo_kernel(x_ptr, stride_x, w_ptr, stride_w, target_ptr, redo_rows_ptr, redo_count_ptr, exp_ptr,
                          stride_e, lse_ptr, hidden, vocab, inv_temperature, BLOCK_R: tl.constexpr,
                          BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The listed rows' E recomputed as their gradient (E = softmax, the target's softmax - 1: G = s * E, s = the
    upstream scale / temperature) from logits z = u / temperature recomputed here, with the lse of those same logits:
    two passes over V, the first for the row's max and sum, so each row's softmax is consistent in itself (the GEMM's
    lse came from logits summed in another order, which can round a logit to a neighbouring value); that lse (natural)
    replaces the row's in lse_ptr, whose GEMM statistics summed capped values. grid (cdiv(rows, BLOCK_R),): each
    program one block of BLOCK_R listed rows, if there are that many; no rows (the usual case), every program only
    reads the count. IEEE: fp32 inputs, multiplied exactly (no TF32)."""
    count = tl.load(redo_count_ptr)
    for start in range(tl.program_id(0) * BLOCK_R, count, tl.num_programs(0) * BLOCK_R):
        slots = start + tl.arange(0, BLOCK_R)
        row_ok = slots < count
        rows = tl.load(redo_rows_ptr + slots, mask=row_ok, other=0).to(tl.int64)
        row_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        for v in range(0, vocab, BLOCK_V):
            cols = v + tl.arange(0, BLOCK_V)
            u = _redo_logits(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, cols < vocab, hidden,
                             inv_temperature, BLOCK_R, BLOCK_V, BLOCK_K, IEEE)
            new_max = tl.maximum(row_max, tl.max(u, axis=1))
            row_sum = _moved_to(row_max, row_sum, row_sum, new_max, False, False)[0] + tl.sum(
                tl.exp(u - new_max[:, None]), axis=1)
            row_max = new_max
        lse = row_max + tl.log(row_sum)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        t = tl.load(target_ptr + rows, mask=row_ok, other=-1)
        for v in range(0, vocab, BLOCK_V):
            cols = v + tl.arange(0, BLOCK_V)
            col_ok = cols < vocab
            u = _redo_logits(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, hidden,
                             inv_temperature, BLOCK_R, BLOCK_V, BLOCK_K, IEEE)
            e = tl.exp(u - lse[:, None]) - tl.where(cols[None, :] == t[:, None], 1.0, 0.0)
            tl.store(exp_ptr + rows[:, None] * stride_e + cols[None, :], e.to(exp_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _scale_rows_kernel(src_ptr, src_stride, dst_ptr, dst_stride, scale_ptr, cols, BLOCK: tl.constexpr):
    """dst[row] = src[row] * scale[row], computed in fp32 and rounded once to dst's dtype; grid (rows, col
    blocks). dst may be src."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    scale = tl.load(scale_ptr + row)
    value = tl.load(src_ptr + row * src_stride + offs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(dst_ptr + row * dst_stride + offs, value.to(dst_ptr.dtype.element_ty), mask=mask)
