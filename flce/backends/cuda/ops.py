"""Launchers for the CUDA kernels: grids, block sizes, strides.

:class:`TritonChunkKernels` implements flce.engine.kernels.RowKernels and the capabilities
(FusedStatsGemm, FusedGradGemm: gemm_ops.py and ws_gemm_ops.py launch their kernels; KeptExponentials:
exp_grad_ops.py); the plain GEMMs around the row kernels stay in cuBLAS (torch.mm).
"""

from __future__ import annotations

import logging

import torch
import triton
from triton.runtime.errors import PTXASError

from flce.backends.cuda import kernels
from flce.backends.cuda.exp_grad_ops import (
    exp_offsets,
    exponentials_from_logits_,
    finish_exp_rows,
    redo_exp_rows,
    scale_rows,
)
from flce.backends.cuda.gemm_ops import GemmConfig, default_gemm_config, gemm_grad, gemm_row_stats
from flce.backends.cuda.plan import MAX_BLOCK_V, WARP_SPECIALIZED, LaunchParams, fallback_scan_block
from flce.backends.cuda.ws_gemm_ops import ws_matmul, ws_matmul_supported, ws_partial_row_stats, ws_stats_eligible
from flce.config import LCEConfig
from flce.engine.all_rows import scan_vocab_blocks
from flce.engine.plans import CUBLAS
from flce.engine.rows import torch_matmul_
from flce.semantics import GradCoefficients, PartialRowStats, RowStats

_SCALE_BLOCK = 8192
# Column blocks of one row per program of the gradient pass (plain_grad_): short programs, so the
# last wave of a chunk's rows does not leave SMs idle. H100, one 1536 x 151936 chunk: 0.362 ms with a
# row a program, 0.338 ms at 8 blocks; neutral (within 1%) at 2048 x 128256 and V = 32000.
GRAD_BLOCKS_PER_PROGRAM = 8
# Rows of an fp32 gradient accumulator updated per GEMM when cuBLAS cannot write fp32 from bf16.
_FP32_ACCUMULATE_ROWS = 8192


def launch_params(vocab: int, tuned: LaunchParams | None = None) -> LaunchParams:
    widest = triton.next_power_of_2(max(vocab, 16))
    if tuned is not None:
        return LaunchParams(block_v=min(tuned.block_v, widest), num_warps=tuned.num_warps)
    block_v = min(MAX_BLOCK_V, widest)
    return LaunchParams(block_v=block_v, num_warps=8 if block_v >= 2048 else 4)


def _scale_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() else 0


_log = logging.getLogger("flce")
# What TritonChunkKernels._ws_row_stats returns where the warp-specialised GEMM did not run.
_NOT_TAKEN = object()
# (kernel, device, dtype, GemmConfig) whose fused kernel failed to compile: served by the fallback.
_failed_gemm_configs: set[tuple] = set()


class TritonChunkKernels:
    """The chunk kernels of the CUDA backend (also run by the Triton interpreter on CPU tensors).
    ``launch``: tuned block size and warps, else a heuristic per launch; ``gemm``: tuned tiles of
    the fused GEMM, else :func:`default_gemm_config`; ``stats_kernel`` / ``logits_kernel``: the fused
    statistics GEMM's kernel where it takes statistics only / where it also writes the logits,
    "warp_specialized" (ws_gemm_ops, where it applies) or "triton" (gemm_ops); ``grad_gemm_kernel``:
    the gradient products' GEMM (matmul_), "warp_specialized" or "cublas"."""

    def __init__(self, launch: LaunchParams | None = None, gemm: GemmConfig | None = None,
                 stats_kernel: str = WARP_SPECIALIZED, grad_gemm_kernel: str = CUBLAS,
                 logits_kernel: str = WARP_SPECIALIZED) -> None:
        self.launch = launch
        self.gemm = gemm
        self.stats_kernel = stats_kernel
        self.logits_kernel = logits_kernel
        self.grad_gemm_kernel = grad_gemm_kernel

    def matmul_(self, a, b, out, accumulate) -> None:
        key = ("ws_gemm", a.device, a.dtype)
        if (self.grad_gemm_kernel == WARP_SPECIALIZED and key not in _failed_gemm_configs
                and ws_matmul_supported(a, b, out)):
            try:
                ws_matmul(a, b, out, accumulate=accumulate)
                return
            except (triton.CompilationError, triton.OutOfResources, PTXASError) as error:
                _failed_gemm_configs.add(key)
                _log.warning("flce: the warp-specialised GEMM failed on %s %s (%s); the gradient products use "
                             "cuBLAS instead", a.device, a.dtype, error)
        torch_matmul_(a, b, out, accumulate)

    def _ws_row_stats(self, kernel: str, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                      logits_out, **exp_offset) -> object:
        """ws_partial_row_stats where ``kernel`` is the warp-specialised one and it applies (``exp_offset``: its
        exponentials mode); _NOT_TAKEN where it does not, or where it failed to compile (said once per device
        and dtype), so the caller takes the fused Triton GEMM instead."""
        ws_key = ("ws_stats", hidden.device, hidden.dtype)
        if (kernel == WARP_SPECIALIZED and ws_key not in _failed_gemm_configs
                and ws_stats_eligible(hidden, weight, bias, cfg, logits_out)):
            # Hopper: the warp-specialised Gluon GEMM, whose epilogue computes every statistic and option
            # (plain 0.94-1.02x one cuBLAS GEMM against 1.01-1.07x for gemm_row_stats, RL 0.99-1.04x against
            # 1.03-1.10x, softcap + bias 1.07x against 1.11-1.21x on the H100; docs/design-notes.md).
            try:
                return ws_partial_row_stats(hidden, weight, target, vocab_offset, cfg, logits_out, bias, **exp_offset)
            except (triton.CompilationError, triton.OutOfResources, PTXASError) as error:
                _failed_gemm_configs.add(ws_key)
                _log.warning("flce: the warp-specialised forward kernel failed on %s %s (%s); using the fused "
                             "Triton GEMM instead", hidden.device, hidden.dtype, error)
        return _NOT_TAKEN

    def gemm_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,
                       logits_out=None) -> PartialRowStats:
        kernel = self.stats_kernel if logits_out is None else self.logits_kernel
        stats = self._ws_row_stats(kernel, hidden, weight, bias, target, cfg, vocab_offset, logits_out)
        if stats is not _NOT_TAKEN:
            return stats
        config = self.gemm or default_gemm_config(hidden.device, hidden.dtype)
        key = ("stats", hidden.device, hidden.dtype, config)
        if key not in _failed_gemm_configs:
            try:
                return gemm_row_stats(hidden, weight, bias, target, cfg, vocab_offset, config, logits_out)
            except (triton.CompilationError, triton.OutOfResources) as error:
                # A GPU or Triton version the kernel does not compile for: the row-kernel path
                # computes the same statistics; say so once per configuration.
                _failed_gemm_configs.add(key)
                _log.warning("flce: the fused forward kernel failed on %s %s with %s (%s); using cuBLAS GEMMs "
                             "and row kernels instead", hidden.device, hidden.dtype, config, error)
        if logits_out is not None:
            if bias is None:
                torch.mm(hidden, weight.t(), out=logits_out)
            else:
                torch.addmm(bias, hidden, weight.t(), out=logits_out)
            return self.row_stats(logits_out, target, cfg, vocab_offset)
        block = fallback_scan_block(target.shape[0], hidden.element_size())
        return scan_vocab_blocks(self, hidden, weight, bias, target, cfg, vocab_offset, block)

    def gemm_exp_grad(self, hidden, weight, target, ignore_index: int, grad_scale, exp_out):
        offsets = exp_offsets(hidden, weight, target, ignore_index)
        cfg = LCEConfig(ignore_index=ignore_index)
        partial = self._ws_row_stats(self.logits_kernel, hidden, weight, None, target, cfg, 0, exp_out,
                                     exp_offset=offsets)
        if partial is _NOT_TAKEN:
            # The logits from the other forward paths, then one pass turns them into the exponentials.
            partial = self.gemm_row_stats(hidden, weight, None, target, cfg, 0, exp_out)
            exponentials_from_logits_(exp_out, offsets)
        stats = RowStats.from_partial(partial)
        row_scale, redo_rows, redo_count = finish_exp_rows(exp_out, target, ignore_index, stats.lse, stats.target_z,
                                                           offsets, grad_scale)
        redo_exp_rows(hidden, weight, target, redo_rows, redo_count, exp_out)
        return stats, row_scale

    def scale_rows(self, src, scale, out):
        return scale_rows(src, scale, out)

    def gemm_grad(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int, lse,
                  coeffs: GradCoefficients):
        config = self.gemm or default_gemm_config(hidden.device, hidden.dtype)
        key = ("grad", hidden.device, hidden.dtype, config)
        if key not in _failed_gemm_configs:
            try:
                return gemm_grad(hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs, config)
            except (triton.CompilationError, triton.OutOfResources) as error:
                _failed_gemm_configs.add(key)
                _log.warning("flce: the fused gradient kernel failed on %s %s with %s (%s); using cuBLAS GEMMs "
                             "and row kernels instead", hidden.device, hidden.dtype, config, error)
        logits = torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())
        return self.full_grad_(logits, target, cfg, vocab_offset, lse, coeffs)

    def plain_loss(self, logits, target, ignore_index, grad_scale):
        n, vocab = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        if n == 0:
            return loss, lse, logits if grad_scale is not None else None
        p = launch_params(vocab, self.launch)
        scale = grad_scale if grad_scale is not None else loss
        kernels._plain_forward_kernel[(n,)](
            logits, logits.stride(0), target, scale, _scale_stride(scale), loss, lse, vocab, ignore_index,
            WRITE_GRAD=grad_scale is not None, BLOCK_V=p.block_v, num_warps=p.num_warps,
        )
        return loss, lse, logits if grad_scale is not None else None

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):
        n, vocab = logits.shape
        if n:
            p = launch_params(vocab, self.launch)
            span = p.block_v * GRAD_BLOCKS_PER_PROGRAM
            kernels._plain_grad_kernel[(n, triton.cdiv(vocab, span))](
                logits, logits.stride(0), target, lse, grad_scale, _scale_stride(grad_scale), vocab, ignore_index,
                SPAN=span, BLOCK_V=p.block_v, num_warps=p.num_warps,
            )
        return logits

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:
        n, vocab = logits.shape
        stats = into if into is not None else PartialRowStats.allocate(n, cfg, logits.device)
        if n == 0:
            return stats
        p = launch_params(vocab, self.launch)
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
            BLOCK_V=p.block_v, num_warps=p.num_warps,
        )
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):
        n, vocab = logits.shape
        if n == 0:
            return logits
        p = launch_params(vocab, self.launch)
        weight = _shard_class_weight(cfg, vocab_offset, vocab)
        a, d = coeffs.a.contiguous(), coeffs.d.contiguous()
        h = coeffs.h.contiguous() if coeffs.h is not None else a
        e = coeffs.e.contiguous() if coeffs.e is not None else a
        kernels._full_grad_kernel[(n,)](
            logits, logits.stride(0), target, weight if weight is not None else a, lse, a, h, d, e,
            vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_CLASS_WEIGHT=weight is not None,
            HAS_H=coeffs.h is not None, HAS_E=coeffs.e is not None,
            BLOCK_V=p.block_v, num_warps=p.num_warps,
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
            # V = 151936, H100), beside the chunk's logits (docs/design-notes.md, "Memory").
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


def _shard_class_weight(cfg: LCEConfig, vocab_offset: int, vocab: int) -> torch.Tensor | None:
    if cfg.class_weight is None:
        return None
    return cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()
