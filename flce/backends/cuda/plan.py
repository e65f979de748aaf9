"""The CUDA backend's planner: which named plan (flce.engine.plans) and sizes serve a call.

The autotune cache's knobs for the shape (:func:`tuned_knobs`, the one place they are parsed) win
where it holds them; the heuristics below fill in the rest. Every figure a heuristic rests on was
measured (docs/design-notes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.autotune.lookup import tuned_params
from flce.backends.cuda.gemm_ops import GemmConfig
from flce.config import LCEConfig
from flce.engine.call import grads_in_forward_allowed
from flce.engine.memory import MiB, default_logits_save_limit, logits_save_limit, saved_logits_rows
from flce.engine.plans import (
    CHUNK_GRADS,
    CUBLAS,
    EXPONENTIALS,
    FUSED,
    GEMM_PATHS,
    LOGITS,
    AllRows,
    Plan,
    PlanRequest,
    TokenChunks,
    VocabBlocks,
)
from flce.engine.rows import logits_bytes_per_row, logits_dtype
from flce.inputs import FlatInputs

# Default working memory of one chunk's logits when gradients are computed. Larger chunks mean fewer
# read-modify-writes of the V x H weight gradient (one per chunk); this keeps the default call
# under 512 MiB above the gradients (2048-row chunks at V = 128256, the largest that fit).
DEFAULT_CHUNK_BUDGET = 504 * MiB
# Without gradients nothing is accumulated across vocabulary blocks: statistics of all rows are
# scanned in blocks of at least MIN_VOCAB_BLOCK columns (GEMMs [tokens, H] x [H, block] run at full
# speed) within this much memory. Also the width of the fused forward's fallback scan.
INFERENCE_CHUNK_BUDGET = 64 * MiB
MIN_VOCAB_BLOCK = 512
# Chunk rows are rounded down to this multiple: cuBLAS's 256-row GEMM tiles stay full.
ROW_MULTIPLE = 256
# The fused statistics GEMM's kernels: the warp-specialised Gluon GEMM where it applies (Hopper, plain
# statistics; 0.94-1.02x one cuBLAS GEMM forward-only against 1.01-1.07x for the Triton GEMM on the H200
# and H100, docs/design-notes.md), else the Triton GEMM. Two knobs, because the tuner measures them in
# different calls: stats_kernel where only statistics are taken (forward-only calls, a statistics pass
# before the gradient), logits_kernel where the GEMM also writes a training chunk's logits.
WARP_SPECIALIZED = "warp_specialized"
STATS_KERNELS = (WARP_SPECIALIZED, "triton")
# The gradient products G @ W and G.T @ x (knob grad_gemm_kernel): the warp-specialised GEMM (with the
# weight gradient's read-modify-write fetched during its main loop) or cuBLAS. cuBLAS by default: on the
# H100 the ws products made the default call slower (1.24-1.26x the floor against 1.15-1.18x at
# 16384x2048x151936; its accumulating G.T @ x of one chunk 7% slower than cuBLAS's addmm, and G @ W of a
# 1536-row chunk has 96 tiles for 132 SMs; docs/design-notes.md). flce-autotune measures both on Hopper.
GRAD_GEMM_KERNELS = (WARP_SPECIALIZED, CUBLAS)
DEFAULT_GRAD_GEMM_KERNEL = CUBLAS
# Widest row-kernel block a tuned launch may ask for.
MAX_BLOCK_V = 4096


@dataclass(frozen=True)
class LaunchParams:
    """A row kernel's launch: columns per block and warps per program (tuned, or launch_params)."""

    block_v: int
    num_warps: int


@dataclass(frozen=True)
class TunedKnobs:
    """What the autotune cache holds for this shape, each None where it holds nothing usable."""

    tokens_per_chunk: int | None = None
    launch: LaunchParams | None = None
    logits_save_limit: int | None = None
    # "fused" (the capability's GEMM) or "cublas" (GEMM + row kernels): forward_stats where all rows'
    # statistics are taken at once (AllRows), forward_logits for each token chunk's logits, and
    # backward_grad where logits are recomputed for the gradient (default: fused_grad_default).
    forward_stats: str | None = None
    forward_logits: str | None = None
    backward_grad: str | None = None
    # "vocab_blocks" (the VocabBlocks plan) or "token_chunks", and the block's columns
    grad_schedule: str | None = None
    grad_vocab_block: int | None = None
    gemm: GemmConfig | None = None
    stats_kernel: str | None = None
    logits_kernel: str | None = None
    grad_gemm_kernel: str | None = None
    # what a plain chunk's in-forward gradient is made from (engine.plans.CHUNK_GRADS)
    chunk_grad: str | None = None


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

    def choice(name: str, allowed: tuple[str, ...]) -> str | None:
        value = params.get(name)
        return value if value in allowed else None

    def path(name: str) -> str | None:
        return choice(name, GEMM_PATHS)

    return TunedKnobs(tokens_per_chunk=positive_int("tokens_per_chunk"), launch=launch,
                      logits_save_limit=limit if isinstance(limit, int) and limit >= 0 else None,
                      forward_stats=path("forward_stats"), forward_logits=path("forward_logits"),
                      backward_grad=path("backward_grad"),
                      gemm=GemmConfig.from_params(params),
                      grad_schedule=choice("grad_schedule", GRAD_SCHEDULES),
                      grad_vocab_block=positive_int("grad_vocab_block"),
                      stats_kernel=choice("stats_kernel", STATS_KERNELS),
                      logits_kernel=choice("logits_kernel", STATS_KERNELS),
                      grad_gemm_kernel=choice("grad_gemm_kernel", GRAD_GEMM_KERNELS),
                      chunk_grad=choice("chunk_grad", CHUNK_GRADS))


# Below this many tokens the fused forward has few row blocks to spread over the SMs and its fixed
# costs (target logits, split merge) weigh more; measured on the H200 at 4096 x 4096 x 32000 it is
# still ahead (1.070x one GEMM against 1.096x for cuBLAS and the row kernel); smaller calls are
# unmeasured and stay on cuBLAS.
FUSED_FORWARD_MIN_ROWS = 4096
GRAD_SCHEDULES = ("vocab_blocks", "token_chunks")
# In-forward gradients: budgets that leave token chunks of fewer rows than this take the vocabulary-
# block schedule, whose recomputed GEMM costs less than each small chunk's read-modify-write of the
# V x H weight gradient. Measured on the H200 (docs/design-notes.md): 256-row chunks 1.47x / 1.71x the
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
    and 3-6% on the H100 (tools/benchmarks/gemm_grad.py). Its 2-D grid with plain stores (other GPUs,
    unaligned rows) measured 7-20% slower, and newer GPUs are unmeasured: cuBLAS stays there."""
    x, w = flat.hidden, flat.weight
    return (x.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % 8 == 0
            and w.shape[1] % 8 == 0 and torch.cuda.get_device_capability(x.device)[0] == 9)


def hopper_16bit(device: torch.device, dtype: torch.dtype, hidden: int, vocab: int) -> bool:
    """sm_90 with 16-bit operands whose rows (H) and logits rows (V) are 16-byte aligned: where the
    warp-specialised GEMM takes every product of the loss."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and vocab % 8 == 0
            and hidden % 8 == 0 and torch.cuda.get_device_capability(device) == (9, 0))


def ws_forward_logits_default(flat: FlatInputs) -> bool:
    """Where the cache says nothing: each token chunk's logits from the warp-specialised statistics
    GEMM, which also writes them, on Hopper (its epilogue computes every statistic and option of the
    loss: bias, softcap, temperature, class weights)."""
    vocab, hidden = flat.weight.shape
    return hopper_16bit(flat.hidden.device, flat.weight.dtype, hidden, vocab)


def exp_chunk_grad_possible(flat: FlatInputs, cfg: LCEConfig, request: PlanRequest) -> bool:
    """Where a chunk's gradient can come from kept exponentials (capability KEPT_EXPONENTIALS): a plain
    call whose scalar loss is its only differentiable output, bf16 or fp32 inputs (fp16 cannot hold
    exponentials up to 2^64) in the compute dtype, no bias (whose gradient the path does not make), on
    one device (a vocabulary shard's rows need the other shards' statistics first)."""
    return (flat.bias is None and not request.sharded and not cfg.needs_full and grads_in_forward_allowed(cfg)
            and flat.weight.dtype in (torch.bfloat16, torch.float32)
            and logits_dtype(flat.weight.dtype, cfg) == flat.weight.dtype)


def exp_chunk_grad_default(flat: FlatInputs, cfg: LCEConfig, request: PlanRequest, forward_logits: str) -> bool:
    """Where the cache says nothing: kept exponentials wherever possible on Hopper beside the fused forward
    (its warp-specialised statistics GEMM writes them: one multiply a logit instead of the gradient pass
    over the logits)."""
    vocab, hidden = flat.weight.shape
    return (forward_logits == FUSED and exp_chunk_grad_possible(flat, cfg, request)
            and hopper_16bit(flat.hidden.device, flat.weight.dtype, hidden, vocab))


def fallback_scan_block(n_rows: int, element_size: int) -> int:
    """Columns per block of the row-kernel scan that stands in for a fused statistics GEMM that
    failed to compile: the inference budget's blocks, never narrower than MIN_VOCAB_BLOCK."""
    columns = INFERENCE_CHUNK_BUDGET // max(1, n_rows * element_size)
    return max(MIN_VOCAB_BLOCK, columns - columns % MIN_VOCAB_BLOCK)


def fused_path(fused: bool) -> str:
    return FUSED if fused else CUBLAS


def plan_chunks(flat: FlatInputs, cfg: LCEConfig, request: PlanRequest, tuned: TunedKnobs = TunedKnobs()) -> Plan:
    """Training (gradients follow): large token chunks (fewer weight-gradient updates), or vocabulary
    blocks where the budget leaves only small chunks; inference: all rows' statistics at once (the
    fused GEMM, or vocabulary blocks of all rows) where they fit, else small token chunks."""
    n_rows = flat.target.shape[0]
    vocab = flat.weight.shape[0]
    # Bytes of one logit: the compute dtype's, or under precision="accurate" fp32 and the 16-bit copy
    # of its gradient (the scans keep no gradient: scan_bytes).
    logit_bytes = logits_bytes_per_row(1, flat.weight.dtype, cfg)
    scan_bytes = logits_dtype(flat.weight.dtype, cfg).itemsize
    row_bytes = vocab * logit_bytes
    if cfg.memory_budget is not None:
        budget = cfg.memory_budget
    else:
        budget = DEFAULT_CHUNK_BUDGET if request.training else INFERENCE_CHUNK_BUDGET
    max_rows = max(1, budget // row_bytes)
    if request.training and tuned.tokens_per_chunk is not None:
        # A tuned chunk still honours an explicit memory_budget.
        tokens = tuned.tokens_per_chunk if cfg.memory_budget is None else min(tuned.tokens_per_chunk, max_rows)
    else:
        tokens = chunk_rows(n_rows, max_rows)
    fused_stats = fused_forward_default(flat) if tuned.forward_stats is None else tuned.forward_stats == FUSED
    if tuned.forward_logits is not None:
        forward_logits = tuned.forward_logits
    else:
        forward_logits = fused_path(ws_forward_logits_default(flat))
    if cfg.return_logit_stats:
        # The fused statistics GEMM keeps no row min or sum of z; the row-kernel scan does.
        fused_stats, forward_logits = False, CUBLAS
    accurate = logits_dtype(flat.weight.dtype, cfg) != flat.weight.dtype
    if accurate:
        # The fused GEMMs round each logits tile to the compute dtype: fp32 logits come from cuBLAS.
        fused_stats, forward_logits = False, CUBLAS
    if not request.training:
        if fused_stats:
            return AllRows(forward_stats=FUSED)
        if n_rows * row_bytes > budget and not request.sharded:
            columns = budget // (n_rows * scan_bytes)
            if columns >= MIN_VOCAB_BLOCK:
                return AllRows(forward_stats=CUBLAS, scan_block=columns - columns % MIN_VOCAB_BLOCK)
        return TokenChunks(tokens_per_chunk=tokens, forward_logits=forward_logits)

    save_limit = logits_save_limit(tuned.logits_save_limit, cfg.memory_budget,
                                   default_logits_save_limit(flat.hidden.device))
    saved_rows = 0
    if not grads_in_forward_allowed(cfg):
        tokens, saved_rows = _deferred_chunks(n_rows, row_bytes, tokens, save_limit,
                                              tuned.tokens_per_chunk is None and cfg.memory_budget is not None)
    backward_grad = fused_path(not accurate and (fused_grad_default(flat) if tuned.backward_grad is None
                                                 else tuned.backward_grad == FUSED))
    if n_rows and not request.sharded:
        # A tuned schedule was measured without kept logits; where some are kept they decide.
        by_blocks = (tuned.grad_schedule == "vocab_blocks" and not saved_rows) if tuned.grad_schedule else (
            _vocab_blocks_pay(cfg, n_rows, vocab, tokens, saved_rows > 0))
        columns = vocab_block_columns(n_rows, logit_bytes, budget)
        if tuned.grad_vocab_block:  # a tuned block still honours an explicit memory_budget
            columns = tuned.grad_vocab_block if cfg.memory_budget is None else min(tuned.grad_vocab_block, columns)
        if by_blocks and columns >= MIN_VOCAB_BLOCK:
            block = min(columns, vocab)
            stats = AllRows(forward_stats=FUSED) if fused_stats else AllRows(forward_stats=CUBLAS, scan_block=block)
            return VocabBlocks(grad_vocab_block=block, stats=stats, backward_grad=backward_grad)
    exponentials = exp_chunk_grad_default(flat, cfg, request, forward_logits)
    if tuned.chunk_grad is not None:
        exponentials = tuned.chunk_grad == EXPONENTIALS and exp_chunk_grad_possible(flat, cfg, request)
    return TokenChunks(tokens_per_chunk=tokens, saved_rows=saved_rows, forward_logits=forward_logits,
                       backward_grad=backward_grad, stats_first=AllRows(forward_stats=FUSED) if fused_stats else None,
                       chunk_grad=EXPONENTIALS if exponentials else LOGITS)


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
