"""The CUDA backend's linear distillation: launchers of distill_kernels.py (row_ops.py's counterparts) and the pair
kernels the engine's DistillChunks schedule calls, launched as the choice (choice.py choose_distillation) says.

Each chunk's two logits buffers come from cuBLAS (flce.engine.rows.gemm_logits); the row kernels read them in the
compute dtype with fp32 arithmetic and write the gradients over them, so a chunk holds nothing [n, V] beyond them.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from flce.backends.cuda import distill_kernels as k
from flce.backends.cuda.configs import LaunchParams
from flce.backends.cuda.families import KernelChoice
from flce.backends.cuda.ops import TritonChunkKernels
from flce.backends.cuda.ptx_math import compiles_to_ptx
from flce.backends.cuda.row_ops import GRAD_BLOCKS_PER_PROGRAM, row_launch
from flce.distillation.config import DistillationConfig
from flce.distillation.semantics import (
    PairCoefficients,
    PairStats,
    PartialPairStats,
    needs_cross,
    per_head_unfit,
    student_reads_teacher,
    with_mixture_sums,
)

# distill_kernels' constexpr flags of each loss (its module docstring)
_CROSS = {"forward_kl": 1, "reverse_kl": 2, "jsd": 0}
_LOSS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def _readable(t: torch.Tensor) -> torch.Tensor:
    """Logits as the kernels read them: unit column stride (the schedule's buffers have it already)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _jsd(cfg: DistillationConfig) -> bool:
    return cfg.soft and cfg.loss == "jsd"


def pair_stats(teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
               cfg: DistillationConfig, vocab_offset: int, launch: LaunchParams) -> PartialPairStats:
    """PairKernels.pair_stats: one program a row."""
    teacher_logits, student_logits = _readable(teacher_logits), _readable(student_logits)
    n, vocab = student_logits.shape
    stats = PartialPairStats.allocate(n, cfg, student_logits.device)
    if n == 0:
        return stats
    block_v, num_warps = row_launch(vocab, launch)
    unused = stats.teacher_max  # stands in for the pointers whose flag is off: never read
    k._pair_stats_kernel[(n,)](
        teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
        target if cfg.hard else unused, stats.teacher_max, stats.teacher_sum, stats.student_max, stats.student_sum,
        *(unused if t is None else t for t in (stats.cross, stats.hard_max, stats.hard_sum, stats.target_logit,
                                               stats.student_dz_sum)),
        vocab, vocab_offset, cfg.ignore_index, 1.0 / cfg.temperature,
        CROSS=_CROSS[cfg.loss] if needs_cross(cfg) else 0, HARD=cfg.hard, HARD_OWN_LSE=cfg.hard_needs_own_lse,
        ENTROPY=cfg.return_entropy, BLOCK_V=block_v, num_warps=num_warps,
    )
    return stats


def mixture_sums(teacher_logits: torch.Tensor, student_logits: torch.Tensor, stats: PairStats,
                 cfg: DistillationConfig, launch: LaunchParams) -> tuple[torch.Tensor, torch.Tensor]:
    """PairKernels.mixture_sums: one program a row."""
    teacher_logits, student_logits = _readable(teacher_logits), _readable(student_logits)
    n, vocab = student_logits.shape
    teacher_kl = torch.empty(n, dtype=torch.float32, device=student_logits.device)
    student_kl = torch.empty_like(teacher_kl)
    if n:
        block_v, num_warps = row_launch(vocab, launch)
        k._mixture_sums_kernel[(n,)](
            teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
            *(_rows(t) for t in (stats.teacher_max, stats.teacher_log_sum, stats.student_max, stats.student_log_sum)),
            teacher_kl, student_kl,
            vocab, 1.0 / cfg.temperature, cfg.beta, PTX=compiles_to_ptx(student_logits), BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return teacher_kl, student_kl


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A per-row vector as the kernels read it: fp32, contiguous (a broadcast scale made whole: [n] floats)."""
    return t.float().contiguous()


def pair_grad_(teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
               cfg: DistillationConfig, vocab_offset: int, coeffs: PairCoefficients,
               launch: LaunchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PairKernels.pair_grad_: program (row, k) takes GRAD_BLOCKS_PER_PROGRAM blocks of the row."""
    _launch_pair_grad(teacher_logits, student_logits, target, cfg, vocab_offset, coeffs, launch, expectation=False)
    return student_logits, teacher_logits if coeffs.teacher_scale is not None else None


def pair_grad_expectation_(teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                           cfg: DistillationConfig, vocab_offset: int, coeffs: PairCoefficients,
                           launch: LaunchParams) -> tuple[torch.Tensor, torch.Tensor]:
    """GradSweepExpectation.pair_grad_expectation_: pair_grad_'s launch, each program also summing p (t - s) over
    its columns; the row sums of those ([n] fp32) come back beside the student's gradient."""
    if not (cfg.soft and cfg.loss == "forward_kl") or coeffs.teacher_scale is not None:
        raise ValueError("pair_grad_expectation_: forward KL's student gradient alone (the teacher's needs "
                         "E_p[t - s] before its sweep)")
    parts = _launch_pair_grad(teacher_logits, student_logits, target, cfg, vocab_offset, coeffs, launch,
                              expectation=True)
    return student_logits, parts.sum(dim=1)


def _launch_pair_grad(teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                      cfg: DistillationConfig, vocab_offset: int, coeffs: PairCoefficients, launch: LaunchParams,
                      expectation: bool) -> torch.Tensor | None:
    """The gradients written over the logits; with ``expectation``, returns each program's sum p (t - s)
    ([n, programs a row] fp32)."""
    n, vocab = student_logits.shape
    block_v, num_warps = row_launch(vocab, launch)
    span = block_v * GRAD_BLOCKS_PER_PROGRAM
    programs = triton.cdiv(vocab, span)
    parts = torch.empty(n, programs, dtype=torch.float32, device=student_logits.device) if expectation else None
    if n == 0:
        return parts
    # Written in place: the buffers must be the ones the schedule passes on (its GEMMs' contiguous outputs).
    assert teacher_logits.stride(1) == 1 and student_logits.stride(1) == 1
    first = _rows(coeffs.teacher_max)
    present = [first if t is None else _rows(t) for t in (
        coeffs.teacher_log_sum, coeffs.student_max, coeffs.student_log_sum, coeffs.soft_scale, coeffs.student_center,
        coeffs.teacher_center, coeffs.teacher_scale, coeffs.hard_lse, coeffs.hard_scale)]
    k._pair_grad_kernel[(n, programs)](
        teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
        target if cfg.hard else first, first, *present, first if parts is None else parts,
        vocab, vocab_offset, cfg.ignore_index, 1.0 / cfg.temperature, cfg.beta,
        LOSS=_LOSS[cfg.loss], SOFT=cfg.soft, HARD=cfg.hard, TEACHER=coeffs.teacher_scale is not None,
        EXPECTATION=expectation, SPAN=span, PTX=compiles_to_ptx(student_logits), BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return parts


def pair_passes_(teacher_logits: torch.Tensor, student_logits: torch.Tensor, target: torch.Tensor | None,
                 cfg: DistillationConfig, scale: torch.Tensor | None, teacher: bool, launch: LaunchParams,
                 rows_in_flight: int | None, known: PartialPairStats | None = None, registers: int | None = None
                 ) -> tuple[PairStats, torch.Tensor | None, torch.Tensor | None]:
    """FusedPairPasses.pair_passes_ (an unsharded chunk): ``rows_in_flight`` programs (None: one a row), at most
    ``registers`` a thread where the kernel compiles to PTX (None: the compiler's choice); with ``known`` statistics
    the kernel reads them instead of its first sweep (reverse KL's cross sum among them, its student's GEMM's),
    forward KL's cross sum made in the gradient's sweep."""
    n, vocab = student_logits.shape
    device = student_logits.device
    jsd = _jsd(cfg)
    write = scale is not None
    reverse = student_reads_teacher(cfg)
    if known is not None:
        why = per_head_unfit(cfg, write and not teacher, reads_teacher=known.cross is not None)
        if known.hard_max is not None or (known.cross is not None and not reverse):
            why = "they hold a cross sum or the hard term's own softmax, which the kernel makes itself"
        if why is not None:
            raise ValueError(f"pair_passes_: known statistics cannot serve this call: {why}")
    if known is not None and not (jsd or write):  # the GEMMs made all there is
        return PairStats.from_partial(known, cfg), None, None
    partial = PartialPairStats.allocate(n, cfg, device) if known is None else known
    if known is not None and needs_cross(cfg) and not reverse:  # forward KL: the gradient's sweep writes it
        partial = dataclasses.replace(known, cross=torch.empty(n, dtype=torch.float32, device=device))
    teacher_kl, student_kl = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(2))
    if n:
        assert teacher_logits.stride(1) == 1 and student_logits.stride(1) == 1  # gradients written in place
        block_v, num_warps = row_launch(vocab, launch)
        unused = partial.teacher_max
        row_scale = unused if scale is None else scale.float()
        ptx = compiles_to_ptx(student_logits)
        cap = {"maxnreg": registers} if ptx and registers else {}  # ptxas's .maxnreg: no interpreter, no HIP
        k._pair_passes_kernel[(min(n, rows_in_flight or n),)](
            teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
            target if cfg.hard else unused, row_scale, row_scale.stride(0),
            partial.teacher_max, partial.teacher_sum, partial.student_max, partial.student_sum,
            *(unused if t is None else t for t in (partial.cross, partial.hard_max, partial.hard_sum,
                                                   partial.target_logit, partial.student_dz_sum)),
            teacher_kl, student_kl,
            n, vocab, cfg.ignore_index, 1.0 / cfg.temperature, (1.0 - cfg.hard_label_weight) / cfg.temperature,
            cfg.hard_label_weight, cfg.beta,
            CROSS=_CROSS[cfg.loss] if needs_cross(cfg) else 0, LOSS=_LOSS[cfg.loss], SOFT=cfg.soft, HARD=cfg.hard,
            HARD_OWN_LSE=cfg.hard_needs_own_lse, ENTROPY=cfg.return_entropy and known is None, MIXTURE=jsd,
            WRITE_GRAD=write, TEACHER=write and teacher,
            GRAD_REVERSE=not jsd and known is None, KNOWN_STATS=known is not None,
            PTX=ptx, BLOCK_V=block_v, num_warps=num_warps, **cap,
        )
    stats = PairStats.from_partial(partial, cfg)
    if jsd:
        stats = with_mixture_sums(stats, teacher_kl, student_kl)
    return stats, student_logits if write else None, teacher_logits if write and teacher else None


class CudaPairKernels(TritonChunkKernels):
    """flce.engine.distillation.call.PairKernels, FusedPairPasses and GradSweepExpectation (and RowKernels: the
    gradient products by the family the choice gave them, through its fallback chain), launched as ``choice``
    says."""

    def __init__(self, choice: KernelChoice) -> None:
        super().__init__(choice)
        self.rows_in_flight = choice.settings.rows_in_flight
        self.pair_registers = choice.settings.pair_registers

    def pair_stats(self, teacher_logits, student_logits, target, cfg, vocab_offset):
        return pair_stats(teacher_logits, student_logits, target, cfg, vocab_offset, self.launch)

    def mixture_sums(self, teacher_logits, student_logits, stats, cfg):
        return mixture_sums(teacher_logits, student_logits, stats, cfg, self.launch)

    def pair_grad_(self, teacher_logits, student_logits, target, cfg, vocab_offset, coeffs):
        return pair_grad_(teacher_logits, student_logits, target, cfg, vocab_offset, coeffs, self.launch)

    def pair_grad_expectation_(self, teacher_logits, student_logits, target, cfg, vocab_offset, coeffs):
        return pair_grad_expectation_(teacher_logits, student_logits, target, cfg, vocab_offset, coeffs, self.launch)

    def pair_passes_(self, teacher_logits, student_logits, target, cfg, scale, teacher, known=None):
        return pair_passes_(teacher_logits, student_logits, target, cfg, scale, teacher, self.launch,
                            self.rows_in_flight, known, self.pair_registers)
