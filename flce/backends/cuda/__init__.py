"""CUDA backend: Triton and Gluon kernels (fused statistics and gradient GEMMs, row kernels between cuBLAS
GEMMs) for NVIDIA GPUs, and linear distillation's pair row kernels (distill_ops.py); cuda/choice.py decides which
run for a call.

Triton is imported only when a kernel first runs, so ``import flce`` works without it.
With TRITON_INTERPRET=1 the same kernels run on CPU tensors (``get_impl("cpu", backend="cuda")``).
"""

from __future__ import annotations

import torch

from flce.backends.cuda import tuning  # noqa: F401  (registers the tuning space)
from flce.config import LCEConfig
from flce.engine.call import EngineCall
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription
from flce.engine.kernels import FUSED_GRAD_GEMM, FUSED_STATS_GEMM, KEPT_EXPONENTIALS, options_only_reference_serves
from flce.engine.plans import PlanRequest
from flce.inputs import FlatInputs
from flce.registry import Backend, HardwareProbe, register_backend

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_available(probe: HardwareProbe) -> tuple[bool, str]:
    has_triton, why_not = probe.triton
    if not has_triton:
        return False, why_not
    if probe.cuda[0] or probe.triton_interpret[0]:
        return True, "triton and " + (probe.cuda[1] if probe.cuda[0] else probe.triton_interpret[1])
    return False, probe.cuda[1]


def _supports(cfg: LCEConfig, dtype: torch.dtype, hidden_size: int, vocab: int) -> tuple[bool, str]:
    if dtype not in _SUPPORTED_DTYPES:
        return False, f"dtype {dtype} (the kernels take float32, float16, bfloat16)"
    reference_only = options_only_reference_serves(cfg, scan_keeps_logit_stats=True)
    if reference_only:
        return False, "; ".join(reference_only)
    return True, "supported"


# The record and the launchers of each distinct call description (calls of one shape share them): the
# choice is a pure function of the key, and making it costs more than a dictionary lookup.
_planned: dict[tuple, tuple[CallChoice, object]] = {}
_PLANNED_LIMIT = 256


def _plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    """The record of what the call runs (cuda/choice.py) and the launchers that run it."""
    from flce.backends.cuda.choice import choose, entry_for
    from flce.backends.cuda.fallback import failures
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.ops import TritonChunkKernels

    device = describe_device(flat.hidden.device)
    call = CallDescription.of(flat, cfg, variant, request)
    entry, failed = entry_for(device, call), failures(flat.hidden.device, flat.weight.dtype)
    key = (device, call.key, entry.key, tuple(sorted(failed.items())))
    planned = _planned.get(key)
    if planned is None:
        record, choice = choose(device, call, entry, failed)
        if len(_planned) >= _PLANNED_LIMIT:
            _planned.clear()
        planned = _planned[key] = (record, TritonChunkKernels(choice))
    record, kernels = planned
    return EngineCall(kernels=kernels, cfg=cfg, plan=record.plan, plain=variant == "plain",
                      token_shape=flat.token_shape, choice=record)


def _choose(device: DeviceDescription, call: CallDescription) -> CallChoice:
    from flce.backends.cuda.choice import explain

    return explain(device, call)


_planned_distillations: dict[tuple, tuple[CallChoice, object]] = {}


def _plan_distillation(pair: object, cfg: object, request: PlanRequest) -> object:
    """The record of what a linear distillation call runs (choice.py choose_distillation) and the pair kernels that
    run it (distill_ops.py), memoised as _plan_call's."""
    from flce.backends.cuda.choice import choose_distillation, distillation_entry_for
    from flce.backends.cuda.distill_ops import CudaPairKernels
    from flce.backends.cuda.fallback import failures
    from flce.backends.cuda.hardware import describe_device
    from flce.engine.distillation.call import DistillCall, DistillDescription

    device = describe_device(pair.student_hidden.device)
    desc = DistillDescription.of(pair, cfg, request)
    entry, failed = distillation_entry_for(device, desc), failures(pair.student_hidden.device, desc.dtype)
    key = (device, desc.key, entry.key, tuple(sorted(failed.items())))
    planned = _planned_distillations.get(key)
    if planned is None:
        record, choice = choose_distillation(device, desc, entry, failed)
        if len(_planned_distillations) >= _PLANNED_LIMIT:
            _planned_distillations.clear()
        planned = _planned_distillations[key] = (record, CudaPairKernels(choice))
    record, kernels = planned
    return DistillCall(kernels=kernels, cfg=cfg, plan=record.plan, token_shape=pair.token_shape, choice=record)


def _choose_distillation(device: DeviceDescription, desc: object) -> CallChoice:
    from flce.backends.cuda.choice import choose_distillation, distillation_entry_for

    return choose_distillation(device, desc, distillation_entry_for(device, desc))[0]


def _unavailable_on(device: DeviceDescription) -> str | None:
    """A described GPU runs the backend where its Triton builds flce's kernels (an NPU or the CPU never)."""
    from flce.backends.cuda.hardware import triton_too_old

    if device.type == "cuda" or device.interpreter:
        return triton_too_old(device.triton)
    return f"a {device.type} device: the cuda backend runs on NVIDIA GPUs and, asked by name, the interpreter"


BACKEND = Backend(
    name="cuda",
    device_types=("cuda", "interpret"),
    priority=100,
    is_available=_is_available,
    supports=_supports,
    plan_call=_plan_call,
    choose=_choose,
    capabilities=frozenset({FUSED_STATS_GEMM, FUSED_GRAD_GEMM, KEPT_EXPONENTIALS}),
    unavailable_on=_unavailable_on,
    plan_distillation=_plan_distillation,
    choose_distillation=_choose_distillation,
)
register_backend(BACKEND)


