"""The CUDA backend's chunk kernels, as the engine calls them.

:class:`TritonChunkKernels` implements flce.engine.kernels.RowKernels (the row kernels: row_ops.py) and the
capabilities FusedStatsGemm, FusedGradGemm and KeptExponentials by handing each role's work to the kernel family
the call's choice gave it (configs.KernelChoice, made in choice.py; the families in families/), through the
fallback chain of cuda/fallback.py. It decides nothing about eligibility.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from flce.backends.cuda import row_ops
from flce.backends.cuda.exp_grad_ops import exp_offsets, finish_exp_rows, redo_exp_rows, scale_rows
from flce.backends.cuda.fallback import launch_or_fall_back
from flce.backends.cuda.families import KernelChoice
from flce.backends.cuda.families.family import CHUNK_LOGITS, EXPONENTIALS, GRADIENT, PRODUCTS, STATISTICS
from flce.backends.cuda.target_ops import count_tokens
from flce.config import LCEConfig
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats

T = TypeVar("T")
# Rows of an fp32 gradient accumulator updated per GEMM when cuBLAS cannot write fp32 from bf16.
_FP32_ACCUMULATE_ROWS = 8192


class TritonChunkKernels:
    """The chunk kernels of the CUDA backend (also run by the Triton interpreter on CPU tensors), launched as
    ``choice`` (cuda/choice.py) says: each role's family, the row kernels' blocks, the Triton GEMMs' tiles."""

    def __init__(self, choice: KernelChoice) -> None:
        self.choice = choice
        self.launch = choice.settings.launch

    def _by_family(self, role: str, on: torch.Tensor, launch: Callable[[object], T]) -> T:
        """``launch(family)`` by the role's family, or the next of its chain where a kernel fails to compile."""
        return launch_or_fall_back(self.choice.chains[role], role, self.choice.settings, on, launch)

    # ------------------------------------------------------------------ the capabilities, by family

    def gemm_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                       logits_out=None, against=None) -> PartialRowStats:
        settings = self.choice.settings
        return self._by_family(STATISTICS if logits_out is None else CHUNK_LOGITS, hidden, lambda family: (
            family.statistics(settings, hidden, weight, bias, target, cfg, vocab_offset, logits_out, against)))

    def gemm_exp_grad(self, hidden, weight, target, cfg: LCEConfig, grad_scale, exp_out):
        settings = self.choice.settings
        offsets = exp_offsets(hidden, weight, target, cfg.ignore_index, cfg.temperature)
        partial = self._by_family(EXPONENTIALS, hidden, lambda family: (
            family.exponentials(settings, hidden, weight, target, cfg, offsets, exp_out)))
        stats, row_scale, redo_rows, redo_count = finish_exp_rows(exp_out, target, cfg.ignore_index, partial, offsets,
                                                                  grad_scale, cfg.temperature)
        redo_exp_rows(hidden, weight, target, redo_rows, redo_count, exp_out, stats.lse, cfg.temperature)
        return stats, row_scale

    def gemm_grad(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int, lse,
                  coeffs: GradCoefficients):
        settings = self.choice.settings
        return self._by_family(GRADIENT, hidden, lambda family: (
            family.gradient(settings, hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs)))

    def matmul_(self, a, b, out, accumulate) -> None:
        settings = self.choice.settings
        self._by_family(PRODUCTS, a, lambda family: family.products(settings, a, b, out, accumulate))

    def scale_rows(self, src, scale, out):
        return scale_rows(src, scale, out)

    # ------------------------------------------------------------------ the row kernels

    def count_tokens(self, target, ignore_index, dtype, vocab):
        return count_tokens(target, ignore_index, dtype, vocab)

    def plain_loss(self, logits, target, ignore_index, grad_scale):
        return row_ops.plain_loss(logits, target, ignore_index, grad_scale, self.launch)

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):
        return row_ops.plain_grad_(logits, target, ignore_index, lse, grad_scale, self.launch)

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:
        return row_ops.row_stats(logits, target, cfg, vocab_offset, self.launch, into)

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):
        return row_ops.full_grad_(logits, target, cfg, vocab_offset, lse, coeffs, self.launch)

    def scale_(self, tensor, scale):
        return row_ops.scale_(tensor, scale)

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
