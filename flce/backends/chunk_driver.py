"""The token-chunk loop shared by every backend.

Each chunk of tokens gets its logits from one GEMM, a scan kernel turns them
into per-row statistics, a grad kernel overwrites them in place with
d loss / d logits, and two GEMMs turn that into grad_hidden rows and a
grad_weight contribution. Backends supply the scan and grad kernels
(:class:`ChunkKernels`); the loop, the reductions and the bookkeeping between
forward and backward are the same for all of them.

Two gradient schedules:

* **in forward** (scalar loss, no differentiable extras): the gradients are
  computed during the forward scan and scaled by grad_output in backward. Three
  GEMMs in total, nothing saved but the gradients themselves.
* **deferred** (reduction="none", logprobs or entropy): forward keeps per-row
  statistics; backward reuses the logits of the leading rows the plan allowed
  saving (all of them where they fit) and recomputes the other chunks' GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.semantics import (
    Denominators,
    GradCoefficients,
    PartialRowStats,
    RowStats,
    RowTerms,
    denominators,
    extras,
    grad_coefficients,
    reduce_terms,
    row_terms,
    statistics_dtype,
    upstream_scales,
)

StatsCombiner = Callable[[PartialRowStats], PartialRowStats]


class ChunkKernels(Protocol):
    """What a backend implements for one chunk of rows; logits are [n, V] in the compute dtype."""

    def plain_loss(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(per-row loss, per-row lse, grad) with loss and lse in fp32. With grad_scale [n], grad is
        (softmax - onehot) * grad_scale (0 on ignored rows) in the logits' dtype, written over
        logits where the kernel can; else None."""

    def plain_grad_(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, lse: torch.Tensor,
        grad_scale: torch.Tensor,
    ) -> torch.Tensor:
        """(softmax - onehot) * grad_scale given the row lse, written over logits (returned)."""

    def row_stats(
        self, logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
        into: PartialRowStats | None = None,
    ) -> PartialRowStats:
        """Scan raw logits u (capped and temperature-scaled inside) into partial row statistics.
        With ``into`` (statistics of the columns before vocab_offset), merge into it and return it."""

    def full_grad_(
        self, logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
        lse: torch.Tensor, coeffs: GradCoefficients,
    ) -> torch.Tensor:
        """d loss / d u for raw logits u (semantics.py's formula, chained through cap and T),
        written over logits (returned)."""

    def gemm_row_stats(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        cfg: LCEConfig, vocab_offset: int, logits_out: torch.Tensor | None = None,
    ) -> PartialRowStats:
        """Partial row statistics of the logits hidden @ weight.T + bias from one fused GEMM, which
        also writes the logits into ``logits_out`` when given and materialises nothing otherwise.
        Called only when the plan sets ``fused_stats``."""

    def gemm_grad(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        cfg: LCEConfig, vocab_offset: int, lse: torch.Tensor, coeffs: GradCoefficients,
    ) -> torch.Tensor:
        """d loss / d u of the logits hidden @ weight.T + bias from one GEMM whose epilogue applies
        semantics.py's formula, so the logits never reach memory. Called only when the plan sets
        ``fused_grad``."""

    def accumulate_fp32_(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """acc += a @ b with fp32 accumulation, for low-precision a and b, without a full-size temporary."""

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """tensor *= scale (a 0-d device tensor) in place, without a host sync; returns tensor.
        The usual scale is exactly 1 (loss.backward()), which a kernel may detect on the device
        and skip the pass over a V x H gradient."""


@dataclass(frozen=True)
class ChunkPlan:
    tokens_per_chunk: int
    # Deferred schedule only: forward keeps the logits of this many leading rows (0, a multiple of
    # tokens_per_chunk, or all rows) in one buffer; backward turns them into the gradient in place
    # and runs the two gradient GEMMs over all of them at once (one write of the weight gradient
    # instead of a read-modify-write per chunk), then recomputes the remaining chunks.
    saved_rows: int = 0
    # Inference only (no backward follows): scan all rows at once, the vocabulary in blocks of this
    # many columns. Nothing accumulates across blocks but [tokens] statistics, so blocks can be small
    # while every GEMM keeps all rows (full speed where a few hundred token rows would not be).
    vocab_block: int | None = None
    # Statistics from the fused GEMM (kernels.gemm_row_stats). fused_stats: a forward that keeps no
    # logits (inference, or the deferred schedule without saved logits) runs it over all rows at
    # once, one GEMM's work and no logits. fused_logits: the schedules that need each chunk's logits
    # (the in-forward gradient, saved logits) run it per chunk, writing the logits as it goes.
    fused_stats: bool = False
    fused_logits: bool = False
    # Small budgets (the lean mode): gradients by vocabulary blocks of this many columns over all
    # rows, after the statistics of all rows (fused or scanned). Each block's weight gradient is
    # written once, where token chunks would read-modify-write all of it once per chunk; the price
    # is one more GEMM (the logits are recomputed) and a read-modify-write of grad_hidden per block.
    grad_vocab_block: int | None = None
    # Schedules that recompute logits in backward take d loss / d u from one GEMM with the gradient
    # in its epilogue (kernels.gemm_grad) instead of a GEMM and a row kernel over the logits.
    fused_grad: bool = False


@dataclass
class GradTargets:
    """Which gradients to produce (inputs that do not require grad are skipped)."""

    hidden: bool
    weight: bool
    bias: bool

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


@dataclass
class ForwardState:
    """What backward needs, and the outputs of forward."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    extras: dict
    denoms: Denominators
    stats: list[RowStats] = field(default_factory=list)  # deferred schedule, one per chunk
    saved_logits: torch.Tensor | None = None  # deferred schedule: [plan.saved_rows, V], leading rows
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None


@dataclass
class Sharding:
    """Vocabulary sharding of a tensor-parallel call: this rank's slice, the combine step, and
    the reduction that completes grad_hidden (each rank's covers its shard only), which the
    autograd function applies once, in backward."""

    vocab_offset: int
    global_vocab: int
    combine: StatsCombiner
    reduce_grad_hidden: Callable[[torch.Tensor], None]


def grads_in_forward_allowed(cfg: LCEConfig) -> bool:
    """The in-forward schedule needs a scalar loss as the only differentiable output."""
    return cfg.reduction != "none" and not (cfg.return_logprobs or cfg.return_entropy)


def chunk_bounds(n_rows: int, tokens_per_chunk: int) -> list[slice]:
    step = max(1, tokens_per_chunk)
    return [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


class _GradAccumulator:
    """Turns each chunk's grad-logits into grad_hidden rows and grad_weight / grad_bias sums."""

    def __init__(self, kernels: ChunkKernels, flat: FlatInputs, cfg: LCEConfig, wanted: GradTargets):
        x, w = flat.hidden, flat.weight
        self.kernels, self.flat, self.wanted = kernels, flat, wanted
        self.grad_hidden = torch.empty_like(x) if wanted.hidden else None
        fp32_acc = cfg.accum_dtype == torch.float32 and w.dtype != torch.float32
        self.weight_acc = None
        self.weight_written = False
        if wanted.weight:
            # fp32 accumulators are added into from the first chunk on; a same-dtype gradient is
            # written by the first chunk's GEMM, which saves a V x H zero fill.
            alloc = torch.zeros if fp32_acc else torch.empty
            self.weight_acc = alloc(w.shape, dtype=torch.float32 if fp32_acc else w.dtype, device=w.device)
        self.bias_acc = (
            torch.zeros(w.shape[0], dtype=statistics_dtype(w.dtype), device=w.device) if wanted.bias else None
        )

    def add(self, grad_logits: torch.Tensor, rows: slice) -> None:
        x_rows = self.flat.hidden[rows]
        if self.grad_hidden is not None:
            torch.mm(grad_logits, self.flat.weight, out=self.grad_hidden[rows])
        if self.weight_acc is not None:
            if self.weight_acc.dtype != grad_logits.dtype:
                self.kernels.accumulate_fp32_(self.weight_acc, grad_logits.t(), x_rows)
            elif self.weight_written:
                self.weight_acc.addmm_(grad_logits.t(), x_rows)
            else:
                torch.mm(grad_logits.t(), x_rows, out=self.weight_acc)
                self.weight_written = True
        if self.bias_acc is not None:
            self.bias_acc += grad_logits.sum(0, dtype=self.bias_acc.dtype)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        w = self.flat.weight
        if self.weight_acc is not None and self.weight_acc.dtype == w.dtype and not self.weight_written:
            self.weight_acc.zero_()  # no rows at all
        grad_weight = None if self.weight_acc is None else self.weight_acc.to(w.dtype)
        grad_bias = None
        if self.bias_acc is not None:
            assert self.flat.bias is not None
            grad_bias = self.bias_acc.to(self.flat.bias.dtype)
        return self.grad_hidden, grad_weight, grad_bias


def chunk_logits(flat: FlatInputs, rows: slice, out: torch.Tensor | None = None) -> torch.Tensor:
    x_rows = flat.hidden[rows]
    if flat.bias is None:
        return torch.mm(x_rows, flat.weight.t(), out=out)
    return torch.addmm(flat.bias, x_rows, flat.weight.t(), out=out)


def run_forward(
    kernels: ChunkKernels,
    flat: FlatInputs,
    cfg: LCEConfig,
    plan: ChunkPlan,
    plain: bool,
    grads_in_forward: GradTargets | None,
    sharding: Sharding | None = None,
    backward_follows: bool = True,
) -> ForwardState:
    """Loss and extras; with grads_in_forward, the unscaled gradients too. backward_follows=False
    (inference) never keeps logits for a backward."""
    target = flat.target
    n_rows = target.shape[0]
    vocab = sharding.global_vocab if sharding else flat.weight.shape[0]
    vocab_offset = sharding.vocab_offset if sharding else 0
    denoms = denominators(target, cfg, statistics_dtype(flat.weight.dtype))
    one = torch.ones((), dtype=denoms.z_loss.dtype, device=target.device)
    vocab_blocks = plan.grad_vocab_block is not None and sharding is None and backward_follows
    if vocab_blocks and grads_in_forward is not None:
        stats = _all_row_stats(kernels, flat, cfg, plan)
        terms = row_terms(stats, target, cfg, vocab)
        loss, z_loss = reduce_terms(terms, cfg, denoms)
        g_ce, g_z = upstream_scales(cfg, denoms, one, slice(None), n_rows)
        grads = vocab_block_gradients(kernels, flat, cfg, plan, stats,
                                      grad_coefficients(stats, target, cfg, vocab, g_ce, g_z, None, None),
                                      grads_in_forward)
        return ForwardState(loss=loss, z_loss=z_loss, extras=extras(stats, terms, target, cfg, denoms),
                            denoms=denoms, grads=grads)

    acc = _GradAccumulator(kernels, flat, cfg, grads_in_forward) if grads_in_forward else None
    kept_rows = min(plan.saved_rows, n_rows) if backward_follows and acc is None else 0
    if kept_rows < n_rows:
        kept_rows -= kept_rows % max(1, plan.tokens_per_chunk)  # whole chunks only
    keep_logits = kept_rows > 0
    saved = flat.hidden.new_empty(kept_rows, flat.weight.shape[0]) if keep_logits else None
    stats_per_chunk: list[RowStats] = []
    terms_per_chunk: list[RowTerms] = []

    if (plan.fused_stats or vocab_blocks) and acc is None and not keep_logits:
        if plan.fused_stats:
            partial = kernels.gemm_row_stats(flat.hidden, flat.weight, flat.bias, target, cfg, vocab_offset)
        else:
            partial = scan_vocab_blocks(kernels, flat.hidden, flat.weight, flat.bias, target, cfg, vocab_offset,
                                        plan.grad_vocab_block)
        if sharding:
            partial = sharding.combine(partial)
        stats = RowStats.from_partial(partial)
        terms = row_terms(stats, target, cfg, vocab)
        loss, z_loss = reduce_terms(terms, cfg, denoms)
        per_chunk = [_slice_stats(stats, rows) for rows in chunk_bounds(n_rows, plan.tokens_per_chunk)]
        return ForwardState(loss=loss, z_loss=z_loss, extras=extras(stats, terms, target, cfg, denoms),
                            denoms=denoms, stats=per_chunk if backward_follows else [])

    if not backward_follows and plan.vocab_block and sharding is None and n_rows:
        stats = _scan_vocab_blocks(kernels, flat, cfg, plan.vocab_block)
        terms = row_terms(stats, target, cfg, vocab)
        loss, z_loss = reduce_terms(terms, cfg, denoms)
        return ForwardState(loss=loss, z_loss=z_loss, extras=extras(stats, terms, target, cfg, denoms),
                            denoms=denoms)

    for rows in chunk_bounds(n_rows, plan.tokens_per_chunk):
        t = target[rows]
        n = t.shape[0]
        grad = None
        # A kept chunk's logits are written straight into the saved buffer.
        kept = saved[rows] if saved is not None and rows.stop <= kept_rows else None
        if plan.fused_logits:
            logits = kept if kept is not None else flat.hidden.new_empty(n, flat.weight.shape[0])
            partial = kernels.gemm_row_stats(flat.hidden[rows], flat.weight, flat.bias, t, cfg, vocab_offset, logits)
            if sharding:
                partial = sharding.combine(partial)
            stats = RowStats.from_partial(partial)
            terms_per_chunk.append(row_terms(stats, t, cfg, vocab))
            if acc and plain:
                grad_scale = upstream_scales(cfg, denoms, one, rows, n)[0]
                grad = kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse, grad_scale)
        elif plain:
            logits = chunk_logits(flat, rows, out=kept)
            grad_scale = upstream_scales(cfg, denoms, one, rows, n)[0] if acc else None
            loss_rows, lse, grad = kernels.plain_loss(logits, t, cfg.ignore_index, grad_scale)
            stats = RowStats(lse=lse, target_z=lse - loss_rows)
            terms_per_chunk.append(RowTerms(loss_rows, torch.zeros_like(loss_rows), t != cfg.ignore_index))
        else:
            logits = chunk_logits(flat, rows, out=kept)
            partial = kernels.row_stats(logits, t, cfg, vocab_offset)
            if sharding:
                partial = sharding.combine(partial)
            stats = RowStats.from_partial(partial)
            terms_per_chunk.append(row_terms(stats, t, cfg, vocab))
        if acc and not plain:
            g_ce, g_z = upstream_scales(cfg, denoms, one, rows, n)
            coeffs = grad_coefficients(stats, t, cfg, vocab, g_ce, g_z, None, None)
            grad = kernels.full_grad_(logits, t, cfg, vocab_offset, stats.lse, coeffs)
        if acc:
            acc.add(grad, rows)
        stats_per_chunk.append(stats)
        # Drop this chunk's logits before the next chunk's GEMM allocates its own.
        del logits, grad, kept

    terms = _concat_terms(terms_per_chunk, target)
    loss, z_loss = reduce_terms(terms, cfg, denoms)
    all_stats = _concat_stats(stats_per_chunk, target)
    return ForwardState(
        loss=loss,
        z_loss=z_loss,
        extras=extras(all_stats, terms, target, cfg, denoms),
        denoms=denoms,
        stats=[] if acc else stats_per_chunk,
        saved_logits=saved,
        grads=acc.result() if acc else None,
    )


def _scan_vocab_blocks(kernels: ChunkKernels, flat: FlatInputs, cfg: LCEConfig, block: int) -> RowStats:
    """Row statistics over all rows, the vocabulary scanned in column blocks."""
    return RowStats.from_partial(scan_vocab_blocks(kernels, flat.hidden, flat.weight, flat.bias, flat.target, cfg,
                                                   0, block))


def scan_vocab_blocks(
    kernels: ChunkKernels, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    target: torch.Tensor, cfg: LCEConfig, vocab_offset: int, block: int,
) -> PartialRowStats:
    """Partial statistics of hidden @ weight.T + bias, one GEMM and one row scan per column block."""
    running = None
    for start in range(0, weight.shape[0], block):
        cols = slice(start, start + block)
        if bias is None:
            logits = torch.mm(hidden, weight[cols].t())
        else:
            logits = torch.addmm(bias[cols], hidden, weight[cols].t())
        running = kernels.row_stats(logits, target, cfg, vocab_offset + start, into=running)
        del logits
    assert running is not None
    return running


def _all_row_stats(kernels: ChunkKernels, flat: FlatInputs, cfg: LCEConfig, plan: ChunkPlan) -> RowStats:
    if plan.fused_stats:
        partial = kernels.gemm_row_stats(flat.hidden, flat.weight, flat.bias, flat.target, cfg, 0)
    else:
        assert plan.grad_vocab_block is not None
        partial = scan_vocab_blocks(kernels, flat.hidden, flat.weight, flat.bias, flat.target, cfg, 0,
                                    plan.grad_vocab_block)
    return RowStats.from_partial(partial)


def vocab_block_gradients(
    kernels: ChunkKernels, flat: FlatInputs, cfg: LCEConfig, plan: ChunkPlan, stats: RowStats,
    coeffs: GradCoefficients, wanted: GradTargets,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of all rows by vocabulary blocks: each block's logits are recomputed by one GEMM
    and turned into d loss / d u in place; that block's rows of grad_weight (and grad_bias) are
    written once, and grad_hidden accumulates over the blocks (in fp32 when accum_dtype asks)."""
    x, w, target = flat.hidden, flat.weight, flat.target
    fp32_acc = cfg.accum_dtype == torch.float32 and w.dtype != torch.float32
    grad_hidden = None
    if wanted.hidden:
        grad_hidden = torch.zeros(x.shape, dtype=torch.float32 if fp32_acc else x.dtype, device=x.device)
    grad_weight = None
    if wanted.weight:
        grad_weight = (torch.zeros if fp32_acc else torch.empty)(
            w.shape, dtype=torch.float32 if fp32_acc else w.dtype, device=w.device)
    grad_bias = torch.empty_like(flat.bias) if wanted.bias and flat.bias is not None else None
    assert plan.grad_vocab_block is not None
    for start in range(0, w.shape[0], plan.grad_vocab_block):
        cols = slice(start, start + plan.grad_vocab_block)
        bias = None if flat.bias is None else flat.bias[cols]
        if plan.fused_grad:
            grad = kernels.gemm_grad(x, w[cols], bias, target, cfg, start, stats.lse, coeffs)
        else:
            logits = torch.mm(x, w[cols].t()) if bias is None else torch.addmm(bias, x, w[cols].t())
            grad = kernels.full_grad_(logits, target, cfg, start, stats.lse, coeffs)
            del logits
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
        if grad_bias is not None:
            grad_bias[cols] = grad.sum(0, dtype=statistics_dtype(grad.dtype))
        del grad
    return (None if grad_hidden is None else grad_hidden.to(x.dtype),
            None if grad_weight is None else grad_weight.to(w.dtype), grad_bias)


def _slice_stats(stats: RowStats, rows: slice) -> RowStats:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return RowStats(lse=stats.lse[rows], target_z=stats.target_z[rows], expected_z=part(stats.expected_z),
                    weighted_sum_z=part(stats.weighted_sum_z), argmax=part(stats.argmax))


def run_backward(
    kernels: ChunkKernels,
    flat: FlatInputs,
    cfg: LCEConfig,
    plan: ChunkPlan,
    plain: bool,
    state: ForwardState,
    wanted: GradTargets,
    grad_loss: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    sharding: Sharding | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Deferred schedule: gradients from the saved row statistics and the real upstream grads."""
    target = flat.target
    vocab = sharding.global_vocab if sharding else flat.weight.shape[0]
    vocab_offset = sharding.vocab_offset if sharding else 0
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=state.denoms.z_loss.dtype, device=target.device)
    saved = state.saved_logits
    if plan.grad_vocab_block is not None and sharding is None and saved is None:
        stats = _concat_stats(state.stats, target)
        n_rows = target.shape[0]
        g_ce, g_z = upstream_scales(cfg, state.denoms, grad_loss, slice(None), n_rows)
        coeffs = grad_coefficients(
            stats, target, cfg, vocab, g_ce, g_z,
            None if grad_logprobs is None else grad_logprobs.reshape(-1),
            None if grad_entropy is None else grad_entropy.reshape(-1))
        return vocab_block_gradients(kernels, flat, cfg, plan, stats, coeffs, wanted)
    acc = _GradAccumulator(kernels, flat, cfg, wanted)
    # The saved logits are overwritten by the grad kernels: a second backward must recompute.
    state.saved_logits = None
    kept_rows = 0 if saved is None else saved.shape[0]

    def chunk_grad(k: int, rows: slice, logits: torch.Tensor | None) -> torch.Tensor:
        """d loss / d u of one chunk, over its logits (recomputed where None)."""
        t = target[rows]
        stats = state.stats[k]
        g_ce, g_z = upstream_scales(cfg, state.denoms, grad_loss, rows, t.shape[0])
        coeffs = None
        if not plain or (plan.fused_grad and logits is None):
            coeffs = grad_coefficients(
                stats, t, cfg, vocab, g_ce, g_z,
                None if grad_logprobs is None else grad_logprobs.reshape(-1)[rows],
                None if grad_entropy is None else grad_entropy.reshape(-1)[rows],
            )
        if plan.fused_grad and logits is None:
            assert coeffs is not None
            return kernels.gemm_grad(flat.hidden[rows], flat.weight, flat.bias, t, cfg, vocab_offset, stats.lse,
                                     coeffs)
        if logits is None:
            logits = chunk_logits(flat, rows)
        if coeffs is None:
            return kernels.plain_grad_(logits, t, cfg.ignore_index, stats.lse, g_ce)
        return kernels.full_grad_(logits, t, cfg, vocab_offset, stats.lse, coeffs)

    bounds = chunk_bounds(target.shape[0], plan.tokens_per_chunk)
    if saved is not None:
        # The kept rows: the row kernels chunk by chunk over the buffer (their temporaries stay
        # chunk-sized), the two gradient GEMMs once over all of them.
        for k, rows in enumerate(bounds):
            if rows.stop <= kept_rows:
                chunk_grad(k, rows, saved[rows])  # in place
        acc.add(saved, slice(0, kept_rows))
        del saved
    for k, rows in enumerate(bounds):
        if rows.stop > kept_rows:
            grad = chunk_grad(k, rows, None)
            acc.add(grad, rows)
            del grad
    return acc.result()


def _concat_terms(chunks: list[RowTerms], target: torch.Tensor) -> RowTerms:
    if not chunks:
        empty = torch.zeros(0, dtype=torch.float32, device=target.device)
        return RowTerms(empty, empty, torch.zeros(0, dtype=torch.bool, device=target.device))
    return RowTerms(
        torch.cat([c.cross_entropy for c in chunks]),
        torch.cat([c.z_loss for c in chunks]),
        torch.cat([c.valid for c in chunks]),
    )


def _concat_stats(chunks: list[RowStats], target: torch.Tensor) -> RowStats:
    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(c, name) for c in chunks]
        if not parts:
            dtype = torch.int64 if name == "argmax" else torch.float32
            return torch.zeros(0, dtype=dtype, device=target.device)
        return None if parts[0] is None else torch.cat(parts)

    return RowStats(
        lse=cat("lse"), target_z=cat("target_z"), expected_z=cat("expected_z"),
        weighted_sum_z=cat("weighted_sum_z"), argmax=cat("argmax"),
    )
