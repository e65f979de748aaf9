"""Schedule AllRows: the statistics of all rows at once, and nothing else.

Serves forward-only calls (evaluation, RL reference log-probs) in full, and is the first pass of the
schedules that need every row's statistics before any gradient (VocabBlocks; a deferred TokenChunks
plan that keeps no logits). Either one fused statistics GEMM over the whole vocabulary, or a plain
GEMM and a row scan per vocabulary block whose partial statistics merge exactly into the running ones
(the online-softmax algebra of semantics.merge_partial_stats).
"""

from __future__ import annotations

import torch

from flce.config import LCEConfig
from flce.engine.call import EngineCall, ForwardState
from flce.engine.objective import Objective
from flce.engine.plans import FUSED, AllRows
from flce.engine.rows import WorkBuffer, block_logits, forward_state, logits_dtype
from flce.inputs import FlatInputs
from flce.semantics import Denominators, PartialRowStats, RowStats


def statistics(call: EngineCall, flat: FlatInputs, plan: AllRows) -> RowStats:
    """Row statistics of all rows over the whole vocabulary (all shards' when sharded)."""
    if plan.forward_stats == FUSED:
        partial = call.kernels.gemm_row_stats(flat.hidden, flat.weight, flat.bias, flat.target, call.cfg,
                                              call.vocab_offset)
    else:
        assert plan.scan_block is not None
        partial = scan_vocab_blocks(call.kernels, flat.hidden, flat.weight, flat.bias, flat.target, call.cfg,
                                    call.vocab_offset, plan.scan_block)
    return RowStats.from_partial(call.combined(partial))


def forward(call: EngineCall, flat: FlatInputs, plan: AllRows, denoms: Denominators, objective: Objective, *,
            keep_stats: bool) -> ForwardState:
    """Loss and extras; keep_stats: the gradients follow and need the statistics."""
    stats = statistics(call, flat, plan)
    objective = objective.with_statistics(stats)
    return forward_state(call, flat, stats, denoms, objective.terms(stats, flat.target), objective,
                         keep_stats=keep_stats)


def scan_vocab_blocks(
    kernels: object, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    target: torch.Tensor, cfg: LCEConfig, vocab_offset: int, block: int,
) -> PartialRowStats:
    """Partial statistics of hidden @ weight.T + bias, one GEMM and one row scan per column block.
    Also the fallback of a fused statistics GEMM that fails to compile."""
    running = None
    buffer = WorkBuffer(hidden, hidden.shape[0], min(block, weight.shape[0]), logits_dtype(weight.dtype, cfg))
    for start in range(0, weight.shape[0], block):
        logits = block_logits(hidden, weight, bias, slice(start, start + block), buffer)
        running = kernels.row_stats(logits, target, cfg, vocab_offset + start, into=running)
        del logits
    assert running is not None
    return running
