"""Launchers of the row kernels (kernels.py): one program per token row (or row block) over a chunk's logits
in the compute dtype, written by a plain GEMM. Every kernel family's path that is not fused into a GEMM ends
here (engine.kernels.RowKernels; the cuBLAS family's roles)."""

from __future__ import annotations

import torch
import triton

from flce.backends.cuda import kernels
from flce.backends.cuda.configs import LaunchParams
from flce.config import LCEConfig
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats

_K = "flce.backends.cuda."
# The row kernels by the names the record prints (cuda/steps.py).
PLAIN_FORWARD = _K + "kernels._plain_forward_kernel"
PLAIN_GRAD = _K + "kernels._plain_grad_kernel"
ROW_STATS = _K + "kernels._row_stats_kernel"
FULL_GRAD = _K + "kernels._full_grad_kernel"
SCALE = _K + "kernels._scale_kernel"

_SCALE_BLOCK = 8192
# Column blocks of one row per program of the gradient pass (plain_grad_): short programs, so the
# last wave of a chunk's rows does not leave SMs idle. H100, one 1536 x 151936 chunk: 0.362 ms with a
# row a program, 0.338 ms at 8 blocks; neutral (within 1%) at 2048 x 128256 and V = 32000.
GRAD_BLOCKS_PER_PROGRAM = 8


def row_launch(width: int, launch: LaunchParams) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of a row kernel over rows of ``width`` columns: the chosen block, no wider than
    the row needs; the chosen warps, else 8 for blocks of 2048 columns or more and 4 below."""
    block = min(launch.block_v, triton.next_power_of_2(max(width, 16)))
    return block, launch.num_warps or (8 if block >= 2048 else 4)


def _scale_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() else 0


def cublas_logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w.T + bias by cuBLAS, in the inputs' dtype."""
    return torch.mm(x, w.t(), out=out) if bias is None else torch.addmm(bias, x, w.t(), out=out)


def shard_class_weight(cfg: LCEConfig, vocab_offset: int, vocab: int) -> torch.Tensor | None:
    """cfg's class weights of this vocabulary shard, fp32 and contiguous as the kernels read them."""
    if cfg.class_weight is None:
        return None
    return cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()


def plain_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor | None,
               launch: LaunchParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RowKernels.plain_loss."""
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if n == 0:
        return loss, lse, logits if grad_scale is not None else None
    block_v, num_warps = row_launch(vocab, launch)
    scale = grad_scale if grad_scale is not None else loss
    kernels._plain_forward_kernel[(n,)](
        logits, logits.stride(0), target, scale, _scale_stride(scale), loss, lse, vocab, ignore_index,
        WRITE_GRAD=grad_scale is not None, BLOCK_V=block_v, num_warps=num_warps,
    )
    return loss, lse, logits if grad_scale is not None else None


def plain_grad_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, lse: torch.Tensor,
                grad_scale: torch.Tensor, launch: LaunchParams) -> torch.Tensor:
    """RowKernels.plain_grad_."""
    n, vocab = logits.shape
    if n:
        block_v, num_warps = row_launch(vocab, launch)
        span = block_v * GRAD_BLOCKS_PER_PROGRAM
        kernels._plain_grad_kernel[(n, triton.cdiv(vocab, span))](
            logits, logits.stride(0), target, lse, grad_scale, _scale_stride(grad_scale), vocab, ignore_index,
            SPAN=span, BLOCK_V=block_v, num_warps=num_warps,
        )
    return logits


def row_stats(logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int, launch: LaunchParams,
              into: PartialRowStats | None = None) -> PartialRowStats:
    """RowKernels.row_stats."""
    n, vocab = logits.shape
    stats = into if into is not None else PartialRowStats.allocate(n, cfg, logits.device)
    if n == 0:
        return stats
    block_v, num_warps = row_launch(vocab, launch)
    unused = stats.row_max
    weight = shard_class_weight(cfg, vocab_offset, vocab)
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


def full_grad_(logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int, lse: torch.Tensor,
               coeffs: GradCoefficients, launch: LaunchParams) -> torch.Tensor:
    """RowKernels.full_grad_."""
    n, vocab = logits.shape
    if n == 0:
        return logits
    block_v, num_warps = row_launch(vocab, launch)
    weight = shard_class_weight(cfg, vocab_offset, vocab)
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


def scale_(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """RowKernels.scale_."""
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor.mul_(scale)  # scale stays fp32: no rounding of grad_output to bf16
    kernels._scale_kernel[(triton.cdiv(tensor.numel(), _SCALE_BLOCK),)](
        tensor, scale, tensor.numel(), BLOCK=_SCALE_BLOCK, num_warps=8)
    return tensor


def cublas_row_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                     cfg: LCEConfig, vocab_offset: int, logits_out: torch.Tensor | None, launch: LaunchParams,
                     scan_block: int) -> PartialRowStats:
    """The statistics from cuBLAS logits and the row kernel: into ``logits_out`` where given, else block by block
    (``scan_block`` columns), each block's statistics merged into the running ones."""
    if logits_out is not None:
        cublas_logits(hidden, weight, bias, logits_out)
        return row_stats(logits_out, target, cfg, vocab_offset, launch)
    block = min(scan_block, weight.shape[0])
    buffer = hidden.new_empty(hidden.shape[0] * block)
    running = None
    for start in range(0, weight.shape[0], block):
        w = weight[start:start + block]
        logits = cublas_logits(hidden, w, None if bias is None else bias[start:start + block],
                               buffer[:hidden.shape[0] * w.shape[0]].view(hidden.shape[0], w.shape[0]))
        running = row_stats(logits, target, cfg, vocab_offset + start, launch, into=running)
    assert running is not None
    return running
