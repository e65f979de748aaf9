"""Launchers of the warp-specialised persistent Hopper GEMM (ws_gemm_kernels.py).

:func:`ws_matmul` computes ``a @ b`` for 2-D bf16/fp16 operands that each lie row- or column-major
(unit stride in one dimension), so the three products of the loss are plain calls on views:

    logits      = ws_matmul(x, w.T)      x [N, H], w [V, H]
    grad_hidden = ws_matmul(g, w)        g [N, V]
    grad_weight = ws_matmul(g.T, x)

TMA needs every operand's leading stride and base address to be multiples of 16 bytes: a logits or
gradient buffer with an odd V gets a padded row stride (:func:`padded_empty`). Inputs that break
the rule raise ValueError rather than silently copying; callers fall back to cuBLAS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton

from flce.backends.cuda.hardware import describe_device, is_hopper, multiprocessors
from flce.config import LCEConfig
from flce.gradients import gradient_is_row_scaled_softmax
from flce.semantics import PartialRowStats

_GL_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class WsGemmConfig:
    """Tile shape and launch of the warp-specialised GEMM.

    block_m rows per tile are split between two consumer warpgroups (block_m / 2 rows each, a
    [block_m / 2, block_n] fp32 accumulator in registers: 128 registers a thread at 128 x 256).
    Shared memory: stages x (block_m + block_n) x block_k x 2 bytes of operand ring plus the
    block_m x block_n output tile (3 x 48 KiB + 64 KiB = 208 KiB at the default)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 16  # 16 row blocks a group: 7 of 9 products faster than 8 (H200, docs/design-notes.md)
    stages: int = 3
    consumer_regs: int = 232  # per thread, each consumer warpgroup (setmaxnreg)
    load_regs: int = 40  # per thread, the load warp's warpgroup
    # The kernel's register cap at entry (ptxas compiles every partition within it, and a wgmma of
    # a 64 x 256 fp32 accumulator needs >= 154); the first consumer warpgroup gets what the others
    # leave of 3 warpgroups x max_regs: 168 x 3 = 232 + 232 + 40.
    max_regs: int = 168


DEFAULT_CONFIG = WsGemmConfig()
_STATS_CHUNKS = 16  # ws_gemm_kernels.STATS_CHUNKS: K steps a tile needs for interleaved statistics
# The statistics chunks run beside a live accumulator: the load warp gives up 16 more registers.
ROW_STATS_CONFIG = WsGemmConfig(consumer_regs=240, load_regs=24)


def _tma_ready(t: torch.Tensor) -> bool:
    """Row-major with a 16-byte aligned row stride and base: what a TMA descriptor accepts."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def ws_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ws_matmul(a, b) runs here: a Hopper GPU (sm_90), bf16/fp16 operands of one dtype,
    each row- or column-major with 16-byte aligned leading strides."""
    if not (a.is_cuda and b.is_cuda) or not is_hopper(describe_device(a.device)):
        return False
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    return all(_tma_ready(t) or _tma_ready(t.T) for t in (a, b))


def padded_empty(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor whose row stride is rounded up to 16 bytes (a view of a
    wider buffer when cols * element size is not a multiple of 16), so TMA can store into it."""
    per_16 = 16 // torch.empty((), dtype=dtype).element_size()
    stride = triton.cdiv(cols, per_16) * per_16
    return torch.empty(rows, stride, dtype=dtype, device=device)[:, :cols]


@cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> object:
    """The shared-memory layout of a TMA block: the same few a process, built once (building one is a good part
    of a descriptor's host time, and a short call launches three descriptors a chunk)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, block: list[int]) -> object:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def _launch(a: torch.Tensor, b: torch.Tensor, c_desc: object, stats_ptrs: tuple, config: WsGemmConfig,
            row_stats: bool, store_tile: bool = False, accumulate: bool = False, inv_temperature: float = 1.0,
            sum_exp_dz: bool = False, argmax: bool = False, sum_z: bool = False, softcap: float | None = None,
            class_weight: bool = False, bias: bool = False, store_exp: bool = False, against: bool = False) -> None:
    """One launch; stats_ptrs: the kernel's 12 arguments from part_max_ptr to stride_against."""
    from flce.backends.cuda.ws_gemm_kernels import _ws_gemm_kernel

    cfg = config
    (m, k), n = a.shape, b.shape[1]
    a_mmajor = not _tma_ready(a)  # stored as a.T [K, M], row-major
    b_kmajor = not _tma_ready(b)  # stored as b.T [N, K], row-major
    a_desc = _descriptor(a.T, [cfg.block_k, cfg.block_m]) if a_mmajor else _descriptor(a, [cfg.block_m, cfg.block_k])
    b_desc = _descriptor(b.T, [cfg.block_n, cfg.block_k]) if b_kmajor else _descriptor(b, [cfg.block_k, cfg.block_n])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, multiprocessors(a.device))
    _ws_gemm_kernel[(programs,)](
        a_desc, b_desc, c_desc, m, n, k, *stats_ptrs, _LOG2E * inv_temperature, inv_temperature, softcap or 1.0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, A_MMAJOR=a_mmajor, B_KMAJOR=b_kmajor, GROUP_M=cfg.group_m,
        NUM_STAGES=cfg.stages, ROW_STATS=row_stats,
        INTERLEAVE=row_stats and triton.cdiv(k, cfg.block_k) >= _STATS_CHUNKS,
        STORE_TILE=store_tile, ACCUMULATE=accumulate, SUM_EXP_DZ=sum_exp_dz, ARGMAX=argmax, SUM_Z=sum_z,
        SOFTCAP=softcap is not None, CLASS_WEIGHT=class_weight, HAS_BIAS=bias, STORE_EXP=store_exp, AGAINST=against,
        CONSUMER_REGS=cfg.consumer_regs, LOAD_REGS=cfg.load_regs,
        num_warps=4, maxnreg=cfg.max_regs,
    )


def ws_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
              config: WsGemmConfig = DEFAULT_CONFIG, accumulate: bool = False) -> torch.Tensor:
    """``a @ b`` (fp32 accumulation, rounded once to a's dtype) into ``out`` [M, N] (row-major,
    16-byte aligned rows, a's dtype; a padded_empty when None), for a [M, K] and b [K, N] of one
    dtype, each row- or column-major. ``accumulate``: out += a @ b (out read in the kernel, the sum
    taken in fp32 and rounded once, as torch.addmm does)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"ws_matmul: a {tuple(a.shape)} @ b {tuple(b.shape)}: expected [M, K] @ [K, N]")
    if not ws_supported(a, b):
        raise ValueError(f"ws_matmul: a ({a.dtype}, strides {a.stride()}, {a.device}) and b ({b.dtype}, strides "
                         f"{b.stride()}): expected bf16/fp16 CUDA tensors of one dtype on an sm_90 GPU, each row- "
                         "or column-major with 16-byte aligned leading strides")
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        if accumulate:
            raise ValueError("ws_matmul: accumulate=True needs the out tensor to add into")
        out = padded_empty(m, n, a.dtype, a.device)
    if out.shape != (m, n) or not _tma_ready(out) or out.dtype != a.dtype:
        raise ValueError(f"ws_matmul: out {tuple(out.shape)} {out.dtype} strides {out.stride()}: expected "
                         f"[{m}, {n}] row-major {a.dtype} with 16-byte aligned rows")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    c_desc = _descriptor(out, [config.block_m // 2, config.block_n])
    _launch(a, b, c_desc, (out,) * 11 + (0,), config, row_stats=False, accumulate=accumulate)
    return out


def _row_stats(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, cfg: LCEConfig,
               config: WsGemmConfig, logits_out: torch.Tensor | None, class_weight: torch.Tensor | None = None,
               exp_offset: torch.Tensor | None = None, against: torch.Tensor | None = None) -> PartialRowStats:
    """PartialRowStats of z = cap(x @ w.T + bias) / cfg.temperature (cap: cfg.softcap's, where set): the plain
    statistics, sum_exp_dz where cfg asks for the entropy, the argmax (w's row index) where it asks for token accuracy
    or predicted tokens, the sum of z for label smoothing (weighted by ``class_weight`` [V], this shard's, where
    given). With ``exp_offset`` ([N] fp32, base 2; calls whose gradient_is_row_scaled_softmax only) ``logits_out``
    gets min(exp2(y - exp_offset), ~2^64) of the base-2 logits y instead of the logits, and the statistics are taken
    relative to exp_offset (ws_stats_kernels._exp_chunk: a row past the cap sums capped values; exp_grad_ops
    recomputes it). With ``against`` (another head's [N, V] logits) sum_exp_dz is taken against them
    (engine.kernels.FusedStatsGemm).

    The GEMM's epilogue writes [cdiv(V, block_n), N] base-2 partials (a few MiB), folded in
    vocabulary order by gemm_ops.merge_splits."""
    from flce.backends.cuda.gemm_ops import allocate_stats, merge_splits

    if not ws_supported(x, w.T) or x.shape[1] != w.shape[1] or target.shape != (x.shape[0],):
        raise ValueError(f"ws_partial_row_stats: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, target "
                         f"{tuple(target.shape)}: expected x [N, H] and w [V, H] row-major bf16/fp16 on an sm_90 "
                         "GPU (16-byte aligned rows) and target [N]")
    n, vocab = x.shape[0], w.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"ws_partial_row_stats: bias {tuple(bias.shape)}: expected [{vocab}]")
    c_desc = None
    if logits_out is not None:
        if logits_out.shape != (n, vocab) or not _tma_ready(logits_out) or logits_out.dtype != x.dtype:
            raise ValueError(f"ws_partial_row_stats: logits_out {tuple(logits_out.shape)} {logits_out.dtype} strides "
                             f"{logits_out.stride()}: expected [{n}, {vocab}] row-major {x.dtype} with 16-byte "
                             "aligned rows")
        c_desc = _descriptor(logits_out, [config.block_m // 2, config.block_n])
    stats = allocate_stats(n, vocab, cfg, x.device, against, exp_offset, "ws_partial_row_stats")
    stats.target_z.zero_()  # the kernel writes the rows whose target it finds
    if n == 0:
        return stats
    tiles_n = triton.cdiv(vocab, config.block_n)
    part_max = torch.empty(tiles_n, n, dtype=torch.float32, device=x.device)
    part_sum = torch.empty_like(part_max)
    part_sum_dz = torch.empty_like(part_max) if stats.sum_exp_dz is not None else part_sum
    part_argmax = torch.empty_like(part_max, dtype=torch.int64) if stats.argmax is not None else part_sum
    part_sum_y = torch.empty_like(part_max) if stats.weighted_sum_z is not None else part_sum
    # Class weights only weight label smoothing's sum (the target's weight is applied per row outside).
    weight = None
    if class_weight is not None and stats.weighted_sum_z is not None:
        weight = class_weight.float().contiguous()
    bias = bias.contiguous() if bias is not None else None
    if exp_offset is not None and (c_desc is None or not gradient_is_row_scaled_softmax(cfg)
                                   or exp_offset.shape != (n,) or exp_offset.dtype != torch.float32
                                   or not exp_offset.is_contiguous()):
        raise ValueError("ws_partial_row_stats: exp_offset needs logits_out, a loss whose gradient is a row multiple "
                         "of softmax - onehot and a contiguous [N] fp32 tensor")
    unused = part_sum
    _launch(x, w.T, c_desc, (part_max, part_sum, part_sum_dz, part_argmax, part_sum_y, target.long().contiguous(),
                             stats.target_z, weight if weight is not None else unused,
                             bias if bias is not None else unused, exp_offset if exp_offset is not None else unused,
                             against if against is not None else unused,
                             against.stride(0) if against is not None else 0),
            config, row_stats=True, store_tile=c_desc is not None and exp_offset is None,
            store_exp=exp_offset is not None, inv_temperature=1.0 / cfg.temperature,
            sum_exp_dz=stats.sum_exp_dz is not None, argmax=stats.argmax is not None,
            sum_z=stats.weighted_sum_z is not None, softcap=cfg.softcap, class_weight=weight is not None,
            bias=bias is not None, against=against is not None)
    merge_splits(stats, part_max, part_sum, part_sum_dz, part_sum_y, part_argmax)
    return stats


def ws_partial_row_stats(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_offset: int,
                         cfg: LCEConfig, logits_out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         config: WsGemmConfig = ROW_STATS_CONFIG, exp_offset: torch.Tensor | None = None,
                         against: torch.Tensor | None = None) -> PartialRowStats:
    """gemm_row_stats's PartialRowStats (every statistic and option of it: bias, softcap, temperature, the
    entropy's sum, the argmax, label smoothing's sum with or without class weights) for 16-bit inputs with
    16-byte aligned rows on an sm_90 GPU (the kernel choice checks that before it asks): this shard's
    (vocab_offset..; ``bias`` and cfg's class weights sliced to it) statistics, target_z 0 where the
    target is in another shard or ignored; the logits written into ``logits_out`` when given (with
    ``exp_offset``: exponentials instead, see _row_stats; ``against``: sum_exp_dz against another head's logits)."""
    local = target - vocab_offset if vocab_offset else target
    vocab = weight.shape[0]
    class_weight = None if cfg.class_weight is None else cfg.class_weight[vocab_offset:vocab_offset + vocab]
    stats = _row_stats(hidden, weight, bias, local, cfg, config, logits_out, class_weight, exp_offset, against)
    if vocab_offset and stats.argmax is not None:
        stats.argmax += vocab_offset  # a global class id, as gemm_row_stats's
    return stats
