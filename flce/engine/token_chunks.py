"""Schedule TokenChunks: the tokens in chunks, each chunk against the whole vocabulary.

Forward, chunk by chunk: one GEMM makes the chunk's logits (``forward_logits``: a plain GEMM and a row
kernel, or the fused statistics GEMM that also writes them), a row kernel turns them into per-row
statistics, and then

* gradients in forward (a scalar loss is the only differentiable output): a grad kernel overwrites
  the logits with d loss / d u in place and two GEMMs turn that into grad_hidden rows and a
  grad_weight contribution; backward only scales them by grad_output. Three GEMMs in all, nothing
  kept but the gradients. With ``chunk_grad="exponentials"`` (the plain variant) the statistics GEMM
  writes exponentials that are the gradient up to a per-row scale instead of the logits, and the two
  gradient GEMMs scale rows: no grad kernel pass;
* deferred (reduction="none", log-probs or entropy): the logits of the first ``saved_rows`` rows are
  written into one kept buffer, the rest dropped. Where nothing is kept, ``stats_first`` may take the
  statistics of all rows at once (AllRows) instead.

Backward (deferred): the kept rows' logits become their gradient in place chunk by chunk, and the two
gradient GEMMs run once over all of them (one write of the weight gradient instead of a
read-modify-write per chunk); every other chunk is recomputed (``backward_grad``: a GEMM and the row
kernel, or the fused gradient GEMM) and accumulated.

An objective whose gradients need every row's statistics (a sequence-level policy loss) runs both halves in
forward (flce.engine.schedule): forward as deferred, then backward with grad_output 1. Its kept rows may hold
exponentials instead of logits (``chunk_grad="exponentials"``, a gradient that is a row multiple of softmax -
onehot): their row scales at a unit upstream scale, times the objective's once known, scale the two GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flce.engine import all_rows
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
from flce.engine.objective import Objective
from flce.engine.plans import EXPONENTIALS, FUSED, TokenChunks, chunk_bounds, kept_rows
from flce.engine.rows import (
    GradAccumulator,
    WorkBuffer,
    chunk_logits,
    concat_stats,
    concat_terms,
    forward_state,
    logits_dtype,
    slice_stats,
)
from flce.inputs import FlatInputs
from flce.semantics import Denominators, RowStats, RowTerms, extras, reduce_terms


def _hidden_reduce(call: EngineCall) -> Callable[[torch.Tensor], Callable[[], None]] | None:
    """A sharded call's grad_hidden reduction, which the accumulator starts beside the last weight product."""
    return None if call.sharding is None else call.sharding.start_grad_hidden_reduce


def forward(call: EngineCall, flat: FlatInputs, plan: TokenChunks, denoms: Denominators, objective: Objective, *,
            grads_in_forward: GradTargets | None, backward_follows: bool) -> ForwardState:
    """Loss and extras; with grads_in_forward, the unscaled gradients too (each chunk's from its own statistics:
    a token-level objective). backward_follows=False (inference) keeps nothing for a backward."""
    cfg, kernels, target = call.cfg, call.kernels, flat.target
    n_rows = target.shape[0]
    acc = GradAccumulator(kernels, flat, cfg, grads_in_forward, _hidden_reduce(call)) if grads_in_forward else None
    deferred = backward_follows and acc is None
    keep = kept_rows(plan, n_rows) if deferred else 0
    if acc is None and keep == 0 and plan.stats_first is not None:
        return all_rows.forward(call, flat, plan.stats_first, denoms, objective, keep_stats=deferred)

    vocab_here = flat.weight.shape[0]
    dtype = logits_dtype(flat.weight.dtype, cfg)
    saved = flat.hidden.new_empty(keep, vocab_here, dtype=dtype) if keep else None
    # Chunks that are not kept all write into one buffer (rows.WorkBuffer says why).
    buffer = WorkBuffer(flat.hidden, min(plan.tokens_per_chunk, n_rows), vocab_here, dtype) if keep < n_rows else None
    stats_per_chunk: list[RowStats] = []
    # The plain row kernel's chunks give their terms, and an objective whose scales need the statistics gives
    # them with its scales (one pass of its formula); the others' come from all rows' statistics at the end (the
    # objective's terms are row by row: one set of small launches a call instead of one a chunk).
    terms_per_chunk: list[RowTerms] = []
    # A statistics-first objective's kept chunks (chunk_grad "exponentials"): exponentials at a unit scale, whose row
    # scales the objective's multiply once every row's statistics are known (flce.engine.schedule).
    kept_row_scales: list[torch.Tensor] = []
    for rows in chunk_bounds(n_rows, plan.tokens_per_chunk):
        t = target[rows]
        n = t.shape[0]
        grad = None
        # A kept chunk's logits are written straight into the saved buffer.
        kept = saved[rows] if saved is not None and rows.stop <= keep else None
        out = kept if kept is not None else buffer.view(n, vocab_here)
        if kept is not None and plan.chunk_grad == EXPONENTIALS:
            stats, row_scale = kernels.gemm_exp_grad(flat.hidden[rows], flat.weight, t, cfg,
                                                     torch.ones_like(t, dtype=torch.float32), kept)
            kept_row_scales.append(row_scale)
            stats_per_chunk.append(stats)
            del kept, out
            continue
        if acc and plan.chunk_grad == EXPONENTIALS:
            # The statistics GEMM keeps exponentials whose row scaling is the gradient: no row kernel
            # passes over them, and the gradient GEMMs scale rows instead. The row scale is linear in the
            # upstream scale, so an objective whose scales follow from the statistics multiplies it afterwards.
            if objective.scales_need_statistics:
                stats, row_scale = kernels.gemm_exp_grad(flat.hidden[rows], flat.weight, t, cfg,
                                                         torch.ones_like(t, dtype=torch.float32), out)
                known = objective.with_statistics(stats, rows)
                row_scale = row_scale * known.scales(stats, rows, n).cross_entropy
                terms_per_chunk.append(known.terms(stats, t))
            else:
                stats, row_scale = kernels.gemm_exp_grad(flat.hidden[rows], flat.weight, t, cfg,
                                                         objective.scales(None, rows, n).cross_entropy, out)
            acc.add_row_scaled(out, row_scale, rows)
            stats_per_chunk.append(stats)
            del kept, out
            continue
        if plan.forward_logits == FUSED:
            logits = out
            partial = kernels.gemm_row_stats(flat.hidden[rows], flat.weight, flat.bias, t, cfg, call.vocab_offset,
                                             logits)
            stats = RowStats.from_partial(call.combined(partial))
            if acc and call.plain:
                grad = kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse,
                                           objective.scales(stats, rows, n).cross_entropy)
        elif call.plain:
            assert not objective.scales_need_statistics, "the plain row kernel takes its scale before the statistics"
            logits = chunk_logits(flat, rows, out=out)
            loss_rows, lse, grad = kernels.plain_loss(logits, t, cfg.ignore_index,
                                                      objective.scales(None, rows, n).cross_entropy if acc else None)
            stats = RowStats(lse=lse, target_z=lse - loss_rows)
            terms_per_chunk.append(RowTerms(loss_rows, None, t != cfg.ignore_index))
        else:
            logits = chunk_logits(flat, rows, out=out)
            stats = RowStats.from_partial(call.combined(kernels.row_stats(logits, t, cfg, call.vocab_offset)))
        if acc and not call.plain:
            known = objective.with_statistics(stats, rows)
            coeffs = known.coefficients(stats, t, rows)
            if objective.scales_need_statistics:  # its terms come with its scales (flce.engine.objective)
                terms_per_chunk.append(known.terms(stats, t))
            grad = kernels.full_grad_(logits, t, cfg, call.vocab_offset, stats.lse, coeffs)
        if acc:
            acc.add(grad, rows)
        stats_per_chunk.append(stats)
        del logits, grad, kept, out

    all_stats = concat_stats(stats_per_chunk, target)
    if terms_per_chunk:
        terms = concat_terms(terms_per_chunk, target)
    else:
        objective = objective.with_statistics(all_stats)
        terms = objective.terms(all_stats, target)
    if acc is None:
        state = forward_state(call, flat, all_stats, denoms, terms, objective, keep_stats=deferred)
        state.saved_logits = saved
        state.saved_row_scale = torch.cat(kept_row_scales) if kept_row_scales else None
        return state
    vocab = call.vocab(flat.weight.shape[0])
    loss, z_loss = reduce_terms(terms, cfg, denoms)
    return ForwardState(loss=loss, z_loss=z_loss, extras=extras(all_stats, terms, target, cfg, denoms, vocab),
                        denoms=denoms, grads=acc.result())


def backward(call: EngineCall, flat: FlatInputs, plan: TokenChunks, state: ForwardState, wanted: GradTargets,
             objective: Objective) -> Grads:
    """Gradients from forward's row statistics and kept logits under ``objective`` (a deferred backward's
    upstream gradients, or, in forward, a sequence-level loss once every row's statistics are known)."""
    cfg, kernels, target = call.cfg, call.kernels, flat.target
    assert state.stats is not None
    acc = GradAccumulator(kernels, flat, cfg, wanted, _hidden_reduce(call))
    saved = state.saved_logits
    # The saved logits are overwritten by the grad kernels: a second backward must recompute.
    state.saved_logits = None
    keep = 0 if saved is None else saved.shape[0]
    n_rows = target.shape[0]
    recompute_buffer = None
    if keep < n_rows and plan.backward_grad != FUSED:
        recompute_buffer = WorkBuffer(flat.hidden, min(plan.tokens_per_chunk, n_rows), flat.weight.shape[0],
                                      logits_dtype(flat.weight.dtype, cfg))

    def chunk_grad(rows: slice, logits: torch.Tensor | None) -> torch.Tensor:
        """d loss / d u of one chunk, over its logits (recomputed where None)."""
        t = target[rows]
        stats = slice_stats(state.stats, rows)
        fused = plan.backward_grad == FUSED and logits is None
        coeffs = objective.coefficients(stats, t, rows) if not call.plain or fused else None
        if fused:
            return kernels.gemm_grad(flat.hidden[rows], flat.weight, flat.bias, t, cfg, call.vocab_offset,
                                     stats.lse, coeffs)
        if logits is None:
            logits = chunk_logits(flat, rows, out=recompute_buffer.view(t.shape[0], flat.weight.shape[0]))
        if coeffs is None:
            return kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse,
                                       objective.scales(stats, rows, t.shape[0]).cross_entropy)
        return kernels.full_grad_(logits, t, cfg, call.vocab_offset, stats.lse, coeffs)

    bounds = chunk_bounds(target.shape[0], plan.tokens_per_chunk)
    if saved is not None and state.saved_row_scale is not None:
        # Kept exponentials: the objective's scale of each row times the exponentials' is the gradient; the two
        # gradient GEMMs once over all of them, no pass over them.
        kept = slice(0, keep)
        scale = objective.scales(slice_stats(state.stats, kept), kept, keep).cross_entropy
        acc.add_row_scaled(saved, state.saved_row_scale * scale, kept)
        state.saved_row_scale = None
        del saved
    elif saved is not None:
        # The kept rows: the row kernels chunk by chunk over the buffer (their temporaries stay
        # chunk-sized), the two gradient GEMMs once over all of them.
        for rows in bounds:
            if rows.stop <= keep:
                chunk_grad(rows, saved[rows])  # in place
        acc.add(saved, slice(0, keep))
        del saved
    for rows in bounds:
        if rows.stop > keep:
            grad = chunk_grad(rows, None)
            acc.add(grad, rows)
            del grad
    return acc.result()
