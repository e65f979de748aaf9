"""Launchers for the CUDA kernels: grids, block sizes, strides, and the chunk plan.

:class:`TritonChunkKernels` implements flce.backends.chunk_driver.ChunkKernels; the
GEMMs around it stay in cuBLAS (torch.mm), which already runs them at the floor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton

from flce.autotune import tuned_params
from flce.backends.chunk_driver import ChunkPlan, grads_in_forward_allowed, scan_vocab_blocks
from flce.backends.cuda import kernels
from flce.backends.cuda.gemm_ops import GemmConfig, default_gemm_config, gemm_grad, gemm_row_stats
from flce.backends.memory import MiB, default_logits_save_limit, logits_save_limit, saved_logits_rows
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.semantics import GradCoefficients, PartialRowStats

# Default working memory of one chunk's logits when gradients are computed. Larger chunks mean fewer
# read-modify-writes of the V x H weight gradient (one per chunk); this keeps the default call
# under 512 MiB above the gradients (2048-row chunks at V = 128256, the largest that fit).
DEFAULT_CHUNK_BUDGET = 504 * MiB
# Without gradients (evaluation, RL log-probs) nothing is accumulated across chunks: inference
# scans vocabulary blocks of all rows in this much memory, at the speed of one large GEMM.
INFERENCE_CHUNK_BUDGET = 64 * MiB
# Inference scans vocabulary blocks of all rows when blocks of at least this many columns fit the
# budget (GEMMs [tokens, H] x [H, block] run at full speed); else it falls back to token chunks.
MIN_VOCAB_BLOCK = 512
# Chunk rows are rounded down to this multiple: cuBLAS's 256-row GEMM tiles stay full.
ROW_MULTIPLE = 256
MAX_BLOCK_V = 4096
_SCALE_BLOCK = 8192
# Rows of an fp32 gradient accumulator updated per GEMM when cuBLAS cannot write fp32 from bf16.
_FP32_ACCUMULATE_ROWS = 8192


@dataclass(frozen=True)
class LaunchParams:
    block_v: int
    num_warps: int


def launch_params(vocab: int, tuned: LaunchParams | None = None) -> LaunchParams:
    widest = triton.next_power_of_2(max(vocab, 16))
    if tuned is not None:
        return LaunchParams(block_v=min(tuned.block_v, widest), num_warps=tuned.num_warps)
    block_v = min(MAX_BLOCK_V, widest)
    return LaunchParams(block_v=block_v, num_warps=8 if block_v >= 2048 else 4)


@dataclass(frozen=True)
class TunedKnobs:
    """What the autotune cache holds for this shape, each None where it holds nothing usable."""

    tokens_per_chunk: int | None = None
    launch: LaunchParams | None = None
    logits_save_limit: int | None = None
    # "fused" (gemm_row_stats) or "cublas" (GEMM + row kernels): forward_stats for forwards that keep
    # no logits, forward_logits for the schedules that turn each chunk's logits into the gradient.
    forward_stats: str | None = None
    forward_logits: str | None = None
    # "fused" (gemm_grad) or "cublas" where logits are recomputed for the gradient; default:
    # fused_grad_default.
    backward_grad: str | None = None
    # "vocab_blocks" (ChunkPlan.grad_vocab_block) or "token_chunks", and the block's columns
    grad_schedule: str | None = None
    grad_vocab_block: int | None = None
    gemm: GemmConfig | None = None


def tuned_knobs(flat: FlatInputs, variant: str) -> TunedKnobs:
    """The cached knobs for (device, "cuda", variant, dtype, H, V, tokens), validated: a file from
    another flce version may hold values this one cannot use, and those fall back to the heuristic."""
    vocab, hidden = flat.weight.shape
    params, limit = tuned_params(flat.hidden.device, "cuda", variant, flat.weight.dtype, hidden, vocab,
                                 flat.target.shape[0])
    params = params or {}

    def positive_int(name: str) -> int | None:
        value = params.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    block_v, num_warps = positive_int("block_v"), positive_int("num_warps")
    launch = None
    if block_v and num_warps and block_v & (block_v - 1) == 0 and block_v <= MAX_BLOCK_V and num_warps in (
            1, 2, 4, 8, 16, 32):
        launch = LaunchParams(block_v=block_v, num_warps=num_warps)
    def path(name: str) -> str | None:
        value = params.get(name)
        return value if value in FORWARD_PATHS else None

    return TunedKnobs(tokens_per_chunk=positive_int("tokens_per_chunk"), launch=launch,
                      logits_save_limit=limit if isinstance(limit, int) and limit >= 0 else None,
                      forward_stats=path("forward_stats"), forward_logits=path("forward_logits"),
                      backward_grad=path("backward_grad"),
                      gemm=GemmConfig.from_params(params),
                      grad_schedule=params["grad_schedule"] if params.get("grad_schedule") in GRAD_SCHEDULES else None,
                      grad_vocab_block=positive_int("grad_vocab_block"))


FORWARD_PATHS = ("fused", "cublas")
# Below this many tokens the fused forward has few row blocks to spread over the SMs and its fixed
# costs (target logits, split merge) weigh more; measured on the H200 at 4096 x 4096 x 32000 it is
# still ahead (1.070x one GEMM against 1.096x for cuBLAS and the row kernel); smaller calls are
# unmeasured and stay on cuBLAS.
FUSED_FORWARD_MIN_ROWS = 4096
GRAD_SCHEDULES = ("vocab_blocks", "token_chunks")
# In-forward gradients: budgets that leave token chunks of fewer rows than this take the vocabulary-
# block schedule, whose recomputed GEMM costs less than each small chunk's read-modify-write of the
# V x H weight gradient. Measured on the H200 (docs/benchmarks.md): 256-row chunks 1.47x / 1.71x the
# floor against 1.42x by blocks, 512-row chunks 1.23x against 1.44x.
VOCAB_BLOCK_SCHEDULE_BELOW_ROWS = 512
# Vocabulary blocks of the gradient schedule are multiples of this many columns (whole GEMM tiles;
# coarser rounding wastes budget: 1536 instead of 1920 columns at 64 MiB and 16384 tokens measured
# 1.51x instead of 1.42x the floor on the H200).
GRAD_BLOCK_MULTIPLE = 128
# Working memory the vocabulary-block schedule keeps per row besides the logits block (statistics,
# per-row coefficients, the fused forward's partials).
STATS_BYTES_PER_ROW = 64


def fused_forward_default(flat: FlatInputs) -> bool:
    """Where the cache says nothing: the fused forward on GPUs with bf16/fp16 tensor cores (sm_80+) for
    16-bit inputs of at least FUSED_FORWARD_MIN_ROWS tokens. fp32 stays on cuBLAS (its fp32 GEMM is
    exact where a Triton dot would need its slow IEEE mode), and the interpreter on the row kernels
    (tests ask for the fused path by name)."""
    x = flat.hidden
    return (x.is_cuda and flat.weight.dtype in (torch.bfloat16, torch.float16)
            and flat.target.shape[0] >= FUSED_FORWARD_MIN_ROWS and torch.cuda.get_device_capability(x.device)[0] >= 8)


def fused_grad_default(flat: FlatInputs) -> bool:
    """Where the cache says nothing: the gradient GEMM where it runs as the persistent Hopper kernel
    with TMA stores (sm_90, 16-bit, H and V multiples of 8 so that every operand and gradient row is
    16-byte aligned), which measured 1-3% faster per block than cuBLAS + the row kernel on the H200
    and 3-6% on the H100 (tools/bench_gemm_grad.py). Its 2-D grid with plain stores (other GPUs,
    unaligned rows) measured 7-20% slower, and newer GPUs are unmeasured: cuBLAS stays there."""
    x, w = flat.hidden, flat.weight
    return (x.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % 8 == 0
            and w.shape[1] % 8 == 0 and torch.cuda.get_device_capability(x.device)[0] == 9)


def plan_chunks(flat: FlatInputs, cfg: LCEConfig, training: bool, tuned: TunedKnobs = TunedKnobs()) -> ChunkPlan:
    """training: gradients follow (large chunks: fewer weight-gradient updates); else inference
    (small chunks, or vocabulary blocks of all rows)."""
    n_rows = flat.target.shape[0]
    vocab = flat.weight.shape[0]
    row_bytes = vocab * flat.weight.element_size()
    if cfg.memory_budget is not None:
        budget = cfg.memory_budget
    else:
        budget = DEFAULT_CHUNK_BUDGET if training else INFERENCE_CHUNK_BUDGET
    max_rows = max(1, budget // row_bytes)
    if training and tuned.tokens_per_chunk is not None:
        # A tuned chunk still honours an explicit memory_budget.
        tokens = tuned.tokens_per_chunk if cfg.memory_budget is None else min(tuned.tokens_per_chunk, max_rows)
    else:
        tokens = chunk_rows(n_rows, max_rows)
    vocab_block = None
    if not training and n_rows * row_bytes > budget:
        columns = budget // (max(n_rows, 1) * flat.weight.element_size())
        if columns >= MIN_VOCAB_BLOCK:
            vocab_block = columns - columns % MIN_VOCAB_BLOCK
    save_limit = logits_save_limit(tuned.logits_save_limit, cfg.memory_budget,
                                   default_logits_save_limit(flat.hidden.device))
    saved_rows = 0
    if training and not grads_in_forward_allowed(cfg):
        tokens, saved_rows = _deferred_chunks(n_rows, row_bytes, tokens, save_limit,
                                              tuned.tokens_per_chunk is None and cfg.memory_budget is not None)
    fused_stats = fused_forward_default(flat) if tuned.forward_stats is None else tuned.forward_stats == "fused"
    fused_grad = fused_grad_default(flat) if tuned.backward_grad is None else tuned.backward_grad == "fused"
    grad_vocab_block = None
    if training and n_rows:
        # A tuned schedule was measured without kept logits; where some are kept they decide.
        by_blocks = (tuned.grad_schedule == "vocab_blocks" and not saved_rows) if tuned.grad_schedule else (
            _vocab_blocks_pay(cfg, n_rows, vocab, tokens, saved_rows > 0))
        columns = vocab_block_columns(n_rows, flat.weight.element_size(), budget)
        if tuned.grad_vocab_block:  # a tuned block still honours an explicit memory_budget
            columns = tuned.grad_vocab_block if cfg.memory_budget is None else min(tuned.grad_vocab_block, columns)
        if by_blocks and columns >= MIN_VOCAB_BLOCK:
            grad_vocab_block = min(columns, vocab)
    return ChunkPlan(tokens_per_chunk=tokens, saved_rows=saved_rows, vocab_block=vocab_block,
                     fused_stats=fused_stats, fused_logits=tuned.forward_logits == "fused",
                     grad_vocab_block=grad_vocab_block,
                     fused_grad=fused_grad)


def vocab_block_columns(n_rows: int, element_size: int, budget: int) -> int:
    """Columns of the widest vocabulary block of all n_rows that fits ``budget`` bytes beside the
    rows' statistics, in whole GEMM tiles (may be 0 or exceed the vocabulary)."""
    columns = (budget - n_rows * STATS_BYTES_PER_ROW) // (max(n_rows, 1) * element_size)
    return max(0, columns - columns % GRAD_BLOCK_MULTIPLE)


def _deferred_chunks(n_rows: int, row_bytes: int, tokens: int, save_limit: int, may_shrink: bool) -> tuple[int, int]:
    """(tokens_per_chunk, saved_rows) of the deferred schedule. A budget too small for all the logits
    makes chunks of the whole budget, which leaves none of it for saved logits; with may_shrink (an
    explicit budget and no tuned chunk) default-sized chunks that keep the rest of the budget's logits
    are taken instead where the cost model says they are faster."""
    saved = saved_logits_rows(n_rows, tokens, row_bytes, row_bytes, save_limit)
    smaller = chunk_rows(n_rows, max(1, DEFAULT_CHUNK_BUDGET // row_bytes))
    if not may_shrink or saved == n_rows or smaller >= tokens:
        return tokens, saved
    smaller_saved = saved_logits_rows(n_rows, smaller, row_bytes, row_bytes, save_limit)
    if _deferred_cost(n_rows, smaller, smaller_saved) < _deferred_cost(n_rows, tokens, saved):
        return smaller, smaller_saved
    return tokens, saved


# One read-modify-write of the V x H weight gradient (4VH bytes at HBM bandwidth) costs about as much
# as recomputing this many rows of logits (2HV flops each at the tensor-core rate): 2 x 700 TFLOP/s
# / 4.8 TB/s = 290 on the H200, 2 x 600 / 3.35 = 360 on the H100. Independent of H and V.
_RMW_IN_RECOMPUTED_ROWS = 320


def _deferred_cost(n_rows: int, tokens: int, saved_rows: int) -> int:
    """Backward's extra work in recomputed rows: the rows not saved, and one weight-gradient
    read-modify-write for the saved rows (one GEMM over all of them) and per recomputed chunk."""
    recomputed = n_rows - saved_rows
    updates = (saved_rows > 0) + -(-recomputed // max(1, tokens))
    return recomputed + _RMW_IN_RECOMPUTED_ROWS * updates


def _vocab_blocks_pay(cfg: LCEConfig, n_rows: int, vocab: int, chunk: int, logits_saved: bool) -> bool:
    """The heuristic choice of the vocabulary-block schedule. In forward it trades a fourth GEMM for
    the weight gradient's read-modify-writes, worth it for small chunks only. The deferred schedule
    recomputes the logits either way (unless some are saved), so there blocks only trade a V x H
    read-modify-write per token chunk for an N x H one per block: fewer bytes when N < V."""
    if chunk >= n_rows:
        return False
    if grads_in_forward_allowed(cfg):
        return chunk < VOCAB_BLOCK_SCHEDULE_BELOW_ROWS
    return not logits_saved and n_rows < vocab


def chunk_rows(n_rows: int, max_rows: int) -> int:
    """Rows per chunk: all rows if they fit, else the largest multiple of ROW_MULTIPLE that fits
    (the tail chunk takes the rest). Measured on the H200 at 16384x2048x151936: 1536-row chunks
    49.4 ms, evenly balanced 1664-row chunks 51.4 ms (half a 256-row GEMM tile wasted per chunk)."""
    if n_rows <= max_rows:
        return max(1, n_rows)
    if max_rows >= ROW_MULTIPLE:
        return max_rows - max_rows % ROW_MULTIPLE
    return max_rows


def _scale_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() else 0


_log = logging.getLogger("flce")
# (kernel, device, dtype, GemmConfig) whose fused kernel failed to compile: served by the fallback.
_failed_gemm_configs: set[tuple] = set()


class TritonChunkKernels:
    """The chunk kernels of the CUDA backend (also run by the Triton interpreter on CPU tensors).
    ``launch``: tuned block size and warps, else a heuristic per launch; ``gemm``: tuned tiles of
    the fused GEMM, else :func:`default_gemm_config`."""

    def __init__(self, launch: LaunchParams | None = None, gemm: GemmConfig | None = None) -> None:
        self.launch = launch
        self.gemm = gemm

    def gemm_row_stats(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int,  # noqa: ANN001
                       logits_out=None) -> PartialRowStats:  # noqa: ANN001
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
        budget_columns = INFERENCE_CHUNK_BUDGET // max(1, target.shape[0] * hidden.element_size())
        block = max(MIN_VOCAB_BLOCK, budget_columns - budget_columns % MIN_VOCAB_BLOCK)
        return scan_vocab_blocks(self, hidden, weight, bias, target, cfg, vocab_offset, block)

    def gemm_grad(self, hidden, weight, bias, target, cfg: LCEConfig, vocab_offset: int, lse,  # noqa: ANN001, ANN201
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

    def plain_loss(self, logits, target, ignore_index, grad_scale):  # noqa: ANN001, ANN201
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

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):  # noqa: ANN001, ANN201
        n, vocab = logits.shape
        if n:
            p = launch_params(vocab, self.launch)
            kernels._plain_grad_kernel[(n,)](
                logits, logits.stride(0), target, lse, grad_scale, _scale_stride(grad_scale), vocab, ignore_index,
                BLOCK_V=p.block_v, num_warps=p.num_warps,
            )
        return logits

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:  # noqa: ANN001
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
            stats.sum_exp_z if stats.sum_exp_z is not None else unused,
            stats.weighted_sum_z if stats.weighted_sum_z is not None else unused,
            stats.argmax if stats.argmax is not None else unused,
            vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_CLASS_WEIGHT=weight is not None,
            NEED_SUM_EXP_Z=stats.sum_exp_z is not None, NEED_WEIGHTED_SUM_Z=stats.weighted_sum_z is not None,
            NEED_ARGMAX=stats.argmax is not None, ACCUMULATE=into is not None,
            BLOCK_V=p.block_v, num_warps=p.num_warps,
        )
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):  # noqa: ANN001, ANN201
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

    def scale_(self, tensor, scale):  # noqa: ANN001, ANN201
        if not tensor.is_contiguous() or tensor.numel() == 0:
            return tensor.mul_(scale)  # scale stays fp32: no rounding of grad_output to bf16
        kernels._scale_kernel[(triton.cdiv(tensor.numel(), _SCALE_BLOCK),)](
            tensor, scale, tensor.numel(), BLOCK=_SCALE_BLOCK, num_warps=8)
        return tensor

    def accumulate_fp32_(self, acc, a, b) -> None:  # noqa: ANN001
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
