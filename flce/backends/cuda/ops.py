"""Launchers for the CUDA kernels: grids, block sizes, strides.

:class:`TritonChunkKernels` implements flce.engine.kernels.RowKernels and the capabilities
(FusedStatsGemm, FusedGradGemm: gemm_ops.py and ws_gemm_ops.py launch their kernels; KeptExponentials:
exp_grad_ops.py); the plain GEMMs around the row kernels stay in cuBLAS (torch.mm). It launches the kernel
each role is given by the call's kernel choice (configs.KernelChoice, made in choice.py) and decides nothing
about eligibility; a kernel that fails to compile falls back through fallback.py.
"""

from __future__ import annotations

import torch
import triton

from flce.backends.cuda import kernels
from flce.backends.cuda.configs import (
    TRITON_STATS_GEMM,
    WARP_SPECIALIZED,
    WS_GEMM,
    WS_PRODUCTS,
    WS_STATISTICS,
    KernelChoice,
    LaunchParams,
)
from flce.backends.cuda.exp_grad_ops import (
    exp_offsets,
    exponentials_from_logits_,
    finish_exp_rows,
    redo_exp_rows,
    scale_rows,
)
from flce.backends.cuda.fallback import launch_or_fall_back
from flce.backends.cuda.gemm_ops import gemm_grad, gemm_row_stats
from flce.backends.cuda.target_ops import count_tokens
from flce.backends.cuda.ws_gemm_ops import ws_matmul, ws_partial_row_stats
from flce.config import LCEConfig
from flce.engine.rows import torch_matmul_
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats

_SCALE_BLOCK = 8192
# Column blocks of one row per program of the gradient pass (plain_grad_): short programs, so the
# last wave of a chunk's rows does not leave SMs idle. H100, one 1536 x 151936 chunk: 0.362 ms with a
# row a program, 0.338 ms at 8 blocks; neutral (within 1%) at 2048 x 128256 and V = 32000.
GRAD_BLOCKS_PER_PROGRAM = 8
# Rows of an fp32 gradient accumulator updated per GEMM when cuBLAS cannot write fp32 from bf16.
_FP32_ACCUMULATE_ROWS = 8192


def row_launch(width: int, launch: LaunchParams) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of a row kernel over rows of ``width`` columns: the chosen block, no wider than
    the row needs; the chosen warps, else 8 for blocks of 2048 columns or more and 4 below."""
    block = min(launch.block_v, triton.next_power_of_2(max(width, 16)))
    return block, launch.num_warps or (8 if block >= 2048 else 4)


def _scale_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() else 0


class TritonChunkKernels:
    """The chunk kernels of the CUDA backend (also run by the Triton interpreter on CPU tensors), launched as
    ``choice`` (cuda/choice.py) says: each role's kernel, the row kernels' blocks, the Triton GEMMs' tiles.
    A kernel that fails to compile falls back through cuda/fallback.py, once per device and dtype."""

    def __init__(self, choice: KernelChoice) -> None:
        self.choice = choice

    def count_tokens(self, target, ignore_index, dtype, vocab):
        return count_tokens(target, ignore_index, dtype, vocab)

    def matmul_(self, a, b, out, accumulate) -> None:
        if self.choice.products == WARP_SPECIALIZED:
            launch_or_fall_back(WS_GEMM, WS_PRODUCTS, a, lambda: ws_matmul(a, b, out, accumulate=accumulate),
                                lambda: torch_matmul_(a, b, out, accumulate), "cuBLAS for the gradient products")
            return
        torch_matmul_(a, b, out, accumulate)

    def gemm_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                       logits_out=None) -> PartialRowStats:
        kernel = self.choice.stats if logits_out is None else self.choice.logits
        if kernel != WARP_SPECIALIZED:
            return self._triton_row_stats(hidden, weight, bias, target, cfg, vocab_offset, logits_out)
        # Hopper: the warp-specialised Gluon GEMM, whose epilogue computes every statistic and option
        # (plain 0.94-1.02x one cuBLAS GEMM against 1.01-1.07x for gemm_row_stats, RL 0.99-1.04x against
        # 1.03-1.10x, softcap + bias 1.07x against 1.11-1.21x on the H100; docs/design-notes.md).
        return launch_or_fall_back(
            WS_GEMM, WS_STATISTICS, hidden,
            lambda: ws_partial_row_stats(hidden, weight, target, vocab_offset, cfg, logits_out, bias),
            lambda: self._triton_row_stats(hidden, weight, bias, target, cfg, vocab_offset, logits_out),
            "the Triton statistics GEMM")

    def _triton_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                          logits_out) -> PartialRowStats:
        config = self.choice.gemm
        return launch_or_fall_back(
            TRITON_STATS_GEMM, config.text(), hidden,
            lambda: gemm_row_stats(hidden, weight, bias, target, cfg, vocab_offset, config, logits_out),
            lambda: self._cublas_row_stats(hidden, weight, bias, target, cfg, vocab_offset, logits_out),
            "cuBLAS GEMMs and the row kernel")

    def _cublas_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                          logits_out) -> PartialRowStats:
        """The statistics from cuBLAS logits and the row kernel: into ``logits_out`` where given, else
        block by block (``fallback_scan_block`` columns), each block's statistics merged into the running ones."""
        if logits_out is not None:
            _logits(hidden, weight, bias, logits_out)
            return self.row_stats(logits_out, target, cfg, vocab_offset)
        block = min(self.choice.fallback_scan_block, weight.shape[0])
        buffer = hidden.new_empty(hidden.shape[0] * block)
        running = None
        for start in range(0, weight.shape[0], block):
            w = weight[start:start + block]
            logits = _logits(hidden, w, None if bias is None else bias[start:start + block],
                             buffer[:hidden.shape[0] * w.shape[0]].view(hidden.shape[0], w.shape[0]))
            running = self.row_stats(logits, target, cfg, vocab_offset + start, into=running)
        assert running is not None
        return running

    def gemm_exp_grad(self, hidden, weight, target, cfg: LCEConfig, grad_scale, exp_out):
        offsets = exp_offsets(hidden, weight, target, cfg.ignore_index, cfg.temperature)

        def from_logits() -> PartialRowStats:
            # The logits from the Triton GEMM, then one pass turns them into the exponentials.
            partial = self._triton_row_stats(hidden, weight, None, target, cfg, 0, exp_out)
            exponentials_from_logits_(exp_out, offsets, cfg.temperature)
            return partial

        if self.choice.logits == WARP_SPECIALIZED:
            partial = launch_or_fall_back(
                WS_GEMM, WS_STATISTICS, hidden,
                lambda: ws_partial_row_stats(hidden, weight, target, 0, cfg, exp_out, exp_offset=offsets),
                from_logits, "the Triton statistics GEMM and a pass over its logits")
        else:
            partial = from_logits()
        stats, row_scale, redo_rows, redo_count = finish_exp_rows(exp_out, target, cfg.ignore_index, partial, offsets,
                                                                  grad_scale, cfg.temperature)
        redo_exp_rows(hidden, weight, target, redo_rows, redo_count, exp_out, stats.lse, cfg.temperature)
        return stats, row_scale

    def scale_rows(self, src, scale, out):
        return scale_rows(src, scale, out)

    def gemm_grad(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int, lse,
                  coeffs: GradCoefficients):
        config = self.choice.gemm

        def cublas_and_row_kernel() -> torch.Tensor:
            logits = _logits(hidden, weight, bias, hidden.new_empty(hidden.shape[0], weight.shape[0]))
            return self.full_grad_(logits, target, cfg, vocab_offset, lse, coeffs)

        return launch_or_fall_back(
            self.choice.grad_gemm, config.text(), hidden,
            lambda: gemm_grad(hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs, config),
            cublas_and_row_kernel, "cuBLAS GEMMs and the row kernel")

    def plain_loss(self, logits, target, ignore_index, grad_scale):
        n, vocab = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        if n == 0:
            return loss, lse, logits if grad_scale is not None else None
        block_v, num_warps = row_launch(vocab, self.choice.launch)
        scale = grad_scale if grad_scale is not None else loss
        kernels._plain_forward_kernel[(n,)](
            logits, logits.stride(0), target, scale, _scale_stride(scale), loss, lse, vocab, ignore_index,
            WRITE_GRAD=grad_scale is not None, BLOCK_V=block_v, num_warps=num_warps,
        )
        return loss, lse, logits if grad_scale is not None else None

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):
        n, vocab = logits.shape
        if n:
            block_v, num_warps = row_launch(vocab, self.choice.launch)
            span = block_v * GRAD_BLOCKS_PER_PROGRAM
            kernels._plain_grad_kernel[(n, triton.cdiv(vocab, span))](
                logits, logits.stride(0), target, lse, grad_scale, _scale_stride(grad_scale), vocab, ignore_index,
                SPAN=span, BLOCK_V=block_v, num_warps=num_warps,
            )
        return logits

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:
        n, vocab = logits.shape
        stats = into if into is not None else PartialRowStats.allocate(n, cfg, logits.device)
        if n == 0:
            return stats
        block_v, num_warps = row_launch(vocab, self.choice.launch)
        unused = stats.row_max
        weight = _shard_class_weight(cfg, vocab_offset, vocab)
        kernels._row_stats_kernel[(n,)](
            logits, logits.stride(0), target, weight if weight is not None else unused,
            stats.row_max, stats.sum_exp, stats.target_z,
            stats.sum_exp_dz if stats.sum_exp_dz is not None else unused,
            stats.weighted_sum_z if stats.weighted_sum_z is not None else unused,
            stats.argmax if stats.argmax is not None else unused,
            stats.row_min if stats.row_min is not None else unused,
            stats.sum_z if stats.sum_z is not None else unused,
            vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_CLASS_WEIGHT=weight is not None,
            NEED_SUM_EXP_DZ=stats.sum_exp_dz is not None, NEED_WEIGHTED_SUM_Z=stats.weighted_sum_z is not None,
            NEED_ARGMAX=stats.argmax is not None, NEED_LOGIT_STATS=stats.row_min is not None,
            ACCUMULATE=into is not None,
            BLOCK_V=block_v, num_warps=num_warps,
        )
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):
        n, vocab = logits.shape
        if n == 0:
            return logits
        block_v, num_warps = row_launch(vocab, self.choice.launch)
        weight = _shard_class_weight(cfg, vocab_offset, vocab)
        a, d = coeffs.a.contiguous(), coeffs.d.contiguous()
        h = coeffs.h.contiguous() if coeffs.h is not None else a
        e = coeffs.e.contiguous() if coeffs.e is not None else a
        kernels._full_grad_kernel[(n,)](
            logits, logits.stride(0), target, weight if weight is not None else a, lse, a, h, d, e,
            vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_CLASS_WEIGHT=weight is not None,
            HAS_H=coeffs.h is not None, HAS_E=coeffs.e is not None,
            BLOCK_V=block_v, num_warps=num_warps,
        )
        return logits

    def scale_(self, tensor, scale):
        if not tensor.is_contiguous() or tensor.numel() == 0:
            return tensor.mul_(scale)  # scale stays fp32: no rounding of grad_output to bf16
        kernels._scale_kernel[(triton.cdiv(tensor.numel(), _SCALE_BLOCK),)](
            tensor, scale, tensor.numel(), BLOCK=_SCALE_BLOCK, num_warps=8)
        return tensor

    def add_column_sums_(self, acc, a) -> None:
        if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
            # ones @ a into the fp32 sums, as one cuBLAS GEMM: PyTorch's column-sum reduction splits the rows
            # across thread blocks and stages their partial sums, V x 1024 bytes at 1536 rows (148 MiB at
            # V = 151936, H100), beside the chunk's logits (docs/benchmarks.md).
            row = acc.view(1, -1)
            torch.addmm(row, a.new_ones(1, a.shape[0]), a, out_dtype=torch.float32, out=row)
            return
        acc += a.sum(0, dtype=acc.dtype)

    def accumulate_fp32_(self, acc, a, b) -> None:
        if acc.is_cuda:
            # cuBLAS reads bf16/fp16 operands and accumulates into the fp32 output in place.
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        for start in range(0, acc.shape[0], _FP32_ACCUMULATE_ROWS):
            rows = slice(start, start + _FP32_ACCUMULATE_ROWS)
            acc[rows] += (a[rows] @ b).float()


def _logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w.T + bias by cuBLAS, in the inputs' dtype."""
    return torch.mm(x, w.t(), out=out) if bias is None else torch.addmm(bias, x, w.t(), out=out)


def _shard_class_weight(cfg: LCEConfig, vocab_offset: int, vocab: int) -> torch.Tensor | None:
    if cfg.class_weight is None:
        return None
    return cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()
