"""Triton kernels for Ascend NPUs (triton-ascend), written for the Ascend execution model.

Every kernel is launched on a grid of at most one program per vector core (ops.py binds it);
program ``pid`` of ``P`` walks rows ``pid, pid + P, pid + 2P, ...`` (grid stride), so a chunk of
any size costs one launch and no core waits for a second wave. A row is scanned in blocks of
``BLOCK_V`` vocabulary entries; ops.py sizes ``BLOCK_V`` so that one block's working set (the
loaded tile, double-buffered by the compiler, plus the fp32 temporaries) fits the Unified Buffer.

Conventions shared by all kernels:

* ``logits_ptr``: [n_rows, vocab] in the compute dtype (fp32/fp16/bf16), unit column stride,
  row stride ``stride_row``. Gradients are written over the same memory (each program reads a
  block before it writes it, and rows belong to one program), so no second [n, V] buffer exists.
* per-row vectors ([n_rows], fp32 unless stated) have their own element stride, 0 for a scalar
  broadcast over the rows (the loss's grad_output under reduction="mean"/"sum").
* ``target_ptr``: [n_rows] int64 global class ids; ``vocab_offset`` is the first class id of this
  vocabulary shard (0 when not sharded).
* math is fp32 whatever the logits dtype; offsets are int32 unless ``WIDE_OFFSETS`` (the chunk
  holds 2**31 elements or more, decided on the host).
* softcap and temperature: ``z = softcap * tanh(u / softcap) / temperature``; tanh is built from
  ``exp(-2|x|)`` (in (0, 1], no overflow) and a Taylor series near 0 (flce/backends/softcap.py, shared with
  the CUDA kernels) because triton-ascend, CUDA Triton and the interpreter all provide ``exp`` but not the same
  tanh.
* small steps are written inline rather than as @jit helpers: the compiler inlines either way, and
  the interpreter (CI) pays milliseconds per helper call per block. The softcap's tanh is a helper: three
  kernels share it, and only softcapped calls pay for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce.backends.online_softmax import _moved_to
from flce.backends.softcap import _tanh

# Larger than any column index: the "no candidate" value of the first-index argmax.
_NO_INDEX = tl.constexpr(2147483647)


@triton.jit
def _write_plain_grad(row_ptr, grad_row_ptr, target, lse, scale, vocab, BLOCK_V: tl.constexpr):
    """grad[c] = (exp(x[c] - lse) - (c == target)) * scale over one row, block by block."""
    cols0 = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        cols = start + cols0
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(cols == target, p - 1.0, p) * scale
        tl.store(grad_row_ptr + cols, g.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _plain_loss_kernel(
    logits_ptr, stride_row,       # [n_rows, vocab] logits; overwritten with the gradient if WRITE_GRAD
    target_ptr,                   # [n_rows] int64
    scale_ptr, stride_scale,      # [n_rows] fp32 d loss / d row-loss (read only if WRITE_GRAD)
    loss_ptr, lse_ptr,            # [n_rows] fp32 outputs: -log softmax(x)[target] (0 if ignored), lse
    n_rows, vocab, ignore_index,
    WRITE_GRAD: tl.constexpr, WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Plain fast path: online max / sum-exp over the row, the target logit loaded directly
    (one scalar load, not picked out of the scanned blocks), and with WRITE_GRAD a second pass
    that writes (softmax - onehot) * scale over the logits."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        row_start = row * stride_row
        if WIDE_OFFSETS:
            row_start = tl.cast(row, tl.int64) * stride_row
        row_ptr = logits_ptr + row_start
        target = tl.load(target_ptr + row)
        valid = target != ignore_index
        target_col = tl.where(valid, target, 0).to(tl.int32)
        # Read before the gradient pass overwrites the row.
        target_logit = tl.load(row_ptr + target_col, mask=valid, other=0.0).to(tl.float32)

        running_max = float("-inf")
        sum_exp = 0.0
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            earlier_sum = _moved_to(running_max, sum_exp, sum_exp, new_max, False, False)[0]
            sum_exp = earlier_sum + tl.sum(tl.exp(x - new_max), 0)
            running_max = new_max
        lse = running_max + tl.log(sum_exp)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        if WRITE_GRAD:
            scale = tl.where(valid, tl.load(scale_ptr + row * stride_scale), 0.0)
            _write_plain_grad(row_ptr, row_ptr, target_col, lse, scale, vocab, BLOCK_V)


@triton.jit
def _plain_grad_kernel(
    logits_ptr, stride_row,       # [n_rows, vocab] logits, overwritten with the gradient
    target_ptr,                   # [n_rows] int64
    lse_ptr,                      # [n_rows] fp32, from the forward scan
    scale_ptr, stride_scale,      # [n_rows] fp32 d loss / d row-loss
    n_rows, vocab, ignore_index,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """(softmax - onehot) * scale from a known lse: one pass over each row."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        row_start = row * stride_row
        if WIDE_OFFSETS:
            row_start = tl.cast(row, tl.int64) * stride_row
        row_ptr = logits_ptr + row_start
        target = tl.load(target_ptr + row)
        valid = target != ignore_index
        target_col = tl.where(valid, target, 0).to(tl.int32)
        scale = tl.where(valid, tl.load(scale_ptr + row * stride_scale), 0.0)
        lse = tl.load(lse_ptr + row)
        _write_plain_grad(row_ptr, row_ptr, target_col, lse, scale, vocab, BLOCK_V)


@triton.jit
def _row_stats_kernel(
    logits_ptr, stride_row,       # [n_rows, vocab] raw logits u of this vocabulary shard
    target_ptr,                   # [n_rows] int64 global ids
    class_weight_ptr,             # [vocab] fp32 class weights of this shard (read if HAS_CLASS_WEIGHT)
    row_max_ptr, sum_exp_ptr,     # [n_rows] fp32: max z, sum exp(z - max z)
    target_z_ptr,                 # [n_rows] fp32: z[target], 0 when the target is not in this shard
    sum_exp_dz_ptr,               # [n_rows] fp32: sum exp(z - max z) * (z - max z) (NEED_SUM_EXP_DZ)
    weighted_sum_z_ptr,           # [n_rows] fp32: sum w[c] * z[c]                 (NEED_WEIGHTED_SUM_Z)
    argmax_ptr,                   # [n_rows] int64: first index of max z, global   (NEED_ARGMAX)
    n_rows, vocab, vocab_offset, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    NEED_SUM_EXP_DZ: tl.constexpr, NEED_WEIGHTED_SUM_Z: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Full-feature scan: the partial row statistics of flce.semantics.PartialRowStats in one
    pass, every running sum rescaled when the running max grows."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        row_start = row * stride_row
        if WIDE_OFFSETS:
            row_start = tl.cast(row, tl.int64) * stride_row
        row_ptr = logits_ptr + row_start
        local_target = tl.load(target_ptr + row) - vocab_offset
        in_shard = (local_target >= 0) & (local_target < vocab)
        target_col = tl.where(in_shard, local_target, 0).to(tl.int32)
        target_z = tl.load(row_ptr + target_col, mask=in_shard, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            target_z = softcap * _tanh(target_z / softcap)
        if HAS_TEMPERATURE:
            target_z = target_z * inv_temperature
        tl.store(target_z_ptr + row, tl.where(in_shard, target_z, 0.0))

        running_max = float("-inf")
        sum_exp = 0.0
        sum_exp_dz = 0.0
        weighted_sum_z = 0.0
        best = 0
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            # Masked lanes hold a finite z (from u = 0), so products below never make nan;
            # they are kept out of the max and the sums explicitly.
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            if HAS_TEMPERATURE:
                z = z * inv_temperature
            block_max = tl.max(tl.where(mask, z, float("-inf")), 0)
            new_max = tl.maximum(running_max, block_max)
            e = tl.where(mask, tl.exp(z - new_max), 0.0)
            # The earlier blocks' sums moved to the new max (nothing before the first block: its max is -inf).
            earlier_sum, earlier_sum_dz = _moved_to(running_max, sum_exp, sum_exp_dz, new_max, NEED_SUM_EXP_DZ, False)
            if NEED_SUM_EXP_DZ:
                sum_exp_dz = earlier_sum_dz + tl.sum(e * (z - new_max), 0)
            sum_exp = earlier_sum + tl.sum(e, 0)
            if NEED_WEIGHTED_SUM_Z:
                if HAS_CLASS_WEIGHT:
                    w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
                    weighted_sum_z += tl.sum(w * z, 0)
                else:
                    weighted_sum_z += tl.sum(tl.where(mask, z, 0.0), 0)
            if NEED_ARGMAX:
                block_best = tl.min(tl.where(mask & (z == block_max), cols, _NO_INDEX), 0)
                # Strictly greater: an equal max in a later block keeps the first index.
                best = tl.where(block_max > running_max, block_best, best)
            running_max = new_max
        tl.store(row_max_ptr + row, running_max)
        tl.store(sum_exp_ptr + row, sum_exp)
        if NEED_SUM_EXP_DZ:
            tl.store(sum_exp_dz_ptr + row, sum_exp_dz)
        if NEED_WEIGHTED_SUM_Z:
            tl.store(weighted_sum_z_ptr + row, weighted_sum_z)
        if NEED_ARGMAX:
            tl.store(argmax_ptr + row, best.to(tl.int64) + vocab_offset)


@triton.jit
def _full_grad_kernel(
    logits_ptr, stride_row,       # [n_rows, vocab] raw logits u, overwritten with d loss / d u
    target_ptr,                   # [n_rows] int64 global ids
    class_weight_ptr,             # [vocab] fp32 class weights of this shard (read if HAS_E and HAS_CLASS_WEIGHT)
    lse_ptr,                      # [n_rows] fp32 global log-sum-exp of z
    a_ptr, stride_a,              # [n_rows] fp32 coefficients of flce.gradients.GradCoefficients
    h_ptr, stride_h,              #   (h read if HAS_H, e read if HAS_E)
    d_ptr, stride_d,
    e_ptr, stride_e,
    n_rows, vocab, vocab_offset, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_H: tl.constexpr, HAS_E: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """grad_z[c] = p[c] * (a - h * (z[c] - lse)) - (c == y) * d - e * w[c], chained through the
    temperature and the softcap to d / d u, one pass over each row."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        row_start = row * stride_row
        if WIDE_OFFSETS:
            row_start = tl.cast(row, tl.int64) * stride_row
        row_ptr = logits_ptr + row_start
        local_target = tl.load(target_ptr + row) - vocab_offset
        in_shard = (local_target >= 0) & (local_target < vocab)
        # -1 matches no column: the onehot term vanishes on shards without the target.
        target_col = tl.where(in_shard, local_target, -1).to(tl.int32)
        lse = tl.load(lse_ptr + row)
        a = tl.load(a_ptr + row * stride_a)
        d = tl.load(d_ptr + row * stride_d)
        h = 0.0
        if HAS_H:
            h = tl.load(h_ptr + row * stride_h)
        e = 0.0
        if HAS_E:
            e = tl.load(e_ptr + row * stride_e)
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                tanh = _tanh(z / softcap)
                z = softcap * tanh
            if HAS_TEMPERATURE:
                z = z * inv_temperature
            log_p = z - lse
            p = tl.exp(log_p)
            if HAS_H:
                g = p * (a - h * log_p)
            else:
                g = p * a
            g = tl.where(cols == target_col, g - d, g)
            if HAS_E:
                if HAS_CLASS_WEIGHT:
                    g -= e * tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
                else:
                    g -= e
            if HAS_SOFTCAP:
                g *= 1.0 - tanh * tanh
            if HAS_TEMPERATURE:
                g *= inv_temperature
            tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(
    x_ptr,                        # [n_elements] contiguous, scaled in place
    scale_ptr,                    # 0-d fp32 device scalar
    n_elements,
    WIDE_OFFSETS: tl.constexpr, BLOCK: tl.constexpr,
):
    """x *= scale, block-strided over the vector cores; nothing is read or written when the scale
    is exactly 1 (loss.backward()), which is decided on the device, without a host sync."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        pid = tl.program_id(0)
        n_programs = tl.num_programs(0)
        offsets0 = tl.arange(0, BLOCK)
        for block in range(pid, tl.cdiv(n_elements, BLOCK), n_programs):
            start = block * BLOCK
            if WIDE_OFFSETS:
                start = tl.cast(block, tl.int64) * BLOCK
            offsets = start + offsets0
            mask = offsets < n_elements
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)
