"""Triton-Ascend kernels of linear distillation: flce.distillation.tiles' formulas over one chunk's teacher
and student logits, written for the Ascend execution model as kernels.py's cross-entropy kernels are.

A program walks rows ``pid, pid + P, ...`` (grid stride, at most one program per vector core), each row in
blocks of ``BLOCK_V`` columns that ops.py sizes to the Unified Buffer. Conventions as kernels.py's: both
logits [n_rows, vocab] in the compute dtype with unit column stride and their own row stride, overwritten
by their gradients; per-row vectors fp32 contiguous [n_rows]; ``target_ptr`` int64 global ids with
``vocab_offset`` the shard's first id; fp32 math; int32 offsets unless ``WIDE_OFFSETS``. The loss and
its pieces are named by constexpr flags: ``CROSS`` 1 forward KL's sum (teacher-relative), 2 reverse KL's
(student-relative), 0 none; ``LOSS`` 0 forward KL, 1 reverse KL, 2 JSD.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pair_stats_kernel(
    teacher_ptr, stride_teacher,      # [n_rows, vocab] raw teacher logits u_t of this shard
    student_ptr, stride_student,      # [n_rows, vocab] raw student logits u_s
    target_ptr,                       # [n_rows] int64 global ids (read if HARD)
    teacher_max_ptr, teacher_sum_ptr,  # [n_rows] fp32 outputs: max u_t, sum exp((u_t - max u_t) / T)
    student_max_ptr, student_sum_ptr,  # [n_rows] fp32 outputs: max u_s, sum exp((u_s - max u_s) / T)
    cross_ptr,                        # [n_rows] fp32: the KL divergences' cross sum (CROSS != 0)
    hard_max_ptr, hard_sum_ptr,       # [n_rows] fp32: max u_s, sum exp(u_s - max) (HARD_OWN_LSE)
    target_logit_ptr,                 # [n_rows] fp32: u_s[target], 0 off this shard (HARD)
    student_dz_ptr,                   # [n_rows] fp32: sum exp(d) d, d = (u_s - max u_s) / T (ENTROPY)
    n_rows, vocab, vocab_offset, ignore_index, inv_temperature,
    CROSS: tl.constexpr, HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr, ENTROPY: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Both softmaxes' partial statistics in one pass (flce.distillation.semantics.PartialPairStats),
    every running sum rescaled when its running max grows."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        teacher_start = row * stride_teacher
        student_start = row * stride_student
        if WIDE_OFFSETS:
            teacher_start = tl.cast(row, tl.int64) * stride_teacher
            student_start = tl.cast(row, tl.int64) * stride_student
        teacher_row = teacher_ptr + teacher_start
        student_row = student_ptr + student_start
        if HARD:
            target = tl.load(target_ptr + row)
            local = target - vocab_offset
            here = (local >= 0) & (local < vocab) & (target != ignore_index)
            picked = tl.load(student_row + tl.where(here, local, 0).to(tl.int32), mask=here, other=0.0)
            tl.store(target_logit_ptr + row, tl.where(here, picked.to(tl.float32), 0.0))
        t_max = float("-inf")
        t_sum = 0.0
        s_max = float("-inf")
        s_sum = 0.0
        cross = 0.0
        s_dz = 0.0
        h_max = float("-inf")
        h_sum = 0.0
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            # Masked lanes read u = 0: finite, and kept out of every max and sum below.
            u_t = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
            u_s = tl.load(student_row + cols, mask=mask, other=0.0).to(tl.float32)
            t = u_t * inv_temperature
            s = u_s * inv_temperature
            # The raw logits' maxima (semantics.PairStats says why).
            new_t_max = tl.maximum(t_max, tl.max(tl.where(mask, u_t, float("-inf")), 0))
            new_s_max = tl.maximum(s_max, tl.max(tl.where(mask, u_s, float("-inf")), 0))
            t_rescale = tl.exp((t_max - new_t_max) * inv_temperature)
            s_rescale = tl.exp((s_max - new_s_max) * inv_temperature)
            e_t = tl.where(mask, tl.exp((u_t - new_t_max) * inv_temperature), 0.0)
            e_s = tl.where(mask, tl.exp((u_s - new_s_max) * inv_temperature), 0.0)
            if ENTROPY:
                # Each earlier d moves by (max - new max) / T where the sum has columns (semantics' merge).
                moved = tl.where(s_sum > 0.0, (s_max - new_s_max) * inv_temperature, 0.0)
                block_dz = tl.sum(e_s * tl.where(mask, (u_s - new_s_max) * inv_temperature, 0.0), 0)
                s_dz = (s_dz + moved * s_sum) * s_rescale + block_dz
            t_sum = t_sum * t_rescale + tl.sum(e_t, 0)
            s_sum = s_sum * s_rescale + tl.sum(e_s, 0)
            if CROSS == 1:
                cross = cross * t_rescale + tl.sum(e_t * (t - s), 0)
            if CROSS == 2:
                cross = cross * s_rescale + tl.sum(e_s * (s - t), 0)
            if HARD_OWN_LSE:
                new_h_max = tl.maximum(h_max, tl.max(tl.where(mask, u_s, float("-inf")), 0))
                h_sum = h_sum * tl.exp(h_max - new_h_max) + tl.sum(tl.where(mask, tl.exp(u_s - new_h_max), 0.0), 0)
                h_max = new_h_max
            t_max = new_t_max
            s_max = new_s_max
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


@triton.jit
def _mixture_sums_kernel(
    teacher_ptr, stride_teacher,      # [n_rows, vocab] raw teacher logits u_t of this shard
    student_ptr, stride_student,      # [n_rows, vocab] raw student logits u_s
    teacher_max_ptr, teacher_log_sum_ptr,  # [n_rows] fp32: both rows' normalisers over the whole vocabulary
    student_max_ptr, student_log_sum_ptr,  # (semantics.PairStats: raw max, log_sum)
    teacher_kl_ptr, student_kl_ptr,   # [n_rows] fp32 outputs: this shard's KL(P || M), KL(Q || M) sums
    n_rows, vocab, inv_temperature, log_beta, log_one_minus_beta,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """JSD's second pass: with log m = log(beta p + (1 - beta) q) as the max of the two terms plus
    log(1 + exp(-|difference|)) (no overflow, no log of 0), the sums of p (log p - log m) and q (log q - log m)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        teacher_start = row * stride_teacher
        student_start = row * stride_student
        if WIDE_OFFSETS:
            teacher_start = tl.cast(row, tl.int64) * stride_teacher
            student_start = tl.cast(row, tl.int64) * stride_student
        teacher_max = tl.load(teacher_max_ptr + row)
        teacher_log_sum = tl.load(teacher_log_sum_ptr + row)
        student_max = tl.load(student_max_ptr + row)
        student_log_sum = tl.load(student_log_sum_ptr + row)
        teacher_kl = 0.0
        student_kl = 0.0
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            u_t = tl.load(teacher_ptr + teacher_start + cols, mask=mask, other=0.0).to(tl.float32)
            u_s = tl.load(student_ptr + student_start + cols, mask=mask, other=0.0).to(tl.float32)
            log_p = (u_t - teacher_max) * inv_temperature - teacher_log_sum
            log_q = (u_s - student_max) * inv_temperature - student_log_sum
            a = log_p + log_beta
            b = log_q + log_one_minus_beta
            larger = tl.maximum(a, b)
            log_m = larger + tl.log(1.0 + tl.exp(tl.minimum(a, b) - larger))
            teacher_kl += tl.sum(tl.where(mask, tl.exp(log_p) * (log_p - log_m), 0.0), 0)
            student_kl += tl.sum(tl.where(mask, tl.exp(log_q) * (log_q - log_m), 0.0), 0)
        tl.store(teacher_kl_ptr + row, teacher_kl)
        tl.store(student_kl_ptr + row, student_kl)


@triton.jit
def _pair_grad_kernel(
    teacher_ptr, stride_teacher,      # [n_rows, vocab] raw u_t; overwritten with d loss / d u_t if TEACHER
    student_ptr, stride_student,      # [n_rows, vocab] raw u_s; overwritten with d loss / d u_s
    target_ptr,                       # [n_rows] int64 global ids (read if HARD)
    teacher_max_ptr, teacher_log_sum_ptr,  # [n_rows] fp32 per-row coefficients of
    student_max_ptr, student_log_sum_ptr,  #   flce.distillation.semantics.PairCoefficients
    soft_scale_ptr,
    student_center_ptr,               #   (read if LOSS != 0)
    teacher_center_ptr,               #   (read if TEACHER and LOSS != 1)
    hard_lse_ptr, hard_scale_ptr,     #   (read if HARD)
    teacher_scale_ptr,                #   (read if TEACHER)
    n_rows, vocab, vocab_offset, ignore_index, inv_temperature, beta, log_beta, log_one_minus_beta,
    LOSS: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr, TEACHER: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """g_s = soft_scale f_s + hard_scale (softmax(u_s) - onehot) and, with TEACHER, g_t = teacher_scale f_t,
    f_s and f_t flce.distillation.semantics' elementwise terms, in one pass that reads both logits blocks
    before it writes either."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        teacher_start = row * stride_teacher
        student_start = row * stride_student
        if WIDE_OFFSETS:
            teacher_start = tl.cast(row, tl.int64) * stride_teacher
            student_start = tl.cast(row, tl.int64) * stride_student
        teacher_row = teacher_ptr + teacher_start
        student_row = student_ptr + student_start
        teacher_max = tl.load(teacher_max_ptr + row)
        teacher_log_sum = tl.load(teacher_log_sum_ptr + row)
        student_max = tl.load(student_max_ptr + row)
        student_log_sum = tl.load(student_log_sum_ptr + row)
        soft_scale = tl.load(soft_scale_ptr + row)
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
            target = tl.load(target_ptr + row)
            local = target - vocab_offset
            here = (local >= 0) & (local < vocab) & (target != ignore_index)
            target_col = tl.where(here, local, -1).to(tl.int32)
        for start in range(0, vocab, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab
            u_t = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
            u_s = tl.load(student_row + cols, mask=mask, other=0.0).to(tl.float32)
            t = u_t * inv_temperature
            s = u_s * inv_temperature
            log_p = (u_t - teacher_max) * inv_temperature - teacher_log_sum
            log_q = (u_s - student_max) * inv_temperature - student_log_sum
            p = tl.exp(log_p)
            q = tl.exp(log_q)
            f_s = tl.zeros([BLOCK_V], dtype=tl.float32)
            f_t = tl.zeros([BLOCK_V], dtype=tl.float32)
            if SOFT:
                if LOSS == 0:
                    f_s = q - p
                    f_t = p * ((t - s) - teacher_center)
                if LOSS == 1:
                    f_s = q * ((s - t) - student_center)
                    f_t = p - q
                if LOSS == 2:
                    a = log_p + log_beta
                    b = log_q + log_one_minus_beta
                    larger = tl.maximum(a, b)
                    log_m = larger + tl.log(1.0 + tl.exp(tl.minimum(a, b) - larger))
                    f_s = (1.0 - beta) * q * (log_q - log_m - student_center)
                    f_t = beta * p * (log_p - log_m - teacher_center)
            g_s = soft_scale * f_s
            if HARD:
                hard_p = tl.exp(u_s - hard_lse)
                g_s += hard_scale * tl.where(cols == target_col, hard_p - 1.0, hard_p)
            tl.store(student_row + cols, g_s.to(student_ptr.dtype.element_ty), mask=mask)
            if TEACHER:
                tl.store(teacher_row + cols, (teacher_scale * f_t).to(teacher_ptr.dtype.element_ty), mask=mask)
