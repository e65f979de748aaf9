"""Pure-PyTorch chunk kernels: the ground truth and the CPU production path.

Each function works on one chunk of rows and the full vocabulary; the math is
done in float32 (float64 for float64 inputs) whatever the input dtype.

On the CPU a chunk is processed in blocks of rows small enough to stay in the
caches (:data:`CPU_BLOCK_BYTES`): each block is read from memory once and every
elementwise pass after the first runs on cached data. The gradient kernels work
in place on the logits they are given, so no chunk-sized temporary is allocated
(a fresh large allocation costs page faults on every chunk). On accelerators a
block is the whole chunk: there, fewer and larger kernels are what matters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flce.config import LCEConfig
from flce.engine.rows import torch_count_tokens, torch_matmul_
from flce.gradients import GradCoefficients
from flce.semantics import (
    PartialRowStats,
    merge_partial_stats,
    needs_argmax,
    needs_logit_stats,
    needs_sum_exp_dz,
    needs_weighted_sum_z,
)
from flce.semantics import (
    statistics_dtype as math_dtype,
)

# Rows of grad_weight upcast at a time when accumulating in fp32: bounds the temporary.
_FP32_ACCUMULATE_ROWS = 8192
# Bytes of fp32 logits per CPU block: a share of the L3 cache. Measured on a 2-core EPYC (1 MiB L2
# per core, 32 MiB L3) at 699 x 32000: 2-32 MiB blocks within 10% of each other; 8 MiB best with
# 2 threads, and few enough blocks that OpenMP's per-op barriers stay cheap on a loaded machine.
CPU_BLOCK_BYTES = 8 << 20


def _target_onehot_index(target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, target, 0).unsqueeze(1)


def row_blocks(logits: torch.Tensor) -> Iterator[slice]:
    """Row slices covering the chunk: cache-sized on the CPU, the whole chunk elsewhere."""
    n_rows, vocab = logits.shape
    if logits.device.type != "cpu":
        step = max(1, n_rows)
    else:
        step = max(1, CPU_BLOCK_BYTES // max(1, vocab * math_dtype(logits.dtype).itemsize))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


class ReferenceKernels:
    """Implements flce.engine.kernels.RowKernels with torch ops (no capabilities)."""

    def plain_loss(self, logits, target, ignore_index, grad_scale):
        math = math_dtype(logits.dtype)
        valid = target != ignore_index
        index = _target_onehot_index(target, valid)
        target_logit = logits.gather(1, index).squeeze(1).to(math)
        lse = torch.empty(logits.shape[0], dtype=math, device=logits.device)
        if grad_scale is None:
            # The logits may be kept for backward (deferred schedule): read them, never write.
            for rows in row_blocks(logits):
                torch.logsumexp(logits[rows].to(math), dim=1, out=lse[rows])
            # torch.logsumexp gives +inf for a row holding a +inf logit, where cross_entropy's log_softmax
            # gives NaN (inf - inf), as the scan below and every other kernel do: the same here, per row.
            lse.masked_fill_(lse == float("inf"), float("nan"))
            grad = None
        else:
            scale = torch.where(valid, grad_scale.to(math), 0.0)
            for rows in row_blocks(logits):
                block = logits[rows]
                z = block.to(math)  # the block itself for fp32/fp64 logits: the grad overwrites it
                row_max = z.amax(dim=1, keepdim=True)
                sum_exp = z.sub_(row_max).exp_().sum(dim=1, keepdim=True)
                lse[rows] = (row_max + sum_exp.log()).squeeze(1)
                z.mul_(scale[rows].unsqueeze(1) / sum_exp)
                _subtract_at_target_(z, index[rows], scale[rows])
                if z is not block:
                    block.copy_(z)
            grad = logits
        loss = torch.where(valid, lse - target_logit, 0.0)
        return loss, lse, grad

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):
        math = math_dtype(logits.dtype)
        valid = target != ignore_index
        index = _target_onehot_index(target, valid)
        scale = torch.where(valid, grad_scale.to(math), 0.0)
        lse = lse.to(math)
        for rows in row_blocks(logits):
            block = logits[rows]
            z = block.to(math)
            z.sub_(lse[rows].unsqueeze(1)).exp_().mul_(scale[rows].unsqueeze(1))
            _subtract_at_target_(z, index[rows], scale[rows])
            if z is not block:
                block.copy_(z)
        return logits

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:
        stats = self._block_row_stats(logits, target, cfg, vocab_offset)
        return stats if into is None else merge_partial_stats(into, stats)

    def _block_row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int) -> PartialRowStats:
        math = math_dtype(logits.dtype)
        n_rows, vocab = logits.shape
        local = target - vocab_offset
        in_shard = (local >= 0) & (local < vocab)
        # Capping is elementwise, so the target's z comes from its logit alone.
        target_u = logits.gather(1, _target_onehot_index(local, in_shard)).to(math)
        target_z = torch.where(in_shard, capped_scaled(target_u, cfg).squeeze(1), 0.0)

        def per_row(dtype: torch.dtype = math) -> torch.Tensor:
            return torch.empty(n_rows, dtype=dtype, device=logits.device)

        stats = PartialRowStats(row_max=per_row(), sum_exp=per_row(), target_z=target_z)
        if needs_sum_exp_dz(cfg):
            stats.sum_exp_dz = per_row()
        if needs_weighted_sum_z(cfg):
            stats.weighted_sum_z = per_row()
            class_weight = None if cfg.class_weight is None else _shard_weight(cfg, vocab, vocab_offset, math)
        if needs_argmax(cfg):
            stats.argmax = per_row(torch.int64)
        if needs_logit_stats(cfg):
            stats.row_min, stats.sum_z = per_row(), per_row()
        for rows in row_blocks(logits):
            # Never written: the logits may be kept for backward.
            z = capped_scaled(logits[rows].to(math), cfg)
            # torch.max returns the first maximal index, as the GPU kernels do.
            row_max, argmax = z.max(dim=1)
            stats.row_max[rows] = row_max
            shifted = torch.sub(z, row_max.unsqueeze(1))
            exp = shifted.exp_() if stats.sum_exp_dz is None else torch.exp(shifted)
            stats.sum_exp[rows] = exp.sum(1)
            if stats.sum_exp_dz is not None:
                stats.sum_exp_dz[rows] = exp.mul_(shifted).sum(1)
            if stats.weighted_sum_z is not None:
                # Not z @ class_weight: BLAS's matrix-vector kernels round differently for different row
                # counts, so the answer would depend on the block size (a product and a row sum do not;
                # exp's storage is free by now).
                weighted = z if class_weight is None else torch.mul(z, class_weight, out=exp)
                stats.weighted_sum_z[rows] = weighted.sum(1)
            if stats.argmax is not None:
                stats.argmax[rows] = argmax + vocab_offset
            if stats.row_min is not None:
                stats.row_min[rows] = z.amin(dim=1)
                stats.sum_z[rows] = z.sum(dim=1)
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):
        math = math_dtype(logits.dtype)
        vocab = logits.shape[1]
        local = target - vocab_offset
        in_shard = (local >= 0) & (local < vocab)
        index = _target_onehot_index(local, in_shard)
        d = torch.where(in_shard, coeffs.d, 0.0).to(math)
        lse = lse.to(math)
        class_weight = None
        if coeffs.e is not None and cfg.class_weight is not None:
            class_weight = _shard_weight(cfg, vocab, vocab_offset, math).unsqueeze(0)
        for rows in row_blocks(logits):
            block = logits[rows]
            z = capped_scaled(block.to(math), cfg)
            log_p = torch.sub(z, lse[rows].unsqueeze(1))
            if coeffs.h is None:
                grad = log_p.exp_().mul_(coeffs.a[rows].unsqueeze(1))
            else:
                # p * (a - h (z - lse)), with one more temporary
                grad = torch.exp(log_p).mul_(log_p.mul_(-coeffs.h[rows].unsqueeze(1)).add_(coeffs.a[rows].unsqueeze(1)))
            _subtract_at_target_(grad, index[rows], d[rows])
            if coeffs.e is not None:
                e = coeffs.e[rows].unsqueeze(1).to(math)
                if class_weight is None:
                    grad.sub_(e)
                else:
                    grad.addcmul_(e, class_weight, value=-1.0)
            # z may be the block itself (fp32, no cap, T = 1): it is read for the last time above.
            block.copy_(chain_through_cap(grad, z, cfg))
        return logits

    def scale_(self, tensor, scale):
        # On the CPU reading the scale costs nothing, and loss.backward()'s scale of exactly 1
        # then saves a pass over the V x H gradient.
        if tensor.device.type == "cpu" and bool(scale == 1):
            return tensor
        return tensor.mul_(scale)  # scale stays fp32: no rounding of grad_output to bf16

    def matmul_(self, a, b, out, accumulate) -> None:
        torch_matmul_(a, b, out, accumulate)

    def count_tokens(self, target, ignore_index, dtype, vocab):
        return torch_count_tokens(target, ignore_index, dtype, vocab)

    def add_column_sums_(self, acc, a) -> None:
        if a.device.type != "cpu" or a.dtype == acc.dtype:
            acc += a.sum(0, dtype=acc.dtype)
            return
        # By row blocks: PyTorch's CPU sum of a 16-bit tensor into fp32 first converts all of it, an fp32
        # copy twice the chunk's size beside it (390 MiB for a 195 MiB bf16 chunk); a block's copy stays
        # within CPU_BLOCK_BYTES.
        rows = max(1, CPU_BLOCK_BYTES // max(1, a.shape[1] * acc.element_size()))
        for start in range(0, a.shape[0], rows):
            acc += a[start:start + rows].sum(0, dtype=acc.dtype)

    def accumulate_fp32_(self, acc, a, b) -> None:
        if acc.is_cuda and a.dtype == b.dtype:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # cuBLAS: 16-bit operands, fp32 sums
            return
        # Elsewhere each product is taken in fp32, its operands upcast a block at a time: a 16-bit product would
        # round each block before the fp32 accumulator sees it, and the CPU's 16-bit GEMM is emulated (0.25 s in
        # fp32 against 30 s in bf16 for 1024 x 4096 x 1024 on one core of a 2-core EPYC).
        inner = max(1, CPU_BLOCK_BYTES // max(1, 4 * b.shape[1]))
        for start in range(0, acc.shape[0], _FP32_ACCUMULATE_ROWS):
            rows = slice(start, start + _FP32_ACCUMULATE_ROWS)
            for first in range(0, b.shape[0], inner):
                block = slice(first, first + inner)
                acc[rows].addmm_(a[rows, block].float(), b[block].float())


def _subtract_at_target_(grad: torch.Tensor, index: torch.Tensor, amount: torch.Tensor) -> None:
    """grad[r, index[r]] -= amount[r] (amount 0 on rows without a target here)."""
    grad.scatter_add_(1, index, -amount.to(grad.dtype).unsqueeze(1))


def capped_scaled(u: torch.Tensor, cfg: LCEConfig) -> torch.Tensor:
    """z = cap(u) / temperature (a new tensor, unless there is neither cap nor temperature)."""
    if cfg.softcap is not None:
        u = torch.tanh(u / cfg.softcap).mul_(cfg.softcap)
    if cfg.temperature != 1.0:
        u = u / cfg.temperature if cfg.softcap is None else u.div_(cfg.temperature)
    return u


def chain_through_cap(grad_z: torch.Tensor, z: torch.Tensor, cfg: LCEConfig) -> torch.Tensor:
    """d/du from d/dz, in place in grad_z: cap'(u) = 1 - tanh(u/softcap)^2 with
    tanh(u/softcap) = z*T/softcap."""
    if cfg.softcap is not None:
        tanh = z * (cfg.temperature / cfg.softcap)
        grad_z.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    if cfg.temperature != 1.0:
        grad_z.div_(cfg.temperature)
    return grad_z


def _shard_weight(cfg: LCEConfig, vocab: int, vocab_offset: int, dtype: torch.dtype) -> torch.Tensor:
    assert cfg.class_weight is not None
    return cfg.class_weight[vocab_offset:vocab_offset + vocab].to(dtype)
