"""Triton row kernels of linear distillation over one chunk's two logits buffers, the teacher's and the
student's, each written by a cuBLAS GEMM (device code only): flce.distillation.tiles' formulas restated
column block by column block, as kernels.py's are for cross-entropy.

A program takes one logits row (or, ``_pair_passes_kernel``, rows ``pid, pid + P, ...``) and streams it in
BLOCK_V column blocks; logits arrive in the compute dtype (bf16/fp16/fp32), all arithmetic is fp32, and the
gradients are written over the logits they come from. Shared arguments:

    teacher_ptr, student_ptr   [n, V] raw logits u_t, u_s of this (shard of the) vocabulary, row strides
                               stride_teacher, stride_student, unit column stride
    target_ptr                 [n] int64 global class ids (read where HARD), vocab_offset: column 0's id
    inv_temperature            1 / T: t = u_t / T, s = u_s / T

and constexpr flags: ``CROSS`` 1 forward KL's sum exp(t - max t) (t - s), 2 reverse KL's sum exp(s - max s)
(s - t), 0 none; ``LOSS`` 0 forward KL, 1 reverse KL, 2 JSD; ``SOFT`` the divergence is part of the loss;
``HARD`` the hard-label cross-entropy is (its own max and sum of exp(u_s) where ``HARD_OWN_LSE``, T != 1);
``TEACHER`` the teacher's logits take a gradient too; ``ENTROPY`` the statistics sweep also sums exp(d) d,
d = (u_s - max u_s) / T (the student's entropy: semantics.PartialPairStats.student_dz_sum, at student_dz_ptr);
``PTX`` the mixture's logarithm is one MUFU instruction (ptx_math: an NVIDIA GPU, not the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce.backends.cuda import ptx_math
from flce.backends.online_softmax import LN2, LOG2E, _moved_to

FP32_SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _stats_sweep(teacher_row, student_row, V, inv_temperature, CROSS: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
                 ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's partial statistics over columns [0, V) (semantics.PartialPairStats): (max u_t, sum exp((u_t -
    max u_t) / T), max u_s, sum exp((u_s - max u_s) / T), the CROSS sum relative to its own softmax's max, max u_s,
    sum exp(u_s - max u_s), with ENTROPY sum exp(d) d, d = (u_s - max u_s) / T), every running sum moved to its
    running max as that grows. The maxima are the raw logits' (the later sweeps' u - max is then exactly 0 at the
    largest); the exponentials run in base 2 ((u - max) T^-1 log2 e: exp2 without a multiply more; the sums are the
    same numbers)."""
    cols = tl.arange(0, BLOCK_V)
    to_base2 = inv_temperature * LOG2E
    t_max = tl.full((), float("-inf"), tl.float32)
    s_max = tl.full((), float("-inf"), tl.float32)
    h_max = tl.full((), float("-inf"), tl.float32)
    t_sum = tl.zeros((), tl.float32)
    s_sum = tl.zeros((), tl.float32)
    h_sum = tl.zeros((), tl.float32)
    cross = tl.zeros((), tl.float32)
    s_dz = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        # Masked lanes read -inf: out of every max, exp2 makes them 0 in every sum (the CROSS sum masks its
        # difference, -inf - -inf).
        u_s = tl.load(student_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u_t = tl.load(teacher_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_t_max = tl.maximum(t_max, tl.max(u_t, 0))
        new_s_max = tl.maximum(s_max, tl.max(u_s, 0))
        e_t = tl.exp2((u_t - new_t_max) * to_base2)
        e_s = tl.exp2((u_s - new_s_max) * to_base2)
        t_rescale = tl.exp2((t_max - new_t_max) * to_base2)
        s_rescale = tl.exp2((s_max - new_s_max) * to_base2)
        if CROSS == 1:
            cross = cross * t_rescale + tl.sum(tl.where(mask, e_t * (u_t - u_s), 0.0), 0) * inv_temperature
        if CROSS == 2:
            cross = cross * s_rescale + tl.sum(tl.where(mask, e_s * (u_s - u_t), 0.0), 0) * inv_temperature
        if ENTROPY:
            # d moves by (max - new max) / T where the sum has columns (online_softmax._moved_to's algebra).
            moved = tl.where(s_sum > 0.0, (s_max - new_s_max) * inv_temperature, 0.0)
            block_dz = tl.sum(e_s * tl.where(mask, u_s - new_s_max, 0.0), 0) * inv_temperature
            s_dz = (s_dz + moved * s_sum) * s_rescale + block_dz
        t_sum = t_sum * t_rescale + tl.sum(e_t, 0)
        s_sum = s_sum * s_rescale + tl.sum(e_s, 0)
        if HARD_OWN_LSE:
            new_h_max = tl.maximum(h_max, tl.max(u_s, 0))
            h_sum = _moved_to(h_max, h_sum, h_sum, new_h_max, False, False)[0] + tl.sum(tl.exp(u_s - new_h_max), 0)
            h_max = new_h_max
        t_max = new_t_max
        s_max = new_s_max
    return t_max, t_sum, s_max, s_sum, cross, h_max, h_sum, s_dz


@triton.jit
def _log2_mixture(p, q, beta, PTX: tl.constexpr):
    """log2 m, m = beta p + (1 - beta) q, from the probabilities themselves (one log2 where the log-space form
    takes an exp2 and a log2 more), m held at fp32's smallest normal: a p or q that is subnormal (beta p rounding
    to 0) would otherwise meet log2 0 = -inf, and its term p (log p - log m), at most p (-log beta), is below
    1e-36 either way. Callers keep out the columns whose p (q) is 0, whose terms are 0."""
    return ptx_math.log2(tl.maximum(beta * p + (1.0 - beta) * q, FP32_SMALLEST_NORMAL), PTX)


@triton.jit
def _mixture_sweep(teacher_row, student_row, V, inv_temperature, teacher_max, teacher_log_sum, student_max,
                   student_log_sum, beta, REVERSE: tl.constexpr, PTX: tl.constexpr, BLOCK_V: tl.constexpr):
    """JSD's second pass over one row: (sum p (log p - log m), sum q (log q - log m)) given both rows' normalisers
    over the whole vocabulary (semantics.PairStats: raw max, log_sum); REVERSE walks the blocks from the last (the
    ones an earlier sweep read last, still in L2)."""
    cols = tl.arange(0, BLOCK_V)
    to_base2 = inv_temperature * LOG2E
    teacher_log_sum2 = teacher_log_sum * LOG2E
    student_log_sum2 = student_log_sum * LOG2E
    n_blocks = tl.cdiv(V, BLOCK_V)
    teacher_kl = tl.zeros((), tl.float32)
    student_kl = tl.zeros((), tl.float32)
    for i in range(0, n_blocks):
        block = i
        if REVERSE:
            block = n_blocks - 1 - i
        start = block * BLOCK_V
        mask = start + cols < V
        u_t = tl.load(teacher_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        u_s = tl.load(student_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        log2_p = (u_t - teacher_max) * to_base2 - teacher_log_sum2
        log2_q = (u_s - student_max) * to_base2 - student_log_sum2
        p = tl.exp2(log2_p)
        q = tl.exp2(log2_q)
        log2_m = _log2_mixture(p, q, beta, PTX)
        teacher_kl += tl.sum(tl.where(mask & (p > 0.0), p * (log2_p - log2_m), 0.0), 0)
        student_kl += tl.sum(tl.where(mask & (q > 0.0), q * (log2_q - log2_m), 0.0), 0)
    return teacher_kl * LN2, student_kl * LN2


@triton.jit
def _grad_sweep(teacher_row, student_row, first, stop, target_col, inv_temperature, teacher_max, teacher_log_sum,
                student_max, student_log_sum, soft_scale, student_center, teacher_center, teacher_scale, hard_lse,
                hard_scale, beta,
                LOSS: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr, TEACHER: tl.constexpr,
                REVERSE: tl.constexpr, CROSS_SUM: tl.constexpr, PTX: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite columns [first, stop) of one row's student logits with d loss / d u_s and, with TEACHER, its
    teacher logits with d loss / d u_t (semantics module docstring: soft_scale f_s plus the hard term's
    hard_scale (softmax(u_s) - onehot), teacher_scale f_t); both are formed before either is written. Logs and
    differences in base 2 (y = t log2 e), times ln 2 where the formula takes natural ones; log-probabilities from
    the normalisers as semantics.PairStats keeps them ((u - max) / T - log_sum). CROSS_SUM (forward KL, whose
    student gradient q - p needs no centre): returns sum p (t - s) over the columns, the loss's E_p[t - s], so the
    row is read once where its normalisers came from the logits GEMMs; 0 otherwise."""
    cols = tl.arange(0, BLOCK_V)
    to_base2 = inv_temperature * LOG2E
    teacher_log_sum2 = teacher_log_sum * LOG2E
    student_log_sum2 = student_log_sum * LOG2E
    n_blocks = tl.cdiv(stop - first, BLOCK_V)
    cross = tl.zeros((), tl.float32)
    for i in range(0, n_blocks):
        block = i
        if REVERSE:
            block = n_blocks - 1 - i
        start = first + block * BLOCK_V
        mask = start + cols < stop
        u_s = tl.load(student_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        u_t = tl.load(teacher_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        y_t = u_t * to_base2
        y_s = u_s * to_base2
        log2_p = (u_t - teacher_max) * to_base2 - teacher_log_sum2
        log2_q = (u_s - student_max) * to_base2 - student_log_sum2
        g_s = tl.zeros([BLOCK_V], dtype=tl.float32)
        g_t = tl.zeros([BLOCK_V], dtype=tl.float32)
        if SOFT:
            p = tl.exp2(log2_p)
            q = tl.exp2(log2_q)
            if LOSS == 0:
                g_s = q - p
                if CROSS_SUM:
                    cross += tl.sum(tl.where(mask, p * (y_t - y_s), 0.0), 0)
                if TEACHER:
                    g_t = p * ((y_t - y_s) * LN2 - teacher_center)
            if LOSS == 1:
                g_s = q * ((y_s - y_t) * LN2 - student_center)
                if TEACHER:
                    g_t = p - q
            if LOSS == 2:
                log2_m = _log2_mixture(p, q, beta, PTX)
                g_s = tl.where(q > 0.0, (1.0 - beta) * q * ((log2_q - log2_m) * LN2 - student_center), 0.0)
                if TEACHER:
                    g_t = tl.where(p > 0.0, beta * p * ((log2_p - log2_m) * LN2 - teacher_center), 0.0)
            g_s = g_s * soft_scale
        if HARD:
            hard_p = tl.exp(u_s - hard_lse)
            g_s += hard_scale * tl.where(start + cols == target_col, hard_p - 1.0, hard_p)
        tl.store(student_row + start + cols, g_s.to(student_row.dtype.element_ty), mask=mask)
        if TEACHER:
            tl.store(teacher_row + start + cols, (g_t * teacher_scale).to(teacher_row.dtype.element_ty), mask=mask)
    return cross * LN2


@triton.jit
def _target_column(target_ptr, row, V, vocab_offset, ignore_index):
    """The row's target column in this shard's logits, -1 where the shard does not hold it or it is ignored."""
    target = tl.load(target_ptr + row)
    local = target - vocab_offset
    here = (local >= 0) & (local < V) & (target != ignore_index)
    return tl.where(here, local, -1)


@triton.jit
def _row_statistics(teacher_row, student_row, target_ptr, row, teacher_max_ptr, teacher_sum_ptr, student_max_ptr,
                    student_sum_ptr, cross_ptr, hard_max_ptr, hard_sum_ptr, target_logit_ptr, student_dz_ptr, V,
                    vocab_offset, ignore_index, inv_temperature, CROSS: tl.constexpr, HARD: tl.constexpr,
                    HARD_OWN_LSE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's statistics sweep with its outputs stored (_pair_stats_kernel's docstring); returns them and the
    row's target column (-1: none here) for a kernel that goes on with the row."""
    t_max, t_sum, s_max, s_sum, cross, h_max, h_sum, s_dz = _stats_sweep(teacher_row, student_row, V,
                                                                         inv_temperature, CROSS, HARD_OWN_LSE,
                                                                         ENTROPY, BLOCK_V)
    tl.store(teacher_max_ptr + row, t_max)
    tl.store(teacher_sum_ptr + row, t_sum)
    tl.store(student_max_ptr + row, s_max)
    tl.store(student_sum_ptr + row, s_sum)
    if CROSS != 0:
        tl.store(cross_ptr + row, cross)
    if HARD_OWN_LSE:
        tl.store(hard_max_ptr + row, h_max)
        tl.store(hard_sum_ptr + row, h_sum)
    if ENTROPY:
        tl.store(student_dz_ptr + row, s_dz)
    target_col = -1
    if HARD:
        target_col = _target_column(target_ptr, row, V, vocab_offset, ignore_index)
        picked = tl.load(student_row + tl.maximum(target_col, 0)).to(tl.float32)
        tl.store(target_logit_ptr + row, tl.where(target_col >= 0, picked, 0.0))
    return t_max, t_sum, s_max, s_sum, cross, h_max, h_sum, target_col


@triton.jit
def _pair_stats_kernel(
    teacher_ptr, stride_teacher, student_ptr, stride_student, target_ptr,
    teacher_max_ptr, teacher_sum_ptr, student_max_ptr, student_sum_ptr, cross_ptr, hard_max_ptr, hard_sum_ptr,
    target_logit_ptr, student_dz_ptr,
    V, vocab_offset, ignore_index, inv_temperature,
    CROSS: tl.constexpr, HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr, ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Both softmaxes' partial statistics of each row in one pass (semantics.PartialPairStats; [n] fp32 outputs,
    cross_ptr read where CROSS, hard_* where HARD_OWN_LSE, target_logit_ptr where HARD: u_s at the target, 0 off
    this shard; student_dz_ptr where ENTROPY)."""
    row = tl.program_id(0).to(tl.int64)
    _row_statistics(teacher_ptr + row * stride_teacher, student_ptr + row * stride_student, target_ptr, row,
                    teacher_max_ptr, teacher_sum_ptr, student_max_ptr, student_sum_ptr, cross_ptr, hard_max_ptr,
                    hard_sum_ptr, target_logit_ptr, student_dz_ptr, V, vocab_offset, ignore_index, inv_temperature,
                    CROSS, HARD, HARD_OWN_LSE, ENTROPY, BLOCK_V)


@triton.jit
def _mixture_sums_kernel(
    teacher_ptr, stride_teacher, student_ptr, stride_student, teacher_max_ptr, teacher_log_sum_ptr,
    student_max_ptr, student_log_sum_ptr, teacher_kl_ptr, student_kl_ptr,
    V, inv_temperature, beta,
    PTX: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """JSD's second pass, a separate kernel (vocabulary shards, whose statistics are global only after an
    exchange): this shard's sums of KL(P || M) and KL(Q || M) per row, given both rows' normalisers (max and
    log_sum, [n] fp32 each)."""
    row = tl.program_id(0).to(tl.int64)
    teacher_kl, student_kl = _mixture_sweep(teacher_ptr + row * stride_teacher, student_ptr + row * stride_student,
                                            V, inv_temperature, tl.load(teacher_max_ptr + row),
                                            tl.load(teacher_log_sum_ptr + row), tl.load(student_max_ptr + row),
                                            tl.load(student_log_sum_ptr + row), beta, False, PTX, BLOCK_V)
    tl.store(teacher_kl_ptr + row, teacher_kl)
    tl.store(student_kl_ptr + row, student_kl)


@triton.jit
def _pair_grad_kernel(
    teacher_ptr, stride_teacher, student_ptr, stride_student, target_ptr,
    teacher_max_ptr, teacher_log_sum_ptr, student_max_ptr, student_log_sum_ptr, soft_scale_ptr, student_center_ptr,
    teacher_center_ptr, teacher_scale_ptr, hard_lse_ptr, hard_scale_ptr, expectation_ptr,
    V, vocab_offset, ignore_index, inv_temperature, beta,
    LOSS: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr, TEACHER: tl.constexpr, EXPECTATION: tl.constexpr,
    SPAN: tl.constexpr, PTX: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The gradients over the logits from per-row coefficients (semantics.PairCoefficients, [n] fp32 each; a
    centre read where its loss has one, the teacher's where TEACHER, the hard term's where HARD). Program
    (row, k) takes columns [k SPAN, (k + 1) SPAN): the columns are independent once the coefficients are known,
    so a chunk's rows split into short programs (kernels._plain_grad_kernel says why). EXPECTATION (forward KL,
    the student's gradient alone): each program also stores its columns' sum p (t - s) at expectation_ptr
    [n, programs a row], whose row sums are this shard's part of the loss's E_p[t - s]."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * SPAN
    student_center = 0.0
    if LOSS != 0:
        student_center = tl.load(student_center_ptr + row)
    teacher_center = 0.0
    teacher_scale = 0.0
    if TEACHER:
        teacher_scale = tl.load(teacher_scale_ptr + row)
        if LOSS != 1:
            teacher_center = tl.load(teacher_center_ptr + row)
    hard_lse = 0.0
    hard_scale = 0.0
    target_col = -1
    if HARD:
        hard_lse = tl.load(hard_lse_ptr + row)
        hard_scale = tl.load(hard_scale_ptr + row)
        target_col = _target_column(target_ptr, row, V, vocab_offset, ignore_index)
    expectation = _grad_sweep(teacher_ptr + row * stride_teacher, student_ptr + row * stride_student, first,
                              tl.minimum(first + SPAN, V), target_col, inv_temperature, tl.load(teacher_max_ptr + row),
                              tl.load(teacher_log_sum_ptr + row), tl.load(student_max_ptr + row),
                              tl.load(student_log_sum_ptr + row), tl.load(soft_scale_ptr + row), student_center,
                              teacher_center, teacher_scale, hard_lse, hard_scale, beta, LOSS, SOFT, HARD, TEACHER,
                              False, EXPECTATION, PTX, BLOCK_V)
    if EXPECTATION:
        tl.store(expectation_ptr + row * tl.num_programs(1) + tl.program_id(1), expectation)


@triton.jit
def _pair_passes_kernel(
    teacher_ptr, stride_teacher, student_ptr, stride_student, target_ptr, scale_ptr, stride_scale,
    teacher_max_ptr, teacher_sum_ptr, student_max_ptr, student_sum_ptr, cross_ptr, hard_max_ptr, hard_sum_ptr,
    target_logit_ptr, student_dz_ptr, teacher_kl_ptr, student_kl_ptr,
    n_rows, V, ignore_index, inv_temperature, soft_factor, hard_factor, beta,
    CROSS: tl.constexpr, LOSS: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    ENTROPY: tl.constexpr, MIXTURE: tl.constexpr, WRITE_GRAD: tl.constexpr, TEACHER: tl.constexpr,
    GRAD_REVERSE: tl.constexpr, KNOWN_STATS: tl.constexpr, PTX: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Every pass of an unsharded chunk in one kernel, a row's sweeps back to back: its statistics (outputs as
    _pair_stats_kernel's), with MIXTURE JSD's sums KL(P || M), KL(Q || M) (teacher_kl_ptr, student_kl_ptr), and
    with WRITE_GRAD its gradients over the logits, the per-row coefficients formed here from the row's loss scale
    r (scale_ptr, stride stride_scale: 0 broadcasts one; semantics.pair_coefficients: soft scale r soft_factor,
    soft_factor = (1 - w) / T, hard scale r hard_factor, hard_factor = w, the centres from this row's sums).
    Each sweep walks the blocks in the direction opposite to the one before it (GRAD_REVERSE: the gradient's
    sweep follows the statistics' alone), so it starts on the blocks still in L2; program p takes rows p, p + P,
    ...: P, the rows in flight, bounds what L2 must hold. KNOWN_STATS: the statistics pointers hold the row's
    statistics already (the logits GEMMs', the entropy's sum among them where the call asks for it, reverse KL's
    cross sum with CROSS 2; never with HARD_OWN_LSE), read instead of swept; with CROSS 1 (forward KL, WRITE_GRAD
    without TEACHER) the gradient's sweep makes the cross sum and stores it: one read a row."""
    pid = tl.program_id(0)
    for row_index in range(pid, n_rows, tl.num_programs(0)):
        row = tl.cast(row_index, tl.int64)
        teacher_row = teacher_ptr + row * stride_teacher
        student_row = student_ptr + row * stride_student
        if KNOWN_STATS:
            t_max = tl.load(teacher_max_ptr + row)
            t_sum = tl.load(teacher_sum_ptr + row)
            s_max = tl.load(student_max_ptr + row)
            s_sum = tl.load(student_sum_ptr + row)
            cross = 0.0
            if CROSS == 2:  # reverse KL's, from the student's GEMM (its epilogue read the teacher's logits)
                cross = tl.load(cross_ptr + row)
            h_max = 0.0
            h_sum = 1.0
            target_col = -1
            if HARD:
                target_col = _target_column(target_ptr, row, V, 0, ignore_index)
        else:
            t_max, t_sum, s_max, s_sum, cross, h_max, h_sum, target_col = _row_statistics(
                teacher_row, student_row, target_ptr, row, teacher_max_ptr, teacher_sum_ptr, student_max_ptr,
                student_sum_ptr, cross_ptr, hard_max_ptr, hard_sum_ptr, target_logit_ptr, student_dz_ptr, V, 0,
                ignore_index, inv_temperature, CROSS, HARD, HARD_OWN_LSE, ENTROPY, BLOCK_V)
        teacher_log_sum = tl.log(t_sum)
        student_log_sum = tl.log(s_sum)
        teacher_kl = 0.0
        student_kl = 0.0
        if MIXTURE:
            teacher_kl, student_kl = _mixture_sweep(teacher_row, student_row, V, inv_temperature, t_max,
                                                    teacher_log_sum, s_max, student_log_sum, beta, True, PTX,
                                                    BLOCK_V)
            tl.store(teacher_kl_ptr + row, teacher_kl)
            tl.store(student_kl_ptr + row, student_kl)
        if WRITE_GRAD:
            r = tl.load(scale_ptr + row * stride_scale)
            student_center = 0.0
            teacher_center = 0.0
            if LOSS == 0:
                teacher_center = cross / t_sum
            if LOSS == 1:
                student_center = cross / s_sum
            if LOSS == 2:
                student_center = student_kl
                teacher_center = teacher_kl
            hard_lse = s_max + student_log_sum  # temperature 1: the raw max is the softmax's
            if HARD_OWN_LSE:
                hard_lse = h_max + tl.log(h_sum)
            expectation = _grad_sweep(teacher_row, student_row, 0, V, target_col, inv_temperature, t_max,
                                      teacher_log_sum, s_max, student_log_sum, r * soft_factor, student_center,
                                      teacher_center, r * soft_factor, hard_lse, r * hard_factor, beta, LOSS, SOFT,
                                      HARD, TEACHER, GRAD_REVERSE, KNOWN_STATS and CROSS == 1, PTX, BLOCK_V)
            if KNOWN_STATS and CROSS == 1:
                tl.store(cross_ptr + row, expectation * t_sum)  # the statistics' form: relative to the max
