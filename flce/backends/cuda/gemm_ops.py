"""Launchers of the fused GEMM kernels (gemm_kernels.py): tile configuration, vocabulary splits,
tensor descriptors, the merge of per-split partial statistics, and the gradient GEMM.

The fused forward computes row statistics straight from ``x`` and ``W``: one GEMM's work, no logits
in memory. Its working memory is the ``[splits, tokens]`` partials (a few MiB), so an inference
call or the deferred schedule's forward runs over all rows in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.backends.cuda import gemm_kernels
from flce.backends.cuda.configs import GemmConfig
from flce.backends.cuda.hardware import multiprocessors
from flce.config import LCEConfig
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats, needs_argmax, needs_weighted_sum_z

# Programs per SM the split heuristic plans for: one [128, 128..256] tile program fills an SM's
# registers, and several waves amortise the last, partly empty one.
_WAVES = 8
_MAX_SPLITS = 256
# The split merge's tile: 8 rows x 256 splits a step. Few rows a program give a chunk's rows enough programs
# to fill the SMs, and many splits a step few dependent steps; H100, one chunk's partials (1536 rows x 594
# splits / 2048 x 501 / 4096 x 125): 33.3 / 29.8 / 11.5 us at 32 rows x 32 splits, 13.4 / 11.5 / 7.9 us here.
_MERGE_ROWS = 8
_MERGE_SPLITS = 256
_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def split_count(n_rows: int, vocab: int, config: GemmConfig, device: torch.device) -> int:
    """Vocabulary splits per row block: enough programs for several waves over the SMs, choosing
    among nearby counts the one whose last wave is fullest (waves x tiles per program is the time)."""
    n_tiles = triton.cdiv(vocab, config.block_n)
    if config.splits is not None:
        return min(config.splits, n_tiles)
    row_blocks = triton.cdiv(n_rows, config.block_m)
    sms = multiprocessors(device)
    wanted = max(1, min(n_tiles, _MAX_SPLITS, triton.cdiv(_WAVES * sms, row_blocks)))
    best, best_cost = wanted, None
    for splits in range(max(1, wanted // 2), min(n_tiles, _MAX_SPLITS, 2 * wanted) + 1):
        cost = triton.cdiv(row_blocks * splits, sms) * triton.cdiv(n_tiles, splits)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def gemm_row_stats(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, cfg: LCEConfig,
    vocab_offset: int, config: GemmConfig, logits_out: torch.Tensor | None = None,
    exp_offset: torch.Tensor | None = None, against: torch.Tensor | None = None,
) -> PartialRowStats:
    """Row statistics of z = cap(x @ w.T + bias) / T (semantics.PartialRowStats), without logits,
    or also writing them into ``logits_out`` [n, V] (unit column stride) when given. With ``exp_offset`` ([n] fp32,
    base 2; a loss whose gradient is a row multiple of softmax - onehot, no bias or softcap: exp_grad_ops.py)
    ``logits_out`` gets the kept exponentials instead and the statistics are taken relative to the offsets. With
    ``against`` (another head's [n, V] logits, unit column stride; no softcap) sum_exp_dz is taken against them
    (engine.kernels.FusedStatsGemm).

    x [n, H], w [V, H] (this shard; global class ids start at vocab_offset), target [n] int64."""
    if exp_offset is not None and (logits_out is None or bias is not None or cfg.softcap is not None
                                   or exp_offset.shape != (x.shape[0],) or exp_offset.dtype != torch.float32):
        raise ValueError("gemm_row_stats: exp_offset needs logits_out, no bias or softcap and an [n] fp32 tensor")
    n, hidden = x.shape
    vocab = w.shape[0]
    stats = allocate_stats(n, vocab, cfg, x.device, against, exp_offset, "gemm_row_stats")
    if n == 0:
        return stats
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    splits = split_count(n, vocab, config, x.device)
    tiles_per_split = triton.cdiv(triton.cdiv(vocab, config.block_n), splits)
    splits = triton.cdiv(triton.cdiv(vocab, config.block_n), tiles_per_split)  # no empty split

    def partial(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(splits, n, dtype=dtype, device=x.device)

    part_max, part_sum = partial(), partial()
    part_sum_dz = partial() if stats.sum_exp_dz is not None else part_sum
    part_weighted = partial() if needs_weighted_sum_z(cfg) else part_sum
    part_argmax = partial(torch.int64) if needs_argmax(cfg) else part_sum
    class_weight = None
    if cfg.class_weight is not None:
        class_weight = cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()
    block_k = min(config.block_k, max(16, triton.next_power_of_2(hidden)))
    x_arg, w_arg, use_tma = _operands(x, w, config, block_k)
    softcap = float(cfg.softcap or 1.0)
    grid = (triton.cdiv(n, config.block_m) * splits,)
    gemm_kernels._gemm_row_stats_kernel[grid](
        x_arg, w_arg, bias if bias is not None else part_max, class_weight if class_weight is not None else part_max,
        logits_out if logits_out is not None else x, logits_out.stride(0) if logits_out is not None else 0,
        exp_offset.contiguous() if exp_offset is not None else part_max,
        against if against is not None else part_max, against.stride(0) if against is not None else 0,
        part_max, part_sum, part_sum_dz, part_weighted, part_argmax,
        n, vocab, hidden, x.stride(0), w.stride(0), vocab_offset, softcap, 1.0 / cfg.temperature, tiles_per_split,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=cfg.softcap is not None, HAS_CLASS_WEIGHT=class_weight is not None,
        NEED_SUM_EXP_DZ=stats.sum_exp_dz is not None, NEED_WEIGHTED_SUM_Z=stats.weighted_sum_z is not None,
        NEED_ARGMAX=stats.argmax is not None, AGAINST=against is not None, STORE_LOGITS=logits_out is not None,
        STORE_EXP=exp_offset is not None,
        LOGITS_DTYPE=_TRITON_DTYPES[x.dtype], USE_TMA=use_tma,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
        SPLITS=splits, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
    )
    gemm_kernels._target_logit_kernel[(n,)](
        x, x.stride(0), w, w.stride(0), bias if bias is not None else part_max, target, stats.target_z,
        hidden, vocab, vocab_offset, softcap, 1.0 / cfg.temperature,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=cfg.softcap is not None,
        BLOCK_K=min(1024, max(16, triton.next_power_of_2(hidden))), num_warps=4,
    )
    merge_splits(stats, part_max, part_sum, part_sum_dz, part_weighted, part_argmax)
    return stats


def allocate_stats(n: int, vocab: int, cfg: LCEConfig, device: torch.device, against: torch.Tensor | None,
                   exp_offset: torch.Tensor | None, caller: str) -> PartialRowStats:
    """A statistics GEMM's PartialRowStats, with room for the sum an ``against`` makes (sum_exp_dz's slot:
    FusedStatsGemm). Refuses an ``against`` the epilogues cannot read: not [n, V] with unit column stride, or beside
    a softcap (the other head's logits would need it too) or kept exponentials."""
    stats = PartialRowStats.allocate(n, cfg, device)
    if against is None:
        return stats
    if against.shape != (n, vocab) or against.stride(1) != 1 or cfg.softcap is not None or exp_offset is not None:
        raise ValueError(f"{caller}: against {tuple(against.shape)} strides {against.stride()}: expected [{n}, "
                         f"{vocab}] logits with unit column stride, no softcap and no kept exponentials")
    if stats.sum_exp_dz is None:
        stats.sum_exp_dz = torch.empty_like(stats.sum_exp)
    return stats


def merge_splits(stats: PartialRowStats, part_max, part_sum, part_sum_dz=None, part_weighted=None,
                 part_argmax=None) -> None:
    """Fold the [splits, n] base-2 partials into ``stats`` (natural-log units), in vocabulary order;
    the optional partials are read where ``stats`` has the matching field (part_sum_dz: natural
    z - max * ln 2, gemm_kernels' docstring)."""
    splits, n = part_max.shape
    unused = part_max
    gemm_kernels._merge_splits_kernel[(triton.cdiv(n, _MERGE_ROWS),)](
        part_max, part_sum, part_sum_dz if part_sum_dz is not None else unused,
        part_weighted if part_weighted is not None else unused,
        part_argmax if part_argmax is not None else unused,
        stats.row_max, stats.sum_exp, stats.sum_exp_dz if stats.sum_exp_dz is not None else stats.row_max,
        stats.weighted_sum_z if stats.weighted_sum_z is not None else stats.row_max,
        stats.argmax if stats.argmax is not None else stats.row_max, n, splits,
        NEED_SUM_EXP_DZ=stats.sum_exp_dz is not None, NEED_WEIGHTED_SUM_Z=stats.weighted_sum_z is not None,
        NEED_ARGMAX=stats.argmax is not None, BLOCK=_MERGE_ROWS, SPLIT_BLOCK=_MERGE_SPLITS, num_warps=4,
    )


def gemm_grad(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, cfg: LCEConfig,
    vocab_offset: int, lse: torch.Tensor, coeffs: GradCoefficients, config: GemmConfig,
) -> torch.Tensor:
    """d loss / d u [n, V] of the logits x @ w.T + bias, computed tile by tile from the row lse and
    the per-row coefficients (gradients.grad_coefficients), in x's dtype; no logits in memory."""
    n, hidden = x.shape
    vocab = w.shape[0]
    grad = torch.empty(n, vocab, dtype=x.dtype, device=x.device)
    if n == 0 or vocab == 0:
        return grad
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    class_weight = None
    if cfg.class_weight is not None:
        class_weight = cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()
    a, d = coeffs.a.float().contiguous(), coeffs.d.float().contiguous()
    h = coeffs.h.float().contiguous() if coeffs.h is not None else a
    e = coeffs.e.float().contiguous() if coeffs.e is not None else a
    block_k = min(config.block_k, max(16, triton.next_power_of_2(hidden)))
    x_arg, w_arg, use_tma = _operands(x, w, config, block_k)
    shared = dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=cfg.softcap is not None,
                  HAS_CLASS_WEIGHT=class_weight is not None, HAS_H=coeffs.h is not None, HAS_E=coeffs.e is not None,
                  LOGITS_DTYPE=_TRITON_DTYPES[x.dtype], IEEE=x.dtype == torch.float32, BLOCK_M=config.block_m,
                  BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m, num_warps=config.num_warps)
    rows = (target, lse.float().contiguous(), a, h, d, e)
    tiles = triton.cdiv(n, config.block_m) * triton.cdiv(vocab, config.block_n)
    if use_tma and config.persistent:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # Two half-tile stores for the large tiles: the epilogue's fp32 temporaries of a whole
        # 128 x 256 tile do not fit the registers beside the accumulator.
        subtiles = 2 if config.block_m * config.block_n >= 128 * 256 else 1
        grad_desc = TensorDescriptor.from_tensor(grad, [config.block_m, config.block_n // subtiles])
        programs = min(tiles, multiprocessors(x.device))
        gemm_kernels._gemm_grad_persistent_kernel[(programs,)](
            x_arg, w_arg, grad_desc, bias if bias is not None else a, class_weight if class_weight is not None else a,
            *rows, n, vocab, hidden, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            PROGRAMS=programs, SUBTILES=subtiles, num_stages=config.num_stages, **shared,
        )
        return grad
    gemm_kernels._gemm_grad_kernel[(tiles,)](
        x_arg, w_arg, bias if bias is not None else a, class_weight if class_weight is not None else a,
        *rows, grad, grad.stride(0),
        n, vocab, hidden, x.stride(0), w.stride(0), vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
        USE_TMA=use_tma, NUM_STAGES=config.num_stages, **shared,
    )
    return grad


def _operands(x: torch.Tensor, w: torch.Tensor, config: GemmConfig, block_k: int) -> tuple:
    """(x, w) as the kernels take them: tensor descriptors where the configuration has TMA (the choice settled
    it for the GPU and the operands' alignment), else the tensors."""
    if not config.tma:
        return x, w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(x, [config.block_m, block_k]),
            TensorDescriptor.from_tensor(w, [config.block_n, block_k]), True)
