"""Fused GEMM kernels of the CUDA backend (device code only).

:func:`_gemm_grad_kernel` and, on Hopper, :func:`_gemm_grad_persistent_kernel` (end of the file)
compute a logits tile and write d loss / d u in its place, for the schedules that recompute logits
in backward.

:func:`_gemm_row_stats_kernel` computes logits tiles ``u = x @ W.T (+ b)`` with ``tl.dot`` (wgmma
on Hopper) and reduces each tile in registers to row statistics, so a forward that needs only
statistics never writes the ``[tokens, V]`` logits to memory. Each program owns one block of
BLOCK_M token rows and one *split* of the vocabulary (a run of consecutive BLOCK_N tiles); it walks
its tiles carrying running statistics, FlashAttention-style, and writes one partial result per
(split, row). A few splits keep every SM busy at small token counts; the host merges the
``[SPLITS, n]`` partials (semantics.merge_partial_stats algebra), which is O(tokens) work.

Each logit is rounded to the inputs' dtype (LOGITS_DTYPE) before the statistics, as cuBLAS rounds the
logits it writes: the statistics are those of the logits PyTorch would materialise, and they agree
with the logits a backward recomputes (a softmax from unrounded statistics over rounded logits
would not sum to one, which the entropy and z-loss gradients amplify).

Statistics are kept in base 2 (``y = z * log2(e)``): ``exp2(y - m)`` is one fused multiply-add and
one MUFU instruction per logit, the epilogue's whole cost on the plain path. The host converts
back: ``row_max = m / log2(e)``; the sums of ``exp2(y - m)`` are the sums of ``exp(z - max)``.
The entropy's sum is the exception: ``sum exp2(y - m) * (z - r)`` with z the natural logit exactly as
the gradient kernels compute it and r = m * ln(2) the row max the merge will report, so that the
gradient's ``z - lse`` and the entropy share every rounding (semantics.py says why that matters).

Program order (GROUP_M): consecutive programs take GROUP_M row blocks x SPLITS splits, so the SMs
working at one time share the same few x row blocks and W tiles in L2.

Shared arguments:

    x        [M, K] hidden rows; a pointer (row stride stride_xm, unit column stride) or, with
             USE_TMA, a tensor descriptor of block [BLOCK_M, BLOCK_K]
    w        [V, K] this shard's weight; a pointer (stride_wv) or a descriptor of block [BLOCK_N, BLOCK_K]
    bias_ptr [V] (read when HAS_BIAS)
    part_*   [SPLITS, M] outputs: max of y, sum exp2(y - max), sum exp2(y - max) * (z - max * ln 2),
             sum w[c] * y[c], first argmax (global index, int64)
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce.backends.cuda.exp_grad_kernels import CAP as EXP_CAP  # the cap the redo kernels test rows against
from flce.backends.cuda.kernels import _capped_scaled
from flce.backends.online_softmax import LN2, LOG2E, _moved_to


@triton.jit
def _program_tile(pid, M, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, SPLITS: tl.constexpr):
    """(row block, vocabulary split) of program pid, grouped so neighbours share L2 data."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    group_size = GROUP_M * SPLITS
    group = pid // group_size
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = pid % group_size
    return first_m + local % group_m, local // group_m


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b.T, acc, input_precision="ieee")
    return tl.dot(a, b.T, acc)


@triton.jit
def _logits_tile(x, w, off_m, off_n, M, V, K, stride_xm, stride_wv,
                 USE_TMA: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ W.T; rows >= M and columns >= V hold zeros. IEEE: fp32
    operands multiply in full fp32 (Triton's default for them is tf32, 1e-3 relative error)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = x.load([off_m, k])
            b = w.load([off_n, k])
            acc = _dot(a, b, acc, IEEE)
    else:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < V
        x_ptrs = x + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_ptrs = w + cols.to(tl.int64)[:, None] * stride_wv + ks[None, :]
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = k + ks < K
            a = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, b, acc, IEEE)
    return acc


@triton.jit
def _gemm_row_stats_kernel(
    x, w, bias_ptr, class_weight_ptr, logits_ptr, stride_lm, exp_offset_ptr, against_ptr, stride_am,
    part_max_ptr, part_sum_ptr, part_sum_dz_ptr, part_weighted_y_ptr, part_argmax_ptr,
    M, V, K, stride_xm, stride_wv, vocab_offset, softcap, inv_temperature, tiles_per_split,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    NEED_SUM_EXP_DZ: tl.constexpr, NEED_WEIGHTED_SUM_Z: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    STORE_LOGITS: tl.constexpr, STORE_EXP: tl.constexpr, LOGITS_DTYPE: tl.constexpr, USE_TMA: tl.constexpr,
    IEEE: tl.constexpr, AGAINST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLITS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Partial base-2 row statistics of z = cap(u) / T over one vocabulary split (module docstring).
    STORE_LOGITS: also write the rounded logits u to logits_ptr [M, V] (row stride stride_lm), for
    a schedule that turns them into the gradient next (one read and one write per logit left).
    STORE_EXP (a loss whose gradient is a row multiple of softmax - onehot, no bias or softcap: exp_grad_ops.py):
    write E = min(exp2(y - c), 2^CAP) there instead, c = exp_offset_ptr[row] (base 2), and take the statistics
    relative to c, as the warp-specialised GEMM's epilogue does (ws_stats_kernels._exp_chunk): each split's
    partial max is c and its sum the sum of E, so no pass over the logits turns them into the gradient.
    AGAINST (with NEED_SUM_EXP_DZ, no softcap): the entropy's sum taken against another head's logits u_a at
    against_ptr [M, V] (row stride stride_am), sum exp2(y - max) * (z - max * ln 2 - u_a / T) (engine.kernels)."""
    pid_m, split = _program_tile(tl.program_id(0), M, BLOCK_M, GROUP_M, SPLITS)
    off_m = pid_m * BLOCK_M
    rows = off_m + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_tiles = tl.cdiv(V, BLOCK_N)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, n_tiles)

    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    if STORE_EXP:
        running_max = tl.load(exp_offset_ptr + rows, mask=row_ok, other=0.0)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    running_sum_dz = tl.zeros((BLOCK_M,), tl.float32)
    weighted_y = tl.zeros((BLOCK_M,), tl.float32)
    best_index = tl.zeros((BLOCK_M,), tl.int64)
    for tile in range(first_tile, last_tile):
        off_n = tile * BLOCK_N
        u = _logits_tile(x, w, off_m, off_n, M, V, K, stride_xm, stride_wv,
                         USE_TMA, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
        cols = off_n + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        if HAS_BIAS:
            u += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        u = u.to(LOGITS_DTYPE)
        if STORE_EXP:
            y = u.to(tl.float32) * (inv_temperature * LOG2E) - running_max[:, None]
            e = tl.where(col_ok[None, :], tl.exp2(tl.minimum(y, EXP_CAP)), 0.0)
            tl.store(logits_ptr + rows.to(tl.int64)[:, None] * stride_lm + cols[None, :], e.to(LOGITS_DTYPE),
                     mask=row_ok[:, None] & col_ok[None, :])
            running_sum += tl.sum(e, 1)
        else:
            if STORE_LOGITS:
                tl.store(logits_ptr + rows.to(tl.int64)[:, None] * stride_lm + cols[None, :], u,
                         mask=row_ok[:, None] & col_ok[None, :])
            u = u.to(tl.float32)
            capped = _capped_scaled(u, softcap, 1.0, HAS_SOFTCAP)
            y = tl.where(col_ok[None, :], capped * (inv_temperature * LOG2E), float("-inf"))
            tile_max = tl.max(y, 1)
            new_max = tl.maximum(running_max, tile_max)
            e = tl.exp2(y - new_max[:, None])
            # The earlier tiles' sums moved to the new max (the entropy's to natural z - r, r = max * ln 2),
            # then this tile's added.
            running_sum, running_sum_dz = _moved_to(running_max, running_sum, running_sum_dz, new_max, NEED_SUM_EXP_DZ,
                                                    True)
            if NEED_SUM_EXP_DZ:
                dz = tl.where(col_ok[None, :], capped * inv_temperature - (new_max * LN2)[:, None], 0.0)
                if AGAINST:
                    other = tl.load(against_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :],
                                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                    dz -= other * inv_temperature
                running_sum_dz += tl.sum(e * dz, 1)
            running_sum += tl.sum(e, 1)
            if NEED_WEIGHTED_SUM_Z:
                if HAS_CLASS_WEIGHT:
                    cw = tl.load(class_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                    weighted_y += tl.sum(cw[None, :] * tl.where(col_ok[None, :], y, 0.0), 1)
                else:
                    weighted_y += tl.sum(tl.where(col_ok[None, :], y, 0.0), 1)
            if NEED_ARGMAX:
                tile_first = tl.min(tl.where(y == tile_max[:, None], cols[None, :], V), 1).to(tl.int64)
                # Strictly greater: an earlier tile keeps ties, so the first maximal index wins.
                best_index = tl.where(tile_max > running_max, tile_first, best_index)
            running_max = new_max

    out = split.to(tl.int64) * M + rows
    tl.store(part_max_ptr + out, running_max, mask=row_ok)
    tl.store(part_sum_ptr + out, running_sum, mask=row_ok)
    if NEED_SUM_EXP_DZ:
        tl.store(part_sum_dz_ptr + out, running_sum_dz, mask=row_ok)
    if NEED_WEIGHTED_SUM_Z:
        tl.store(part_weighted_y_ptr + out, weighted_y, mask=row_ok)
    if NEED_ARGMAX:
        tl.store(part_argmax_ptr + out, best_index + vocab_offset, mask=row_ok)


@triton.jit
def _target_logit_kernel(
    x_ptr, stride_xm, w_ptr, stride_wv, bias_ptr, target_ptr, target_z_ptr,
    K, V, vocab_offset, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """target_z[row] = cap(x[row] . W[y] + b[y]) / T for a target y in this shard, else 0: one dot per
    row, so the statistics kernel needs no per-logit comparison with the target.
    x [M, K], w [V, K] (unit column strides), target [M] int64 global ids, target_z [M] fp32."""
    row = tl.program_id(0).to(tl.int64)
    local_target = tl.load(target_ptr + row) - vocab_offset
    in_shard = (local_target >= 0) & (local_target < V)
    safe_target = tl.where(in_shard, local_target, 0)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), tl.float32)
    for k in range(0, K, BLOCK_K):
        mask = k + ks < K
        a = tl.load(x_ptr + row * stride_xm + k + ks, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + safe_target * stride_wv + k + ks, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    u = tl.sum(acc, 0)
    if HAS_BIAS:
        u += tl.load(bias_ptr + safe_target).to(tl.float32)
    u = u.to(x_ptr.dtype.element_ty).to(tl.float32)  # as the statistics kernel rounds it
    z = _capped_scaled(u, softcap, inv_temperature, HAS_SOFTCAP)
    tl.store(target_z_ptr + row, tl.where(in_shard, z, 0.0))


@triton.jit
def _grouped_tile(tile, M, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number ``tile``, GROUP_M row blocks at a time so the
    programs working at once share their weight tiles in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    group_size = GROUP_M * tl.cdiv(V, BLOCK_N)
    first_m = (tile // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group_size) % group_m, (tile % group_size) // group_m


@triton.jit
def _grad_of_logits(
    u, rows, cols, M, V, bias_ptr, class_weight_ptr, target_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr,
    vocab_offset, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_H: tl.constexpr, HAS_E: tl.constexpr, LOGITS_DTYPE: tl.constexpr,
):
    """d loss / d u (fp32) of the fp32 logits tile u at (rows, cols): rounded as cuBLAS would write
    it, then semantics.py's ``grad_z = p (a - h (z - lse)) - [c == y] d - e w[c]`` chained through cap and T.
    lse, a, h, d, e: [M] fp32 per-row values (h, e read when HAS_H / HAS_E)."""
    row_ok = rows < M
    col_ok = cols < V
    if HAS_BIAS:
        u += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    u = u.to(LOGITS_DTYPE).to(tl.float32)
    z = _capped_scaled(u, softcap, inv_temperature, HAS_SOFTCAP)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    d = tl.load(d_ptr + rows, mask=row_ok, other=0.0)
    local_target = tl.load(target_ptr + rows, mask=row_ok, other=-1) - vocab_offset
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    if HAS_H:
        h = tl.load(h_ptr + rows, mask=row_ok, other=0.0)
        grad = p * (a[:, None] - h[:, None] * log_p)
    else:
        grad = p * a[:, None]
    grad -= tl.where(cols[None, :] == local_target[:, None], d[:, None], 0.0)
    if HAS_E:
        e = tl.load(e_ptr + rows, mask=row_ok, other=0.0)
        if HAS_CLASS_WEIGHT:
            cw = tl.load(class_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            grad -= e[:, None] * cw[None, :]
        else:
            grad -= e[:, None]
    if HAS_SOFTCAP:
        t = z / (softcap * inv_temperature)  # tanh(u / softcap)
        grad = grad * (1.0 - t * t)
    return grad * inv_temperature


@triton.jit
def _gemm_grad_kernel(
    x, w, bias_ptr, class_weight_ptr, target_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr, grad_ptr, stride_gm,
    M, V, K, stride_xm, stride_wv, vocab_offset, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_H: tl.constexpr, HAS_E: tl.constexpr,
    LOGITS_DTYPE: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """grad [M, V] = d loss / d u, straight from a logits tile in registers (_grad_of_logits), so no
    logits pass through memory; grad_ptr row stride stride_gm, unit column stride. Grid: one program
    per output tile (the pointer path; Hopper takes _gemm_grad_persistent_kernel)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, V, BLOCK_M, BLOCK_N, GROUP_M)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    u = _logits_tile(x, w, off_m, off_n, M, V, K, stride_xm, stride_wv,
                     USE_TMA, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    grad = _grad_of_logits(u, rows, cols, M, V, bias_ptr, class_weight_ptr, target_ptr, lse_ptr,
                           a_ptr, h_ptr, d_ptr, e_ptr, vocab_offset, softcap, inv_temperature,
                           HAS_BIAS, HAS_SOFTCAP, HAS_CLASS_WEIGHT, HAS_H, HAS_E, LOGITS_DTYPE)
    tl.store(grad_ptr + rows.to(tl.int64)[:, None] * stride_gm + cols[None, :], grad.to(LOGITS_DTYPE),
             mask=(rows < M)[:, None] & (cols < V)[None, :])


@triton.jit
def _gemm_grad_persistent_kernel(
    x_desc, w_desc, grad_desc, bias_ptr, class_weight_ptr, target_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr,
    M, V, K, vocab_offset, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_H: tl.constexpr, HAS_E: tl.constexpr, LOGITS_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS, SUBTILES: tl.constexpr,
):
    """_gemm_grad_kernel for Hopper: PROGRAMS programs (one per SM) walk the output tiles, the tile
    loop flattened into the K loop so the next tile's TMA loads are in flight while this tile's
    epilogue runs; the gradient leaves through TMA stores (grad_desc, block [BLOCK_M, BLOCK_N /
    SUBTILES]), which clip the ragged edges. SUBTILES = 2 turns the tile into the gradient half by
    half, so fewer fp32 temporaries are live at once (the 128 x 256 tile spills otherwise)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, V, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            acc = _dot(x_desc.load([off_m, ki * BLOCK_K]), w_desc.load([off_n, ki * BLOCK_K]), acc, IEEE)
        rows = off_m + tl.arange(0, BLOCK_M)
        if SUBTILES == 2:
            left, right = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))
            cols = off_n + tl.arange(0, BLOCK_N // 2)
            grad = _grad_of_logits(left, rows, cols, M, V, bias_ptr, class_weight_ptr, target_ptr, lse_ptr,
                                   a_ptr, h_ptr, d_ptr, e_ptr, vocab_offset, softcap, inv_temperature,
                                   HAS_BIAS, HAS_SOFTCAP, HAS_CLASS_WEIGHT, HAS_H, HAS_E, LOGITS_DTYPE)
            grad_desc.store([off_m, off_n], grad.to(LOGITS_DTYPE))
            grad = _grad_of_logits(right, rows, cols + BLOCK_N // 2, M, V, bias_ptr, class_weight_ptr,
                                   target_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr, vocab_offset, softcap,
                                   inv_temperature, HAS_BIAS, HAS_SOFTCAP, HAS_CLASS_WEIGHT, HAS_H, HAS_E,
                                   LOGITS_DTYPE)
            grad_desc.store([off_m, off_n + BLOCK_N // 2], grad.to(LOGITS_DTYPE))
        else:
            grad = _grad_of_logits(acc, rows, off_n + tl.arange(0, BLOCK_N), M, V, bias_ptr, class_weight_ptr,
                                   target_ptr, lse_ptr, a_ptr, h_ptr, d_ptr, e_ptr, vocab_offset, softcap,
                                   inv_temperature, HAS_BIAS, HAS_SOFTCAP, HAS_CLASS_WEIGHT, HAS_H, HAS_E,
                                   LOGITS_DTYPE)
            grad_desc.store([off_m, off_n], grad.to(LOGITS_DTYPE))


@triton.jit
def _merge_splits_kernel(
    part_max_ptr, part_sum_ptr, part_sum_dz_ptr, part_weighted_y_ptr, part_argmax_ptr,
    row_max_ptr, sum_exp_ptr, sum_exp_dz_ptr, weighted_sum_z_ptr, argmax_ptr,
    M, SPLITS,
    NEED_SUM_EXP_DZ: tl.constexpr, NEED_WEIGHTED_SUM_Z: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
):
    """Fold the [SPLITS, M] base-2 partials of _gemm_row_stats_kernel into [M] statistics in natural
    units (semantics.PartialRowStats), splits in vocabulary order: one launch instead of a handful of
    small torch ops, which at short GEMMs cost more than the merge's bytes.

    Each step loads SPLIT_BLOCK splits of BLOCK rows at once and folds them into the running row
    statistics: a loop of one split a step waited out one load latency per split (134 us for 594
    splits of 1536 rows on the H100, more than the chunk's row kernel saved)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    running_sum_dz = tl.zeros((BLOCK,), tl.float32)
    weighted_y = tl.zeros((BLOCK,), tl.float32)
    best_index = tl.zeros((BLOCK,), tl.int64)
    for first in range(0, SPLITS, SPLIT_BLOCK):
        splits = first + tl.arange(0, SPLIT_BLOCK)
        offsets = splits[:, None].to(tl.int64) * M + rows[None, :]
        mask = (splits[:, None] < SPLITS) & ok[None, :]
        split_max = tl.load(part_max_ptr + offsets, mask=mask, other=float("-inf"))
        block_max = tl.max(split_max, 0)
        new_max = tl.maximum(running_max, block_max)
        # Rows past M (all -inf): shift by 0 instead of -inf, so that no inf - inf makes a NaN.
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        part_sum = tl.load(part_sum_ptr + offsets, mask=mask, other=0.0)
        part_sum_dz = tl.load(part_sum_dz_ptr + offsets, mask=mask, other=0.0) if NEED_SUM_EXP_DZ else part_sum
        # The running sums and every split's moved to the new max (the entropy's to r = max * ln 2, as its
        # kernel computed them), then added.
        running_sum, running_sum_dz = _moved_to(running_max, running_sum, running_sum_dz, shift, NEED_SUM_EXP_DZ,
                                                True)
        split_sum, split_sum_dz = _moved_to(split_max, part_sum, part_sum_dz, shift[None, :], NEED_SUM_EXP_DZ, True)
        running_sum += tl.sum(split_sum, 0)
        if NEED_SUM_EXP_DZ:
            running_sum_dz += tl.sum(split_sum_dz, 0)
        if NEED_WEIGHTED_SUM_Z:
            weighted_y += tl.sum(tl.load(part_weighted_y_ptr + offsets, mask=mask, other=0.0), 0)
        if NEED_ARGMAX:
            # The first split holding the block's max, and only where it beats the running max
            # strictly: an earlier split keeps ties, so the first maximal index wins.
            first_best = tl.min(tl.where(split_max == block_max[None, :], splits[:, None], SPLITS), 0)
            block_index = tl.sum(tl.where(splits[:, None] == first_best[None, :],
                                          tl.load(part_argmax_ptr + offsets, mask=mask, other=0), 0), 0)
            best_index = tl.where(block_max > running_max, block_index, best_index)
        running_max = new_max
    tl.store(row_max_ptr + rows, running_max * LN2, mask=ok)
    tl.store(sum_exp_ptr + rows, running_sum, mask=ok)
    if NEED_SUM_EXP_DZ:
        tl.store(sum_exp_dz_ptr + rows, running_sum_dz, mask=ok)
    if NEED_WEIGHTED_SUM_Z:
        tl.store(weighted_sum_z_ptr + rows, weighted_y * LN2, mask=ok)
    if NEED_ARGMAX:
        tl.store(argmax_ptr + rows, best_index, mask=ok)
