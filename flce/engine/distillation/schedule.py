"""Schedule DistillChunks: the tokens in chunks, each chunk against the whole vocabulary of both heads.

Forward, chunk by chunk:

1. two GEMMs write the chunk's teacher and student logits into two bounded buffers (reused by every chunk);
2. one row-kernel pass makes both softmaxes' statistics (and, with a vocabulary shard, one exchange makes
   them global); JSD adds its second pass, whose sums a second exchange completes;
3. with a scalar loss as the only output (reduction "mean" or "sum") the gradients are formed here: one
   more pass writes d loss / d u_s over the student's logits (and d loss / d u_t over the teacher's where
   the teacher takes one), and two GEMMs turn it into grad_hidden rows and a grad_weight contribution
   (flce.engine.rows.GradAccumulator). Backward then only scales them by grad_output.

A plan with ``fused_passes`` (an unsharded call, kernels with FusedPairPasses) makes steps 2 and 3's passes
one kernel, each row's sweeps back to back. A plan with ``stats_in_gemm`` takes step 2's first pass from the
logits GEMMs' epilogues instead (each head's statistics as cross-entropy's; semantics.pair_stats_of_heads);
forward KL's E_p[t - s] then comes from step 3's sweep (one kernel a pass: GradSweepExpectation), reverse KL's
E_q[s - t] from the student's GEMM, whose epilogue reads the teacher's logits the GEMM before wrote.

With return_entropy the student's statistics (step 2's pass, or its GEMM's epilogue) also sum exp(d) d, which
makes each row's entropy (flce.distillation.semantics): no pass or GEMM more.

Four GEMMs per chunk in all: the teacher's logits, the student's, and the student's two gradient products.
With reduction="none" each row's upstream gradient arrives in backward: forward keeps the rows' statistics
([k, N], no logits), and backward recomputes each chunk's two logits and forms its gradients (six GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.config import LCEConfig
from flce.distillation.semantics import (
    PairStats,
    PartialPairStats,
    head_config,
    needs_cross,
    pair_coefficients,
    pair_stats_of_heads,
    reduced,
    row_losses,
    row_scales,
    student_reads_teacher,
    with_mixture_sums,
)
from flce.engine.call import Grads
from flce.engine.distillation.call import DistillCall, PairGradTargets
from flce.engine.plans import chunk_bounds
from flce.engine.rows import GradAccumulator, WorkBuffer, gemm_logits
from flce.semantics import TokenCounts, statistics_dtype

PairGrads = tuple[Grads, Grads]  # (student's, teacher's) (hidden, weight, bias) gradients


@dataclass
class DistillState:
    """Forward's loss, the counted rows (the mean's divisor) and what backward needs: the in-forward
    gradients, or the rows' statistics for a deferred backward."""

    loss: torch.Tensor
    count: torch.Tensor
    grads: PairGrads | None = None
    stats: torch.Tensor | None = None  # [k, N]: PairStats.stacked() of every row
    entropy: torch.Tensor | None = None  # [N]: the student's entropy, 0 on ignored rows (cfg.return_entropy)


def counted_rows(call: DistillCall, pair, dtype: torch.dtype) -> TokenCounts:
    """The rows a mean divides by: those whose target is not ignored (all without a target); on an
    accelerator the targets' range is asserted on the device here, in the call's first pass over them."""
    target = pair.target
    if target is None:
        count = torch.full((), pair.n_rows, dtype=dtype, device=pair.student_hidden.device)
        return TokenCounts(count, count > 0, count.clamp(min=1), torch.zeros((), dtype=dtype, device=count.device))
    vocab = None if call.sharding else pair.student_weight.shape[0]
    return call.kernels.count_tokens(target, call.cfg.ignore_index, dtype, vocab)


def chunk_statistics(call: DistillCall, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                     target: torch.Tensor | None, partial: PartialPairStats | None = None) -> PairStats:
    """Both softmaxes' statistics of a chunk over the whole vocabulary (all shards'), JSD's second pass included;
    ``partial``: this shard's first-pass statistics where the logits GEMMs made them."""
    cfg, kernels = call.cfg, call.kernels
    if partial is None:
        partial = kernels.pair_stats(teacher_logits, student_logits, target, cfg, call.vocab_offset)
    stats = PairStats.from_partial(call.combined(partial), cfg)
    if cfg.soft and cfg.loss == "jsd":
        teacher_kl, student_kl = kernels.mixture_sums(teacher_logits, student_logits, stats, cfg)
        teacher_kl, student_kl = call.summed(torch.stack([teacher_kl, student_kl])).unbind(0)
        stats = with_mixture_sums(stats, teacher_kl, student_kl)
    return stats


class _PairLogits:
    """The two chunk-sized buffers every chunk writes its logits into (rows.WorkBuffer says why one each)."""

    def __init__(self, pair, rows: int):
        vocab = pair.student_weight.shape[0]
        self.pair, self.vocab = pair, vocab
        self.teacher = WorkBuffer(pair.teacher_hidden, rows, vocab, pair.teacher_weight.dtype)
        self.student = WorkBuffer(pair.student_hidden, rows, vocab, pair.student_weight.dtype)

    def of(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        p, n, v = self.pair, rows.stop - rows.start, self.vocab
        teacher = gemm_logits(p.teacher_hidden[rows], p.teacher_weight, p.teacher_bias, self.teacher.view(n, v))
        student = gemm_logits(p.student_hidden[rows], p.student_weight, p.student_bias, self.student.view(n, v))
        return teacher, student


class _PairLogitsWithStats(_PairLogits):
    """The same buffers, written by GEMMs whose epilogue also makes each head's softmax statistics (a plan with
    stats_in_gemm): the call's per-head options and, without targets, the one the GEMMs look for, made once."""

    def __init__(self, call: DistillCall, pair, rows: int):
        super().__init__(pair, rows)
        self.call, self.head_cfg, self.student_cfg = call, head_config(call.cfg), head_config(call.cfg, student=True)
        self.reads_teacher = student_reads_teacher(call.cfg)  # reverse KL's E_q[s - t], the teacher's chunk written
        # The GEMMs look for a target: without one, a column they never find (its target_z is not used).
        self.no_target = None if pair.target is not None else torch.full(
            (rows,), call.cfg.ignore_index, dtype=torch.long, device=pair.student_hidden.device)

    def with_stats(self, rows: slice,
                   target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, PartialPairStats]:
        """The chunk's logits and this shard's statistics of both softmaxes, each head's from its GEMM's epilogue."""
        p, n, v, call = self.pair, rows.stop - rows.start, self.vocab, self.call
        if target is None:
            target = self.no_target[:n]
        teacher, student = self.teacher.view(n, v), self.student.view(n, v)
        teacher_stats = call.kernels.gemm_row_stats(p.teacher_hidden[rows], p.teacher_weight, p.teacher_bias, target,
                                                    self.head_cfg, call.vocab_offset, logits_out=teacher)
        student_stats = call.kernels.gemm_row_stats(p.student_hidden[rows], p.student_weight, p.student_bias, target,
                                                    self.student_cfg, call.vocab_offset, logits_out=student,
                                                    against=teacher if self.reads_teacher else None)
        return teacher, student, pair_stats_of_heads(teacher_stats, student_stats, call.cfg)


class _Accumulators:
    """The student's and (where asked) the teacher's gradient accumulators: G @ W and G.T @ x per chunk."""

    def __init__(self, call: DistillCall, pair, wanted: PairGradTargets):
        # The default options: gradients accumulated in the weights' dtype, as cross-entropy's default.
        cfg, kernels = LCEConfig(), call.kernels
        self.student = GradAccumulator(kernels, pair.student(), cfg, wanted.student) if wanted.student.any else None
        self.teacher = GradAccumulator(kernels, pair.teacher(), cfg, wanted.teacher) if wanted.teacher.any else None

    def add(self, student_grad: torch.Tensor, teacher_grad: torch.Tensor | None, rows: slice) -> None:
        if self.student is not None:
            self.student.add(student_grad, rows)
        if self.teacher is not None:
            self.teacher.add(teacher_grad, rows)

    def result(self) -> PairGrads:
        none = (None, None, None)
        return (none if self.student is None else self.student.result(),
                none if self.teacher is None else self.teacher.result())


def _chunk_logits(call: DistillCall, logits: _PairLogits, rows: slice, rows_target: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, PartialPairStats | None]:
    """A chunk's two logits, and this shard's statistics of both softmaxes where the plan's GEMMs make them
    (``rows_target``: the chunk's targets)."""
    if call.plan.stats_in_gemm:
        return logits.with_stats(rows, rows_target)
    return (*logits.of(rows), None)


def forward(call: DistillCall, pair, grads_in_forward: PairGradTargets | None, keep_stats: bool) -> DistillState:
    """The loss; with grads_in_forward, the unscaled gradients too; keep_stats: a deferred backward follows."""
    cfg, kernels = call.cfg, call.kernels
    n_rows = pair.n_rows
    target = pair.target
    rows_per_chunk = min(call.plan.tokens_per_chunk, n_rows)
    logits = (_PairLogitsWithStats(call, pair, rows_per_chunk) if call.plan.stats_in_gemm
              else _PairLogits(pair, rows_per_chunk))
    bounds = chunk_bounds(n_rows, call.plan.tokens_per_chunk)
    # The first chunk's logits GEMMs go first: the host's bookkeeping below (the token count, the row scales, the
    # accumulators; about half a millisecond of Python) is then launched while they run, not while the GPU waits.
    first = _chunk_logits(call, logits, bounds[0], None if target is None else target[bounds[0]]) if bounds else None
    dtype = statistics_dtype(pair.student_weight.dtype)
    counts = counted_rows(call, pair, dtype)
    valid = None if target is None else target != cfg.ignore_index
    acc = _Accumulators(call, pair, grads_in_forward) if grads_in_forward is not None else None
    scale = None
    if acc is not None:
        one = torch.ones((), dtype=dtype, device=pair.student_hidden.device)
        scale = row_scales(one, counts.count, valid, n_rows, cfg)
    losses, kept, entropies = [], [], []
    fused = call.plan.fused_passes and call.sharding is None
    for rows in bounds:
        rows_target = None if target is None else target[rows]
        teacher_logits, student_logits, partial = first or _chunk_logits(call, logits, rows, rows_target)
        first = None
        teacher = acc is not None and acc.teacher is not None
        if fused:  # the plan's FusedPairPasses: the statistics and the gradients in one kernel
            stats, student_grad, teacher_grad = kernels.pair_passes_(
                teacher_logits, student_logits, rows_target, cfg, None if acc is None else scale[rows], teacher,
                partial)
        else:
            stats = chunk_statistics(call, teacher_logits, student_logits, rows_target, partial)
            if acc is not None:
                coeffs = pair_coefficients(stats, scale[rows], cfg, teacher=teacher)
                if needs_cross(cfg) and stats.cross_mean is None:  # forward KL on the GEMMs' statistics
                    student_grad, expectation = kernels.pair_grad_expectation_(
                        teacher_logits, student_logits, rows_target, cfg, call.vocab_offset, coeffs)
                    teacher_grad, stats.cross_mean = None, call.summed(expectation)
                else:
                    student_grad, teacher_grad = kernels.pair_grad_(teacher_logits, student_logits, rows_target,
                                                                    cfg, call.vocab_offset, coeffs)
        losses.append(row_losses(stats, None if valid is None else valid[rows], cfg))
        if cfg.return_entropy:
            entropies.append(stats.student_entropy)
        if acc is not None:
            acc.add(student_grad, teacher_grad, rows)
        elif keep_stats:
            kept.append(stats.stacked())
        del teacher_logits, student_logits
    row_loss = _joined(losses, n_rows, dtype, pair.student_hidden.device)
    entropy = None
    if cfg.return_entropy:  # 0 where the target is ignored
        entropy = _joined(entropies, n_rows, dtype, pair.student_hidden.device)
        entropy = entropy if valid is None else torch.where(valid, entropy, 0.0)
    return DistillState(loss=reduced(row_loss, counts.count, cfg), count=counts.count,
                        grads=None if acc is None else acc.result(),
                        stats=torch.cat(kept, dim=1) if keep_stats and kept else None, entropy=entropy)


def backward(call: DistillCall, pair, state: DistillState, wanted: PairGradTargets,
             grad_loss: torch.Tensor) -> PairGrads:
    """Deferred gradients (reduction "none"): each chunk's logits recomputed, its gradients from the
    statistics forward kept and each row's upstream gradient."""
    cfg, kernels = call.cfg, call.kernels
    n_rows = pair.n_rows
    target = pair.target
    valid = None if target is None else target != cfg.ignore_index
    acc = _Accumulators(call, pair, wanted)
    if n_rows:
        stats = PairStats.unstacked(state.stats, cfg)
        scale = row_scales(grad_loss, state.count, valid, n_rows, cfg)
        logits = _PairLogits(pair, min(call.plan.tokens_per_chunk, n_rows))
        for rows in chunk_bounds(n_rows, call.plan.tokens_per_chunk):
            teacher_logits, student_logits = logits.of(rows)
            coeffs = pair_coefficients(stats.rows(rows), scale[rows], cfg, teacher=acc.teacher is not None)
            student_grad, teacher_grad = kernels.pair_grad_(teacher_logits, student_logits,
                                                            None if target is None else target[rows], cfg,
                                                            call.vocab_offset, coeffs)
            acc.add(student_grad, teacher_grad, rows)
            del teacher_logits, student_logits
    return acc.result()


def _joined(parts: list[torch.Tensor], n_rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros(n_rows, dtype=dtype, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)

