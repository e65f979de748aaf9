"""The CUDA backend's schedule and sizes: which named plan (flce.engine.plans) serves a call, its chunk or
block sizes and the memory they take, from the autotune cache's knobs where it holds them and the
heuristics below elsewhere. Every figure a heuristic rests on was measured (docs/benchmarks.md).

Pure functions of the call's description and the kernel families the choice (cuda/choice.py) took for its
roles: no tensor and no driver is touched here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flce.autotune.lookup import TunedEntry
from flce.backends.cuda.configs import GemmConfig, LaunchParams
from flce.backends.cuda.families import KernelChoice, families_for
from flce.backends.cuda.families import family as role
from flce.config import LCEConfig
from flce.engine.call import grads_in_forward_allowed
from flce.engine.choice import CallDescription, DeviceDescription, MemoryPlan
from flce.engine.distillation.call import DistillChunks, DistillDescription, pair_logits_bytes_per_row
from flce.engine.memory import (
    MiB,
    call_budget,
    call_save_limit,
    positive_int,
    saved_logits_rows,
    tuned_chunk_rows,
)
from flce.engine.plans import (
    CHUNK_GRADS,
    CUBLAS,
    EXPONENTIALS,
    FUSED,
    GEMM_PATHS,
    LOGITS,
    AllRows,
    Plan,
    TokenChunks,
    VocabBlocks,
)
from flce.engine.rows import logits_bytes_per_row, logits_dtype

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
# Widest row-kernel block a launch may ask for (a tuned block_v beyond it is refused).
MAX_BLOCK_V = 4096
GRAD_SCHEDULES = ("vocab_blocks", "token_chunks")
# Linear distillation's forward passes over a chunk's logits: one kernel (each row's sweeps back to back) or one each.
PAIR_PASSES = ("fused", "separate")
# Registers a thread of the one-kernel passes may use: at 64 a multiprocessor holds 4 blocks of 8 warps. Left to the
# compiler (over 80) it holds fewer, and on an H200 a JSD chunk of 1024 x 128256 bf16 took 0.414 ms against 0.366
# capped (80: 0.379; the same bits): the row sweeps wait on memory more than they compute, and more warps to switch
# to is what they lack. A cached pair_registers in PAIR_REGISTERS_RANGE takes its place (the top: no cap).
PAIR_REGISTERS = 64
PAIR_REGISTERS_RANGE = (32, 255)
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
# One read-modify-write of the V x H weight gradient (4VH bytes at HBM bandwidth) costs about as much
# as recomputing this many rows of logits (2HV flops each at the tensor-core rate): 2 x 700 TFLOP/s
# / 4.8 TB/s = 290 on the H200, 2 x 600 / 3.35 = 360 on the H100. Independent of H and V.
_RMW_IN_RECOMPUTED_ROWS = 320


@dataclass(frozen=True)
class TunedKnobs:
    """What the autotune cache holds for this shape, each None where it holds nothing usable."""

    tokens_per_chunk: int | None = None
    launch: LaunchParams | None = None
    logits_save_limit: int | None = None
    # "fused" (the capability's GEMM) or "cublas" (GEMM + row kernels): forward_stats where all rows'
    # statistics are taken at once (AllRows), forward_logits for each token chunk's logits, and
    # backward_grad where logits are recomputed for the gradient.
    forward_stats: str | None = None
    forward_logits: str | None = None
    backward_grad: str | None = None
    # "vocab_blocks" (the VocabBlocks plan) or "token_chunks", and the block's columns
    grad_schedule: str | None = None
    grad_vocab_block: int | None = None
    gemm: GemmConfig | None = None
    # the kernel family (cuda/families) of all rows' statistics, of a chunk's logits, of the gradient products
    stats_kernel: str | None = None
    logits_kernel: str | None = None
    grad_gemm_kernel: str | None = None
    # what a chunk's in-forward gradient is made from (engine.plans.CHUNK_GRADS)
    chunk_grad: str | None = None
    # linear distillation: forward's passes over a chunk's logits in one kernel or one each (PAIR_PASSES), and the
    # one kernel's programs (rows in flight; None: one a row) and registers a thread (PAIR_REGISTERS)
    pair_passes: str | None = None
    rows_in_flight: int | None = None
    pair_registers: int | None = None
    source: str = "none for this shape"


def tuned_knobs(entry: TunedEntry) -> TunedKnobs:
    """The cached knobs, validated: a file from another flce version may hold values this one cannot
    use, and those fall back to the heuristic."""
    params = entry.params or {}
    block_v, num_warps = positive_int(params.get("block_v")), positive_int(params.get("num_warps"))
    launch = None
    if block_v and num_warps and block_v & (block_v - 1) == 0 and block_v <= MAX_BLOCK_V and num_warps in (
            1, 2, 4, 8, 16, 32):
        launch = LaunchParams(block_v=block_v, num_warps=num_warps)

    def choice(name: str, allowed: tuple[str, ...]) -> str | None:
        value = params.get(name)
        return value if value in allowed else None

    def family(name: str, of_role: str) -> str | None:
        """A family that has a kernel for the role ("triton": either Triton family; "cublas" only where it is
        not the plans' path knob's value)."""
        names = {f.name.removesuffix("_tma") for f in families_for(of_role) if f.fused}
        return choice(name, tuple(sorted(names)) + (("cublas",) if of_role == role.PRODUCTS else ()))

    limit = entry.logits_save_limit_bytes
    return TunedKnobs(tokens_per_chunk=positive_int(params.get("tokens_per_chunk")), launch=launch,
                      logits_save_limit=limit if isinstance(limit, int) and limit >= 0 else None,
                      forward_stats=choice("forward_stats", GEMM_PATHS),
                      forward_logits=choice("forward_logits", GEMM_PATHS),
                      backward_grad=choice("backward_grad", GEMM_PATHS), gemm=GemmConfig.from_params(params),
                      grad_schedule=choice("grad_schedule", GRAD_SCHEDULES),
                      grad_vocab_block=positive_int(params.get("grad_vocab_block")),
                      stats_kernel=family("stats_kernel", role.STATISTICS),
                      logits_kernel=family("logits_kernel", role.CHUNK_LOGITS),
                      grad_gemm_kernel=family("grad_gemm_kernel", role.PRODUCTS),
                      chunk_grad=choice("chunk_grad", CHUNK_GRADS), pair_passes=choice("pair_passes", PAIR_PASSES),
                      rows_in_flight=positive_int(params.get("rows_in_flight")),
                      pair_registers=_pair_registers(params.get("pair_registers")), source=entry.source)


def _pair_registers(value: object) -> int | None:
    """A cached pair_registers the compiler can take (PAIR_REGISTERS_RANGE), else None."""
    registers = positive_int(value)
    low, high = PAIR_REGISTERS_RANGE
    return registers if registers and low <= registers <= high else None


def schedule(device: DeviceDescription, call: CallDescription, tuned: TunedKnobs,
             kernels: KernelChoice) -> tuple[Plan, MemoryPlan]:
    """Training (gradients follow): large token chunks (fewer weight-gradient updates), or vocabulary
    blocks where the budget leaves only small chunks; inference: all rows' statistics at once (the
    fused GEMM, or vocabulary blocks of all rows) where they fit, else small token chunks. Which path of each
    plan is fused follows the families the choice took for its roles."""
    cfg, request, n_rows, vocab = call.cfg, call.request, call.n_rows, call.vocab
    # Bytes of one logit: the compute dtype's, or under precision="accurate" fp32 and the 16-bit copy
    # of its gradient (the scans keep no gradient: scan_bytes).
    logit_bytes = logits_bytes_per_row(1, call.dtype, cfg)
    scan_bytes = logits_dtype(call.dtype, cfg).itemsize
    row_bytes = vocab * logit_bytes
    default = ((DEFAULT_CHUNK_BUDGET, "DEFAULT_CHUNK_BUDGET") if request.training
               else (INFERENCE_CHUNK_BUDGET, "INFERENCE_CHUNK_BUDGET, no gradient"))
    budget, budget_from = call_budget(cfg.memory_budget, *default)
    tuned_rows = tuned.tokens_per_chunk if request.training and not _budget_buys_chunks(cfg, budget) else None
    tokens = tuned_chunk_rows(n_rows, row_bytes, tuned_rows, budget, chunk_rows)
    fused_stats = kernels.family(role.STATISTICS).fused
    forward_logits = FUSED if kernels.family(role.CHUNK_LOGITS).fused else CUBLAS
    chunk_bytes = min(tokens, n_rows) * row_bytes
    if not request.training:
        if fused_stats:
            return AllRows(forward_stats=FUSED), MemoryPlan(budget, budget_from, n_rows * STATS_BYTES_PER_ROW)
        if n_rows * row_bytes > budget and not request.sharded:
            columns = budget // (n_rows * scan_bytes)
            if columns >= MIN_VOCAB_BLOCK:
                block = columns - columns % MIN_VOCAB_BLOCK
                return (AllRows(forward_stats=CUBLAS, scan_block=block),
                        MemoryPlan(budget, budget_from, n_rows * min(block, vocab) * scan_bytes))
        return TokenChunks(tokens_per_chunk=tokens, forward_logits=forward_logits), MemoryPlan(
            budget, budget_from, chunk_bytes)

    save_limit, save_limit_from = None, ""
    saved_rows = 0
    in_forward = grads_in_forward_allowed(cfg)
    # A call whose gradients need every row's statistics first (a sequence-level policy loss: request.statistics_first)
    # is planned as a deferred call is (the rows its budget keeps, all rows' statistics at once where it keeps none,
    # the recomputed chunks' gradient path, vocabulary blocks where they pay) and runs both passes in forward.
    two_pass = in_forward and request.statistics_first
    if not in_forward or two_pass:
        save_limit, save_limit_from = call_save_limit(tuned.logits_save_limit, cfg.memory_budget,
                                                      device.total_memory)
        tokens, saved_rows = _deferred_chunks(n_rows, row_bytes, tokens, save_limit,
                                              tuned.tokens_per_chunk is None and cfg.memory_budget is not None)
    backward_grad = FUSED if kernels.family(role.GRADIENT).fused else CUBLAS
    if n_rows and not request.sharded:
        # A tuned schedule was measured without kept logits; where some are kept they decide.
        by_blocks = (tuned.grad_schedule == "vocab_blocks" and not saved_rows) if tuned.grad_schedule else (
            _vocab_blocks_pay(cfg, n_rows, vocab, tokens, saved_rows > 0, two_pass))
        columns = vocab_block_columns(n_rows, logit_bytes, budget)
        if tuned.grad_vocab_block:  # a tuned block still honours an explicit memory_budget
            columns = tuned.grad_vocab_block if cfg.memory_budget is None else min(tuned.grad_vocab_block, columns)
        if by_blocks and columns >= MIN_VOCAB_BLOCK:
            block = min(columns, vocab)
            stats = AllRows(forward_stats=FUSED) if fused_stats else AllRows(forward_stats=CUBLAS, scan_block=block)
            return (VocabBlocks(grad_vocab_block=block, stats=stats, backward_grad=backward_grad),
                    MemoryPlan(budget, budget_from, n_rows * (block * logit_bytes + STATS_BYTES_PER_ROW)))
    chunks = TokenChunks(tokens_per_chunk=tokens, saved_rows=saved_rows, forward_logits=forward_logits)
    if two_pass:
        # The kept rows hold exponentials where a family makes them (their row scale known once every row's
        # statistics are), else logits; the others are recomputed.
        exponentials = bool(saved_rows) and kernels.family(role.EXPONENTIALS) is not None
        chunks = replace(chunks, backward_grad=backward_grad, chunk_grad=EXPONENTIALS if exponentials else LOGITS,
                         stats_first=AllRows(forward_stats=FUSED) if fused_stats else None)
    elif in_forward:
        # A chunk's gradient is made as its statistics are: from its logits, or from the kept exponentials where a
        # family takes that role; nothing is recomputed.
        chunks = replace(chunks, chunk_grad=EXPONENTIALS if kernels.family(role.EXPONENTIALS) else LOGITS)
    else:
        # Deferred: the rows whose logits are not kept are recomputed in backward; where none are kept, forward
        # may take all rows' statistics at once (the compile path keeps none: engine/plans.py recomputing).
        chunks = replace(chunks, backward_grad=backward_grad,
                         stats_first=AllRows(forward_stats=FUSED) if fused_stats else None)
    return chunks, MemoryPlan(budget, budget_from, 0 if saved_rows == n_rows else chunk_bytes,
                              saved_rows * row_bytes, save_limit, save_limit_from)


def _budget_buys_chunks(cfg: LCEConfig, budget: int) -> bool:
    """An explicit memory_budget above the default buys in-forward token chunks as large as it holds, over
    the autotune cache's chunk (tuned within the default budget): fewer read-modify-writes of the V x H
    weight gradient and larger GEMMs. H100, bf16, the default call x the 3-GEMM floor (median of 3 rounds,
    tools/benchmarks/chunk_sweep.py): 8192x4096x128256 at 2048 / 4096 rows 1.072 / 1.042; 16384x2048x151936
    at 1536 (default) / 2048 / 4096 / 8192 rows 1.111 / 1.085 / 1.051 / 1.029 (docs/benchmarks.md)."""
    return budget > DEFAULT_CHUNK_BUDGET and cfg.memory_budget is not None and grads_in_forward_allowed(cfg)


def vocab_block_columns(n_rows: int, element_size: int, budget: int) -> int:
    """Columns of the widest vocabulary block of all n_rows that fits ``budget`` bytes beside the
    rows' statistics, in whole GEMM tiles (may be 0 or exceed the vocabulary)."""
    columns = (budget - n_rows * STATS_BYTES_PER_ROW) // (max(n_rows, 1) * element_size)
    return max(0, columns - columns % GRAD_BLOCK_MULTIPLE)


def fallback_scan_block(n_rows: int, element_size: int) -> int:
    """Columns per block of the row-kernel scan that stands in for a fused statistics GEMM that
    failed to compile: the inference budget's blocks, never narrower than MIN_VOCAB_BLOCK."""
    columns = INFERENCE_CHUNK_BUDGET // max(1, n_rows * element_size)
    return max(MIN_VOCAB_BLOCK, columns - columns % MIN_VOCAB_BLOCK)


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


def _deferred_cost(n_rows: int, tokens: int, saved_rows: int) -> int:
    """Backward's extra work in recomputed rows: the rows not saved, and one weight-gradient
    read-modify-write for the saved rows (one GEMM over all of them) and per recomputed chunk."""
    recomputed = n_rows - saved_rows
    updates = (saved_rows > 0) + -(-recomputed // max(1, tokens))
    return recomputed + _RMW_IN_RECOMPUTED_ROWS * updates


def _vocab_blocks_pay(cfg: LCEConfig, n_rows: int, vocab: int, chunk: int, logits_saved: bool,
                      two_pass: bool = False) -> bool:
    """The heuristic choice of the vocabulary-block schedule. In forward it trades a fourth GEMM for
    the weight gradient's read-modify-writes, worth it for small chunks only. The deferred schedule (and a
    statistics-first one, ``two_pass``) recomputes the logits either way (unless some are saved), so there blocks
    only trade a V x H read-modify-write per token chunk for an N x H one per block: fewer bytes when N < V."""
    if chunk >= n_rows:
        return False
    if grads_in_forward_allowed(cfg) and not two_pass:
        return chunk < VOCAB_BLOCK_SCHEDULE_BELOW_ROWS
    return not logits_saved and n_rows < vocab


def chunk_rows(n_rows: int, max_rows: int) -> int:
    """Rows per chunk: all rows if they fit, else as few chunks as fit, each a multiple of ROW_MULTIPLE rows and
    as even as that allows (the last takes the rest). Measured on the H200 at 16384x2048x151936: 1536-row chunks
    49.4 ms, evenly balanced 1664-row chunks 51.4 ms (half a 256-row GEMM tile wasted per chunk). On the H100
    (tools/benchmarks/chunk_sweep.py, x the 3-GEMM floor, one run each) a 2 GiB budget there planned 6912 + 6912 +
    2560 rows at 1.069 against 1.044 for 4 x 4096, and plans 5632 + 5632 + 5120 at 1.043 against 1.028."""
    if n_rows <= max_rows:
        return max(1, n_rows)
    if max_rows < ROW_MULTIPLE:
        return max_rows
    chunks = -(-n_rows // max_rows)
    while True:
        rows = -(-n_rows // chunks)
        rows += -rows % ROW_MULTIPLE
        if rows <= max_rows:
            return rows
        chunks += 1


def distillation_schedule(desc: DistillDescription, tuned: TunedKnobs,
                          stats_in_gemm: bool = False) -> tuple[DistillChunks, MemoryPlan]:
    """Linear distillation's token chunks: rows as cross-entropy's (the cache's tokens_per_chunk while it fits the
    budget, else the most that fit it, in whole ROW_MULTIPLE rows) of both heads' logits, the kernels' only [n, V]
    memory (they write the gradients over them); forward's passes in one kernel unless the call is a vocabulary
    shard (its statistics need the other shards' first) or the cache says pair_passes=separate. ``stats_in_gemm``:
    the logits GEMMs make both softmaxes' statistics (the choice's CHUNK_LOGITS family)."""
    per_row = pair_logits_bytes_per_row(desc.vocab, desc.dtype)
    budget, budget_from = call_budget(desc.cfg.memory_budget, DEFAULT_CHUNK_BUDGET, "DEFAULT_CHUNK_BUDGET")
    rows = tuned_chunk_rows(desc.n_rows, per_row, tuned.tokens_per_chunk, budget, chunk_rows)
    fused = not desc.request.sharded and tuned.pair_passes != "separate"
    return (DistillChunks(rows, fused_passes=fused, stats_in_gemm=stats_in_gemm),
            MemoryPlan(budget, budget_from, min(rows, desc.n_rows) * per_row))
