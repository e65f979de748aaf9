"""Ascend backend: Triton-Ascend kernels between torch_npu GEMMs, for Huawei Ascend NPUs (910B on).

Neither torch_npu nor triton is imported here: triton on the first kernel launch, torch_npu
only by the hardware probe and on NPU tensors. With TRITON_INTERPRET=1 the same kernels run on
CPU tensors when asked for by name (``get_impl("cpu", backend="ascend")``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry import Backend, HardwareProbe, register_backend

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_has_ascend_backend() -> tuple[bool, str]:
    """Whether the installed triton is triton-ascend, found on disk without importing triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return False, "triton-ascend is not installed (pip install flce[ascend])"
    for location in spec.submodule_search_locations or ():
        if os.path.isdir(os.path.join(location, "backends", "ascend")):
            return True, "triton-ascend"
    return False, "the installed triton has no Ascend backend (triton/backends/ascend): install triton-ascend"


def _is_available(probe: HardwareProbe) -> tuple[bool, str]:
    has_npu, npu_reason = probe.npu
    if has_npu:
        has_triton, triton_reason = probe.triton
        if not has_triton:
            return False, triton_reason
        ascend_triton, why = triton_has_ascend_backend()
        return (True, f"{npu_reason} and {why}") if ascend_triton else (False, why)
    if probe.triton_interpret[0] and probe.triton[0]:
        return True, f"{probe.triton_interpret[1]}: the kernels run on CPU tensors in the Triton interpreter"
    return False, npu_reason


def _supports(cfg: LCEConfig, flat: FlatInputs) -> tuple[bool, str]:
    if flat.weight.dtype not in _SUPPORTED_DTYPES:
        return False, f"dtype {flat.weight.dtype} (the kernels take float32, float16, bfloat16)"
    return True, "supported"


def _run(flat: FlatInputs, cfg: LCEConfig, variant: str) -> torch.Tensor | LCEOutput:
    from flce.backends.ascend.function import ascend_linear_cross_entropy

    return ascend_linear_cross_entropy(flat, cfg, variant)


def _chunked(flat: FlatInputs, cfg: LCEConfig, variant: str, training: bool | None = None):  # noqa: ANN202
    """training is accepted for the descriptor's signature: the Ascend plan is the same either way."""
    from flce.backends.ascend.function import ascend_chunked_call

    return ascend_chunked_call(flat, cfg, variant)


BACKEND = Backend(
    name="ascend",
    device_types=("npu", "interpret"),
    priority=100,
    is_available=_is_available,
    supports=_supports,
    run=_run,
    chunked=_chunked,
)
register_backend(BACKEND)
