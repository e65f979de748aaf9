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
"""

from __future__ import annotations

import torch

from flce.engine import all_rows
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
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
from flce.gradients import grad_coefficients, upstream_scales
from flce.inputs import FlatInputs
from flce.semantics import Denominators, RowStats, RowTerms, extras, reduce_terms, row_terms


def forward(call: EngineCall, flat: FlatInputs, plan: TokenChunks, denoms: Denominators, *,
            grads_in_forward: GradTargets | None, backward_follows: bool) -> ForwardState:
    """Loss and extras; with grads_in_forward, the unscaled gradients too. backward_follows=False
    (inference) keeps nothing for a backward."""
    cfg, kernels, target = call.cfg, call.kernels, flat.target
    n_rows = target.shape[0]
    vocab = call.vocab(flat.weight.shape[0])
    acc = GradAccumulator(kernels, flat, cfg, grads_in_forward) if grads_in_forward else None
    deferred = backward_follows and acc is None
    keep = kept_rows(plan, n_rows) if deferred else 0
    if acc is None and keep == 0 and plan.stats_first is not None:
        return all_rows.forward(call, flat, plan.stats_first, denoms, keep_stats=deferred)

    # The per-row scales of the loss's terms (grad_output taken as 1; backward scales), once for all chunks.
    scales = None
    if acc:
        one = torch.ones((), dtype=denoms.z_loss.dtype, device=target.device)
        scales = upstream_scales(cfg, denoms, one, slice(0, n_rows), n_rows, flat.token_weight)
    vocab_here = flat.weight.shape[0]
    dtype = logits_dtype(flat.weight.dtype, cfg)
    saved = flat.hidden.new_empty(keep, vocab_here, dtype=dtype) if keep else None
    # Chunks that are not kept all write into one buffer (rows.WorkBuffer says why).
    buffer = WorkBuffer(flat.hidden, min(plan.tokens_per_chunk, n_rows), vocab_here, dtype) if keep < n_rows else None
    stats_per_chunk: list[RowStats] = []
    # Only the plain row kernel's chunks give their terms; the others' come from all rows' statistics at the
    # end (row_terms is row by row: one set of small launches a call instead of one a chunk).
    terms_per_chunk: list[RowTerms] = []
    for rows in chunk_bounds(n_rows, plan.tokens_per_chunk):
        t = target[rows]
        n = t.shape[0]
        grad = None
        # A kept chunk's logits are written straight into the saved buffer.
        kept = saved[rows] if saved is not None and rows.stop <= keep else None
        out = kept if kept is not None else buffer.view(n, vocab_here)
        if acc and plan.chunk_grad == EXPONENTIALS:
            # The statistics GEMM keeps exponentials whose row scaling is the gradient: no row kernel
            # passes over them, and the gradient GEMMs scale rows instead.
            stats, row_scale = kernels.gemm_exp_grad(flat.hidden[rows], flat.weight, t, cfg,
                                                     scales.cross_entropy[rows], out)
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
                grad = kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse, scales.cross_entropy[rows])
        elif call.plain:
            logits = chunk_logits(flat, rows, out=out)
            loss_rows, lse, grad = kernels.plain_loss(logits, t, cfg.ignore_index,
                                                      scales.cross_entropy[rows] if acc else None)
            stats = RowStats(lse=lse, target_z=lse - loss_rows)
            terms_per_chunk.append(RowTerms(loss_rows, None, t != cfg.ignore_index))
        else:
            logits = chunk_logits(flat, rows, out=out)
            stats = RowStats.from_partial(call.combined(kernels.row_stats(logits, t, cfg, call.vocab_offset)))
        if acc and not call.plain:
            coeffs = grad_coefficients(stats, t, cfg, vocab, scales.rows(rows), None, None)
            grad = kernels.full_grad_(logits, t, cfg, call.vocab_offset, stats.lse, coeffs)
        if acc:
            acc.add(grad, rows)
        stats_per_chunk.append(stats)
        del logits, grad, kept, out

    all_stats = concat_stats(stats_per_chunk, target)
    terms = (concat_terms(terms_per_chunk, target) if terms_per_chunk
             else row_terms(all_stats, target, cfg, vocab, flat.token_weight))
    if acc is None:
        state = forward_state(call, flat, all_stats, denoms, terms, keep_stats=deferred)
        state.saved_logits = saved
        return state
    loss, z_loss = reduce_terms(terms, cfg, denoms)
    return ForwardState(loss=loss, z_loss=z_loss, extras=extras(all_stats, terms, target, cfg, denoms, vocab),
                        denoms=denoms, grads=acc.result())


def backward(call: EngineCall, flat: FlatInputs, plan: TokenChunks, state: ForwardState, wanted: GradTargets,
             grad_loss: torch.Tensor, grad_logprobs: torch.Tensor | None,
             grad_entropy: torch.Tensor | None) -> Grads:
    """Deferred gradients from forward's row statistics, kept logits and the upstream gradients."""
    cfg, kernels, target = call.cfg, call.kernels, flat.target
    vocab = call.vocab(flat.weight.shape[0])
    assert state.stats is not None
    acc = GradAccumulator(kernels, flat, cfg, wanted)
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
        scales = upstream_scales(cfg, state.denoms, grad_loss, rows, t.shape[0], flat.token_weight)
        fused = plan.backward_grad == FUSED and logits is None
        coeffs = None
        if not call.plain or fused:
            coeffs = grad_coefficients(
                stats, t, cfg, vocab, scales,
                None if grad_logprobs is None else grad_logprobs.reshape(-1)[rows],
                None if grad_entropy is None else grad_entropy.reshape(-1)[rows],
            )
        if fused:
            return kernels.gemm_grad(flat.hidden[rows], flat.weight, flat.bias, t, cfg, call.vocab_offset,
                                     stats.lse, coeffs)
        if logits is None:
            logits = chunk_logits(flat, rows, out=recompute_buffer.view(t.shape[0], flat.weight.shape[0]))
        if coeffs is None:
            return kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse, scales.cross_entropy)
        return kernels.full_grad_(logits, t, cfg, call.vocab_offset, stats.lse, coeffs)

    bounds = chunk_bounds(target.shape[0], plan.tokens_per_chunk)
    if saved is not None:
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
