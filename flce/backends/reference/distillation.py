"""The reference backend's linear distillation: its pair kernels (flce.distillation.tiles' torch formulas
over row blocks) and its planner (token chunks from the memory budget or the autotune cache)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.backends.reference.kernels import CPU_BLOCK_BYTES, ReferenceKernels, math_dtype
from flce.backends.reference.plan import DEFAULT_CHUNK_BUDGET
from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import FlatPair
from flce.distillation.semantics import PairCoefficients, PairStats, PartialPairStats
from flce.distillation.tiles import tile_gradients, tile_mixture_sums, tile_statistics
from flce.engine.choice import CallChoice, DeviceDescription, describe_device
from flce.engine.distillation.call import (
    DistillCall,
    DistillDescription,
    logits_bound_chunks,
    pair_logits_bytes_per_row,
)
from flce.engine.distillation.steps import PairKernelNames, distillation_steps, gradient_timing
from flce.engine.plans import PlanRequest

# Bytes of one [rows, V] math-dtype temporary of the torch formulas per row block: the CPU's cache-sized block,
# and on accelerators one large enough for full-speed elementwise launches (32 rows at V = 128k in fp32). The
# formulas hold about 8 such temporaries at once (t, s, both exponentials, the log-mixture, the two gradients, a
# product): a fixed 64-128 MiB whatever the chunk, so a chunk's row costs its two logits rows alone.
ACCELERATOR_BLOCK_BYTES = 16 << 20
VARIANT = "distillation"
_CLASS = "flce.backends.reference.distillation.ReferencePairKernels."
KERNEL_NAMES = PairKernelNames(pair_stats=_CLASS + "pair_stats", mixture_sums=_CLASS + "mixture_sums",
                               pair_grad=_CLASS + "pair_grad_", scale=_CLASS + "scale_",
                               bias_sums=_CLASS + "add_column_sums_")


def pair_row_blocks(logits: torch.Tensor) -> Iterator[slice]:
    """Row slices of a chunk whose math-dtype rows fill one block (ACCELERATOR_BLOCK_BYTES, CPU_BLOCK_BYTES)."""
    n_rows, vocab = logits.shape
    block = CPU_BLOCK_BYTES if logits.device.type == "cpu" else ACCELERATOR_BLOCK_BYTES
    step = max(1, block // max(1, vocab * math_dtype(logits.dtype).itemsize))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def target_columns(target: torch.Tensor | None, n_rows: int, vocab: int, vocab_offset: int, ignore_index: int,
                   device: torch.device) -> torch.Tensor:
    """Each row's target column in this shard's logits, -1 where the shard does not hold it (or it is ignored)."""
    if target is None:
        return torch.full((n_rows,), -1, dtype=torch.int64, device=device)
    local = target - vocab_offset
    here = (local >= 0) & (local < vocab) & (target != ignore_index)
    return torch.where(here, local, -1)


class ReferencePairKernels(ReferenceKernels):
    """Implements flce.engine.distillation.call.PairKernels with torch ops (and RowKernels, inherited)."""

    def pair_stats(self, teacher_logits, student_logits, target, cfg: DistillationConfig,
                   vocab_offset: int) -> PartialPairStats:
        n_rows, vocab = student_logits.shape
        math = math_dtype(student_logits.dtype)
        cols = target_columns(target, n_rows, vocab, vocab_offset, cfg.ignore_index, student_logits.device)
        stats = PartialPairStats.allocate(n_rows, cfg, student_logits.device, math)
        for rows in pair_row_blocks(student_logits):
            block = tile_statistics(teacher_logits[rows].to(math), student_logits[rows].to(math), cols[rows], cfg)
            for out, value in zip(stats.present(), block.present(), strict=True):
                out[rows] = value
        return stats

    def mixture_sums(self, teacher_logits, student_logits, stats: PairStats,
                     cfg: DistillationConfig) -> tuple[torch.Tensor, torch.Tensor]:
        math = math_dtype(student_logits.dtype)
        n_rows = student_logits.shape[0]
        teacher_kl = torch.empty(n_rows, dtype=math, device=student_logits.device)
        student_kl = torch.empty_like(teacher_kl)
        for rows in pair_row_blocks(student_logits):
            teacher_kl[rows], student_kl[rows] = tile_mixture_sums(
                teacher_logits[rows].to(math), student_logits[rows].to(math),
                (stats.teacher_max[rows].to(math), stats.teacher_log_sum[rows].to(math)),
                (stats.student_max[rows].to(math), stats.student_log_sum[rows].to(math)), cfg)
        return teacher_kl, student_kl

    def pair_grad_(self, teacher_logits, student_logits, target, cfg: DistillationConfig, vocab_offset: int,
                   coeffs: PairCoefficients):
        n_rows, vocab = student_logits.shape
        math = math_dtype(student_logits.dtype)
        cols = target_columns(target, n_rows, vocab, vocab_offset, cfg.ignore_index, student_logits.device)
        teacher = coeffs.teacher_scale is not None
        for rows in pair_row_blocks(student_logits):
            # Both gradients come from both logits: each is written only once both are formed.
            student_grad, teacher_grad = tile_gradients(teacher_logits[rows].to(math), student_logits[rows].to(math),
                                                        cols[rows], _rows_of(coeffs, rows, math), cfg)
            student_logits[rows] = student_grad
            if teacher:
                teacher_logits[rows] = teacher_grad
        return student_logits, teacher_logits if teacher else None


def _rows_of(coeffs: PairCoefficients, rows: slice, math: torch.dtype) -> PairCoefficients:
    return PairCoefficients(**{name: None if value is None else value[rows].to(math)
                               for name, value in vars(coeffs).items()})


def working_bytes_per_row(vocab: int, dtype: torch.dtype) -> int:
    """Working memory per token row of a chunk: its two logits rows (the formulas' temporaries stay within
    fixed row blocks, ACCELERATOR_BLOCK_BYTES' comment)."""
    return pair_logits_bytes_per_row(vocab, dtype)


def choose_distillation(device: DeviceDescription, desc: DistillDescription,
                        entry: TunedEntry | None = None) -> CallChoice:
    entry = entry or entry_for(device, desc)
    plan, memory = logits_bound_chunks(desc, (entry.params or {}).get("tokens_per_chunk"), DEFAULT_CHUNK_BUDGET)
    block = CPU_BLOCK_BYTES if device.type == "cpu" else ACCELERATOR_BLOCK_BYTES
    blocks = f"row blocks of {block >> 20} MiB per temporary"
    return CallChoice(backend="reference", device=device.text(), inputs=desc.text(), cache=entry.source, plan=plan,
                      gradients=gradient_timing(desc), memory=memory,
                      steps=distillation_steps(desc, plan, KERNEL_NAMES, lambda role: f"torch ops, {blocks}"),
                      kernel_package="flce.backends.reference.distillation",
                      n_rows=desc.n_rows, training=desc.request.training,
                      in_forward=desc.grads_in_forward)


def entry_for(device: DeviceDescription, desc: DistillDescription) -> TunedEntry:
    return tuned_entry(device.name, "reference", VARIANT, desc.dtype, desc.student_hidden, desc.vocab, desc.n_rows)


_KERNELS = ReferencePairKernels()
_planned: dict[tuple, CallChoice] = {}
_PLANNED_LIMIT = 256


def plan_distillation(pair: FlatPair, cfg: DistillationConfig, request: PlanRequest) -> DistillCall:
    device, desc = describe_device(pair.student_hidden.device), DistillDescription.of(pair, cfg, request)
    entry = entry_for(device, desc)
    key = (device, desc.key, entry.key)
    record = _planned.get(key)
    if record is None:
        if len(_planned) >= _PLANNED_LIMIT:
            _planned.clear()
        record = _planned[key] = choose_distillation(device, desc, entry)
    return DistillCall(kernels=_KERNELS, cfg=cfg, plan=record.plan, token_shape=pair.token_shape, choice=record)
