"""The Ascend backend's linear distillation: launchers of distill_kernels.py (UB tiling and grids as ops.py's)
and its planner (token chunks from the memory budget or the autotune cache; both logits buffers of a chunk
within it, the kernels writing the gradients over them)."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from flce.autotune.devices import device_name
from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.backends.ascend.ops import (
    AscendChunkKernels,
    AscendDeviceProperties,
    block_size,
    device_properties,
    grid_for,
    needs_wide_offsets,
)
from flce.backends.ascend.plan import DEFAULT_CHUNK_BUDGET, properties_of
from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import FlatPair
from flce.distillation.semantics import PairCoefficients, PairStats, PartialPairStats
from flce.engine.choice import CallChoice, DeviceDescription
from flce.engine.distillation.call import DistillCall, DistillDescription, logits_bound_chunks
from flce.engine.distillation.steps import PairKernelNames, distillation_steps, gradient_timing
from flce.engine.plans import PlanRequest

VARIANT = "distillation"
_K = "flce.backends.ascend.distill_kernels."
KERNEL_NAMES = PairKernelNames(pair_stats=_K + "_pair_stats_kernel", mixture_sums=_K + "_mixture_sums_kernel",
                               pair_grad=_K + "_pair_grad_kernel", scale="flce.backends.ascend.kernels._scale_kernel",
                               bias_sums="torch.Tensor.sum")
_CROSS = {"forward_kl": 1, "reverse_kl": 2, "jsd": 0}
_LOSS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def _kernels() -> ModuleType:
    """distill_kernels.py, imported on the first launch (it imports triton)."""
    from flce.backends.ascend import distill_kernels

    return distill_kernels


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _rows(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A per-row coefficient as the kernels read it, fp32 contiguous (a broadcast scale made whole), or a
    stand-in the kernel never reads."""
    return like if t is None else t.float().contiguous()


class AscendPairKernels(AscendChunkKernels):
    """flce.engine.distillation.call.PairKernels for one device's properties (and RowKernels, inherited)."""

    def _pair_block(self, kernel: str, logits: torch.Tensor) -> int:
        return block_size(kernel, logits.dtype, logits.shape[1], self.props.ub_bytes)

    def pair_stats(self, teacher_logits, student_logits, target, cfg: DistillationConfig,
                   vocab_offset: int) -> PartialPairStats:
        teacher_logits, student_logits = _unit_columns(teacher_logits), _unit_columns(student_logits)
        n, vocab = student_logits.shape
        stats = PartialPairStats.allocate(n, cfg, student_logits.device)
        if n == 0:
            return stats
        unused = stats.teacher_max  # any tensor: the kernel never reads a pointer whose flag is off
        wide = needs_wide_offsets(teacher_logits) or needs_wide_offsets(student_logits)
        _kernels()._pair_stats_kernel[grid_for(n, self.props)](
            teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
            target if cfg.hard else unused, stats.teacher_max, stats.teacher_sum, stats.student_max, stats.student_sum,
            *(unused if value is None else value for value in (stats.cross, stats.hard_max, stats.hard_sum,
                                                               stats.target_logit, stats.student_dz_sum)),
            n, vocab, vocab_offset, cfg.ignore_index, 1.0 / cfg.temperature,
            CROSS=_CROSS[cfg.loss] if stats.cross is not None else 0, HARD=cfg.hard,
            HARD_OWN_LSE=cfg.hard_needs_own_lse, ENTROPY=stats.student_dz_sum is not None, WIDE_OFFSETS=wide,
            BLOCK_V=self._pair_block("pair_stats", student_logits),
        )
        return stats

    def mixture_sums(self, teacher_logits, student_logits, stats: PairStats,
                     cfg: DistillationConfig) -> tuple[torch.Tensor, torch.Tensor]:
        teacher_logits, student_logits = _unit_columns(teacher_logits), _unit_columns(student_logits)
        n, vocab = student_logits.shape
        teacher_kl = torch.empty(n, dtype=torch.float32, device=student_logits.device)
        student_kl = torch.empty_like(teacher_kl)
        if n:
            _kernels()._mixture_sums_kernel[grid_for(n, self.props)](
                teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
                *(_rows(t, teacher_kl) for t in (stats.teacher_max, stats.teacher_log_sum, stats.student_max,
                                                 stats.student_log_sum)),
                teacher_kl, student_kl,
                n, vocab, 1.0 / cfg.temperature, math.log(cfg.beta), math.log1p(-cfg.beta),
                WIDE_OFFSETS=needs_wide_offsets(teacher_logits) or needs_wide_offsets(student_logits),
                BLOCK_V=self._pair_block("mixture_sums", student_logits),
            )
        return teacher_kl, student_kl

    def pair_grad_(self, teacher_logits, student_logits, target, cfg: DistillationConfig, vocab_offset: int,
                   coeffs: PairCoefficients):
        n, vocab = student_logits.shape
        teacher = coeffs.teacher_scale is not None
        if n == 0:
            return student_logits, teacher_logits if teacher else None
        # Written in place: the buffers must be the ones the schedule passes on (torch.mm's outputs are contiguous).
        assert teacher_logits.stride(1) == 1 and student_logits.stride(1) == 1
        first = coeffs.teacher_max.float().contiguous()  # also stands in for the pointers whose flag is off
        _kernels()._pair_grad_kernel[grid_for(n, self.props)](
            teacher_logits, teacher_logits.stride(0), student_logits, student_logits.stride(0),
            target if cfg.hard else first, first, _rows(coeffs.teacher_log_sum, first),
            _rows(coeffs.student_max, first), _rows(coeffs.student_log_sum, first), _rows(coeffs.soft_scale, first),
            _rows(coeffs.student_center, first), _rows(coeffs.teacher_center, first), _rows(coeffs.hard_lse, first),
            _rows(coeffs.hard_scale, first), _rows(coeffs.teacher_scale, first),
            n, vocab, vocab_offset, cfg.ignore_index, 1.0 / cfg.temperature, cfg.beta, math.log(cfg.beta),
            math.log1p(-cfg.beta),
            LOSS=_LOSS[cfg.loss], SOFT=cfg.soft, HARD=cfg.hard, TEACHER=teacher,
            WIDE_OFFSETS=needs_wide_offsets(teacher_logits) or needs_wide_offsets(student_logits),
            BLOCK_V=self._pair_block("pair_grad", student_logits),
        )
        return student_logits, teacher_logits if teacher else None


def choose_distillation(device: DeviceDescription, desc: DistillDescription, entry: TunedEntry | None = None,
                        props: AscendDeviceProperties | None = None) -> CallChoice:
    if entry is None:
        entry = tuned_entry(device.name, "ascend", VARIANT, desc.dtype, desc.student_hidden, desc.vocab, desc.n_rows)
    props = props or properties_of(device)
    # the kernels have no [n, V] temporaries: a chunk's two logits buffers are all its memory
    plan, memory = logits_bound_chunks(desc, (entry.params or {}).get("tokens_per_chunk"), DEFAULT_CHUNK_BUDGET)

    def launch(kernel: str) -> str:
        return (f"BLOCK_V {block_size(kernel, desc.dtype, desc.vocab, props.ub_bytes)} (a {props.ub_bytes >> 10} KiB "
                f"UB), up to {props.vector_cores} programs")

    return CallChoice(backend="ascend", device=device.text(), inputs=desc.text(), cache=entry.source, plan=plan,
                      gradients=gradient_timing(desc), memory=memory,
                      steps=distillation_steps(desc, plan, KERNEL_NAMES, launch),
                      kernel_package="flce.backends.ascend.distill_kernels",
                      n_rows=desc.n_rows, training=desc.request.training,
                      in_forward=desc.grads_in_forward)


def plan_distillation(pair: FlatPair, cfg: DistillationConfig, request: PlanRequest) -> DistillCall:
    device_of = pair.student_hidden.device
    props = device_properties(device_of)
    device = DeviceDescription(type=device_of.type, name=device_name(device_of), total_memory=props.total_memory_bytes,
                               multiprocessors=props.vector_cores)
    record = choose_distillation(device, DistillDescription.of(pair, cfg, request), props=props)
    return DistillCall(kernels=AscendPairKernels(props), cfg=cfg, plan=record.plan, token_shape=pair.token_shape,
                       choice=record)
