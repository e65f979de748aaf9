"""One distillation call as the engine runs it: the plan, the description planners read, the kernels'
protocol, and what forward leaves for backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import FlatPair
from flce.distillation.semantics import PairCoefficients, PairStats, PartialPairStats
from flce.engine.call import GradTargets
from flce.engine.choice import ROW_ALIGNMENT, CallChoice, MemoryPlan, rows_aligned
from flce.engine.memory import call_budget, tuned_chunk_rows
from flce.engine.plans import PlanRequest


@dataclass(frozen=True)
class DistillChunks:
    """Token chunks of ``tokens_per_chunk`` rows against the whole vocabulary, both heads' logits of a
    chunk in two buffers at once (flce.engine.distillation.schedule). ``fused_passes``: forward's passes
    over a chunk's logits (the statistics, JSD's second pass, the in-forward gradient) are one kernel
    (:class:`FusedPairPasses`), for an unsharded call only: a shard's statistics need the others' first.
    ``stats_in_gemm``: each head's logits GEMM also makes its softmax's statistics in its epilogue
    (flce.engine.kernels.FusedStatsGemm's gemm_row_stats, once per head; semantics.per_head_unfit says which losses
    allow it), so no pass over the logits is needed for them."""

    tokens_per_chunk: int
    fused_passes: bool = False
    stats_in_gemm: bool = False

    def __post_init__(self) -> None:
        if self.tokens_per_chunk < 1:
            raise ValueError(f"tokens_per_chunk={self.tokens_per_chunk}: expected a positive row count")

    def words(self, n_rows: int, training: bool, in_forward: bool) -> str:
        """What the plan runs, in words (explain's schedule line)."""
        chunks = -(-n_rows // self.tokens_per_chunk) if n_rows else 0
        words = [f"token chunks: {chunks} of up to {self.tokens_per_chunk} rows, both heads' logits of a chunk in "
                 "two buffers; both softmaxes' statistics" + (" from the logits GEMMs" if self.stats_in_gemm else "")]
        if self.fused_passes:
            words.append("forward's passes over a chunk's logits in one kernel")
        if in_forward:
            words.append("the gradients formed in the forward over the logits")
        elif training:
            words.append("each chunk's logits recomputed in backward for its gradients")
        return "; ".join(words)


def pair_logits_bytes_per_row(vocab: int, dtype: torch.dtype) -> int:
    """Bytes per token row of a chunk's two logits buffers, teacher's and student's, in the compute dtype
    (their gradients are written over them)."""
    return 2 * vocab * dtype.itemsize


def logits_bound_chunks(desc: DistillDescription, tuned_rows: object,
                        default_budget: int) -> tuple[DistillChunks, MemoryPlan]:
    """Rows per chunk of kernels whose only [n, V] memory is a chunk's two logits buffers (the reference's, whose
    temporaries stay within fixed row blocks, and Ascend's): the autotune cache's tokens_per_chunk
    (``tuned_rows``), else as many as the budget holds; an explicit memory_budget bounds either
    (flce.engine.memory.tuned_chunk_rows). ``default_budget``: the planner's DEFAULT_CHUNK_BUDGET."""
    per_row = pair_logits_bytes_per_row(desc.vocab, desc.dtype)
    budget, budget_from = call_budget(desc.cfg.memory_budget, default_budget, "DEFAULT_CHUNK_BUDGET")
    rows = tuned_chunk_rows(desc.n_rows, per_row, tuned_rows, budget)
    return DistillChunks(rows), MemoryPlan(budget, budget_from, min(rows, desc.n_rows) * per_row)


@dataclass(frozen=True)
class DistillDescription:
    """What a distillation planner reads of a call: sizes, dtype, biases, operand alignment, options and
    what follows (``request``); built from a real call, or from numbers (explain)."""

    n_rows: int
    student_hidden: int
    teacher_hidden: int
    vocab: int
    dtype: torch.dtype
    student_bias: bool
    teacher_bias: bool
    rows_aligned: bool
    cfg: DistillationConfig
    request: PlanRequest

    @staticmethod
    def of(pair: FlatPair, cfg: DistillationConfig, request: PlanRequest) -> DistillDescription:
        return DistillDescription(
            n_rows=pair.n_rows, student_hidden=pair.student_weight.shape[1],
            teacher_hidden=pair.teacher_weight.shape[1],
            vocab=pair.student_weight.shape[0], dtype=pair.student_weight.dtype,
            student_bias=pair.student_bias is not None, teacher_bias=pair.teacher_bias is not None,
            rows_aligned=all(rows_aligned(t) for t in (pair.student_hidden, pair.student_weight, pair.teacher_hidden,
                                                         pair.teacher_weight)),
            cfg=cfg.replace(process_group=None), request=request)

    @staticmethod
    def tuned(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> DistillDescription:
        """The call flce-autotune's distillation workload makes (flce.autotune.workload): JSD, a teacher of the
        student's hidden size, no bias, training."""
        return DistillDescription(n_rows=tokens, student_hidden=hidden, teacher_hidden=hidden, vocab=vocab,
                                  dtype=dtype, student_bias=False, teacher_bias=False, rows_aligned=True,
                                  cfg=DistillationConfig(), request=PlanRequest(training=True))

    @property
    def grads_in_forward(self) -> bool:
        """Training with a scalar loss (reduction "mean" or "sum"): the gradients are formed in forward."""
        return self.request.training and self.cfg.reduction != "none"

    @property
    def key(self) -> tuple:
        """What a planner's answer depends on, hashable (planners memoise records by it)."""
        options = tuple(getattr(self.cfg, f.name) for f in fields(self.cfg))
        return (self.n_rows, self.student_hidden, self.teacher_hidden, self.vocab, self.dtype, self.student_bias,
                self.teacher_bias, self.rows_aligned, self.request, options)

    def text(self) -> str:
        what = "training" if self.request.training else "no gradient"
        options = [f"{f.name}={getattr(self.cfg, f.name)}" for f in fields(self.cfg)
                   if f.name != "process_group" and getattr(self.cfg, f.name) != f.default]
        biases = [name for name, has in (("student bias", self.student_bias), ("teacher bias", self.teacher_bias))
                  if has]
        return (f"distillation, {str(self.dtype).removeprefix('torch.')} {self.n_rows} tokens x V {self.vocab}, "
                f"student H {self.student_hidden}, teacher H {self.teacher_hidden}"
                f"{''.join(', ' + b for b in biases)}, {what}{', vocabulary shard' if self.request.sharded else ''}"
                f"{f', operand rows not {ROW_ALIGNMENT}-byte aligned' if not self.rows_aligned else ''}; "
                f"options: loss={self.cfg.loss}{''.join(', ' + o for o in options if not o.startswith('loss='))}")


class PairKernels(Protocol):
    """The row kernels of a distillation chunk, beside flce.engine.kernels.RowKernels (whose matmul_,
    accumulate_fp32_, add_column_sums_, scale_ and count_tokens the schedule uses as they are). Logits are
    one chunk's raw ``[n, V]`` (this vocabulary shard's) in the compute dtype, teacher's and student's."""

    def pair_stats(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                   cfg: DistillationConfig, vocab_offset: int) -> PartialPairStats:
        """Both softmaxes' partial statistics (flce.distillation.semantics) in one pass over the logits."""

    def mixture_sums(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor, stats: PairStats,
                     cfg: DistillationConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """JSD's second pass: this shard's (KL(P || M), KL(Q || M)) sums per row, given both global lse."""

    def pair_grad_(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                   cfg: DistillationConfig, vocab_offset: int,
                   coeffs: PairCoefficients) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d loss / d u_s written over the student's logits and, with ``coeffs.teacher_scale``, d loss / d u_t
        over the teacher's (both returned; None for the teacher's otherwise), in one pass."""


class FusedPairPasses(Protocol):
    """A capability of a backend's pair kernels that a DistillChunks plan with ``fused_passes`` asks for."""

    def pair_passes_(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                     cfg: DistillationConfig, scale: torch.Tensor | None, teacher: bool,
                     known: PartialPairStats | None = None
                     ) -> tuple[PairStats, torch.Tensor | None, torch.Tensor | None]:
        """An unsharded chunk's statistics over the whole vocabulary (JSD's second-pass sums included) and, where
        ``scale`` (each row's d loss / d row loss, 0 on ignored rows) is given, the gradients written over the
        logits as pair_grad_ writes them (the teacher's too with ``teacher``): (stats, student's, teacher's; None
        where not written). ``known``: the whole vocabulary's statistics already made (the logits GEMMs'), so the
        kernel takes them instead of its first sweep."""


class GradSweepExpectation(Protocol):
    """A capability of a backend's pair kernels that a plan with ``stats_in_gemm`` asks for where forward KL's
    passes are one kernel each (a vocabulary shard, pair_passes=separate): its E_p[t - s] from the gradient's sweep."""

    def pair_grad_expectation_(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                               target: torch.Tensor | None, cfg: DistillationConfig, vocab_offset: int,
                               coeffs: PairCoefficients) -> tuple[torch.Tensor, torch.Tensor]:
        """pair_grad_ for forward KL's student gradient alone (the whole vocabulary's normalisers in ``coeffs``),
        also returning each row's sum p (t - s) over these columns ([n] fp32): summed over the shards, the loss's
        E_p[t - s]."""


@dataclass(frozen=True)
class PairSharding:
    """Vocabulary sharding of a tensor-parallel distillation call (both heads sharded alike): this rank's
    slice, the combine of partial statistics, the sum of JSD's second-pass rows, and the completion of a
    grad_hidden (each rank's covers its shard)."""

    vocab_offset: int
    combine: Callable[[PartialPairStats], PartialPairStats]
    sum_rows: Callable[[torch.Tensor], torch.Tensor]
    reduce_grad_hidden: Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class DistillCall:
    """Everything about a call that is not a tensor autograd tracks; ``kernels`` implement PairKernels and
    flce.engine.kernels.RowKernels."""

    kernels: object
    cfg: DistillationConfig
    plan: DistillChunks
    token_shape: torch.Size
    sharding: PairSharding | None = None
    choice: CallChoice | None = None

    @property
    def vocab_offset(self) -> int:
        return self.sharding.vocab_offset if self.sharding else 0

    def combined(self, partial: PartialPairStats) -> PartialPairStats:
        return self.sharding.combine(partial) if self.sharding else partial

    def summed(self, rows: torch.Tensor) -> torch.Tensor:
        return self.sharding.sum_rows(rows) if self.sharding else rows

    def complete_grad_hidden_(self, *grad_hiddens: torch.Tensor | None) -> None:
        """A shard's grad_hidden covers its vocabulary only: each one given (the student's, the teacher's) summed
        over the ranks in place; nothing without sharding."""
        if self.sharding is None:
            return
        for grad_hidden in grad_hiddens:
            if grad_hidden is not None and grad_hidden.numel():
                self.sharding.reduce_grad_hidden(grad_hidden)


@dataclass(frozen=True)
class PairGradTargets:
    """Which gradients a call produces: the student's inputs that require grad, and the teacher's where
    teacher_grad asks."""

    student: GradTargets
    teacher: GradTargets

    @property
    def any(self) -> bool:
        return self.student.any or self.teacher.any

