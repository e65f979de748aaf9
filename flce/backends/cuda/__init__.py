"""CUDA backend: Triton row kernels between cuBLAS GEMMs, for NVIDIA (and other Triton CUDA/HIP) GPUs.

Triton is imported only when a kernel first runs, so ``import flce`` works without it.
With TRITON_INTERPRET=1 the same kernels run on CPU tensors (``get_impl("cpu", backend="cuda")``).
"""

from __future__ import annotations

import torch

from flce.backends.cuda import tuning  # noqa: F401  (registers the tuning space)
from flce.config import LCEConfig
from flce.engine.call import EngineCall
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


# The kernels of calls the cache holds nothing for, one object per gradient-GEMM choice.
_default_kernels: dict = {}


def _plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    """The kernels (with the cache's tuned launches and tiles) and the plan for one call."""
    from flce.backends.cuda.ops import TritonChunkKernels
    from flce.backends.cuda.plan import DEFAULT_GRAD_GEMM_KERNEL, WARP_SPECIALIZED, plan_chunks, tuned_knobs

    tuned = tuned_knobs(flat, variant)
    grad_gemm_kernel = tuned.grad_gemm_kernel or DEFAULT_GRAD_GEMM_KERNEL
    if tuned.launch is None and tuned.gemm is None and tuned.stats_kernel is None and tuned.logits_kernel is None:
        kernels = _default_kernels.get(grad_gemm_kernel)
        if kernels is None:
            kernels = _default_kernels[grad_gemm_kernel] = TritonChunkKernels(grad_gemm_kernel=grad_gemm_kernel)
    else:
        kernels = TritonChunkKernels(tuned.launch, tuned.gemm, tuned.stats_kernel or WARP_SPECIALIZED,
                                     grad_gemm_kernel, tuned.logits_kernel or WARP_SPECIALIZED)
    return EngineCall(kernels=kernels, cfg=cfg, plan=plan_chunks(flat, cfg, request, tuned),
                      plain=variant == "plain", token_shape=flat.token_shape)


BACKEND = Backend(
    name="cuda",
    device_types=("cuda", "interpret"),
    priority=100,
    is_available=_is_available,
    supports=_supports,
    plan_call=_plan_call,
    capabilities=frozenset({FUSED_STATS_GEMM, FUSED_GRAD_GEMM, KEPT_EXPONENTIALS}),
)
register_backend(BACKEND)


