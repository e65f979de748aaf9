"""Schedule VocabBlocks: the statistics of all rows first, then the gradients by vocabulary blocks.

For small memory budgets (the lean mode), where token chunks would be a few hundred rows each and
each chunk would read-modify-write the whole V x H weight gradient. Here every GEMM keeps all rows:

1. statistics of all rows (AllRows: the fused statistics GEMM, or a GEMM and a row scan per block);
2. for each block of ``grad_vocab_block`` columns, its logits recomputed and turned into
   d loss / d u (``backward_grad``: the fused gradient GEMM, whose logits never reach memory, or a
   plain GEMM and the row kernel in place); that block's rows of grad_weight (and grad_bias) are
   written once, and grad_hidden accumulates over the blocks (in fp32 when accum_dtype or precision="accurate"
   asks).

With a scalar loss as the only differentiable output both passes run in forward (backward scales the
gradients by grad_output); otherwise forward does step 1 and backward step 2 with the real upstream
gradients. One GEMM more than the three of the floor, and never any logits kept.
"""

from __future__ import annotations

import torch

from flce.engine import all_rows
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
from flce.engine.objective import Objective
from flce.engine.plans import FUSED, VocabBlocks
from flce.engine.rows import WorkBuffer, block_logits, forward_state, fp32_parts, logits_dtype
from flce.gradients import GradCoefficients
from flce.inputs import FlatInputs
from flce.semantics import Denominators, RowStats, statistics_dtype


def forward(call: EngineCall, flat: FlatInputs, plan: VocabBlocks, denoms: Denominators, objective: Objective, *,
            grads_in_forward: GradTargets | None) -> ForwardState:
    """Statistics of all rows; with grads_in_forward, the unscaled gradients of a scalar loss too (every row's
    statistics come first here, so a sequence-level objective is served as it is)."""
    stats = all_rows.statistics(call, flat, plan.stats)
    objective = objective.with_statistics(stats)
    state = forward_state(call, flat, stats, denoms, objective.terms(stats, flat.target), objective,
                          keep_stats=grads_in_forward is None)
    if grads_in_forward is not None:
        coeffs = objective.coefficients(stats, flat.target, slice(None))
        state.grads = block_gradients(call, flat, plan, stats, coeffs, grads_in_forward)
    return state


def backward(call: EngineCall, flat: FlatInputs, plan: VocabBlocks, state: ForwardState, wanted: GradTargets,
             objective: Objective) -> Grads:
    """Deferred gradients from forward's statistics of all rows and the objective's upstream gradients."""
    assert state.stats is not None
    coeffs = objective.coefficients(state.stats, flat.target, slice(None))
    return block_gradients(call, flat, plan, state.stats, coeffs, wanted)


def block_gradients(call: EngineCall, flat: FlatInputs, plan: VocabBlocks, stats: RowStats,
                    coeffs: GradCoefficients, wanted: GradTargets) -> Grads:
    """Step 2 of the module docstring."""
    cfg, kernels = call.cfg, call.kernels
    x, w, target = flat.hidden, flat.weight, flat.target
    exact = logits_dtype(w.dtype, cfg) != w.dtype  # precision="accurate": fp32 gradients, fp32 products
    fp32_acc = (cfg.accum_dtype == torch.float32 or exact) and w.dtype != torch.float32
    grad_hidden = None
    if wanted.hidden:
        grad_hidden = torch.zeros(x.shape, dtype=torch.float32 if fp32_acc else x.dtype, device=x.device)
    grad_weight = None
    if wanted.weight:
        grad_weight = (torch.zeros if fp32_acc else torch.empty)(
            w.shape, dtype=torch.float32 if fp32_acc else w.dtype, device=w.device)
    grad_bias = torch.empty_like(flat.bias) if wanted.bias and flat.bias is not None else None
    buffer = None
    if plan.backward_grad != FUSED:
        buffer = WorkBuffer(x, x.shape[0], min(plan.grad_vocab_block, w.shape[0]), logits_dtype(w.dtype, cfg))
    for start in range(0, w.shape[0], plan.grad_vocab_block):
        cols = slice(start, start + plan.grad_vocab_block)
        if plan.backward_grad == FUSED:
            bias = None if flat.bias is None else flat.bias[cols]
            grad = kernels.gemm_grad(x, w[cols], bias, target, cfg, start, stats.lse, coeffs)
        else:
            logits = block_logits(x, w, flat.bias, cols, buffer)
            grad = kernels.full_grad_(logits, target, cfg, start, stats.lse, coeffs)
        if grad_bias is not None:
            # Through the backend: PyTorch's own column sum of a bf16 block into fp32 held ~130 MiB
            # more than a 64 MiB budget's block (H100, docs/design-notes.md).
            sums = torch.zeros(grad.shape[1], dtype=statistics_dtype(grad.dtype), device=grad.device)
            kernels.add_column_sums_(sums, grad)
            grad_bias[cols] = sums
        if exact:
            for part in fp32_parts(grad, w.dtype):
                if grad_hidden is not None:
                    kernels.accumulate_fp32_(grad_hidden, part, w[cols])
                if grad_weight is not None:
                    kernels.accumulate_fp32_(grad_weight[cols], part.t(), x)
            continue
        if grad_hidden is not None:
            if fp32_acc:
                kernels.accumulate_fp32_(grad_hidden, grad, w[cols])
            else:
                grad_hidden.addmm_(grad, w[cols])
        if grad_weight is not None:
            if fp32_acc:
                kernels.accumulate_fp32_(grad_weight[cols], grad.t(), x)
            else:
                torch.mm(grad.t(), x, out=grad_weight[cols])
        del grad
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(x.dtype)
        if call.sharding is not None and grad_hidden.numel():
            # Complete only after the last block (whose weight product precedes): reduced here, not beside it.
            call.sharding.start_grad_hidden_reduce(grad_hidden)()
    return grad_hidden, None if grad_weight is None else grad_weight.to(w.dtype), grad_bias
