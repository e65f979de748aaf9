"""Ascend backend: Triton-Ascend kernels between torch_npu GEMMs, for Huawei Ascend NPUs (910B on).

Neither torch_npu nor triton is imported here: triton on the first kernel launch, torch_npu
only by the hardware probe and on NPU tensors. With TRITON_INTERPRET=1 the same kernels run on
CPU tensors when asked for by name (``get_impl("cpu", backend="ascend")``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil

import torch

from flce.backends.ascend import tuning  # noqa: F401  (registers the tuning space)
from flce.config import LCEConfig
from flce.engine.call import EngineCall
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription
from flce.engine.kernels import options_only_reference_serves
from flce.engine.plans import PlanRequest
from flce.inputs import FlatInputs
from flce.registry import Backend, HardwareProbe, register_backend

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_has_ascend_backend() -> tuple[bool, str]:
    """Whether the installed triton is triton-ascend, found on disk without importing triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return False, ("triton-ascend is not installed (from a flce checkout: pip install -e '.[ascend]'; "
                       "README, Install)")
    for location in spec.submodule_search_locations or ():
        if os.path.isdir(os.path.join(location, "backends", "ascend")):
            return True, f"triton-ascend {_distribution_version('triton-ascend')}"
    return False, "the installed triton has no Ascend backend (triton/backends/ascend): install triton-ascend"


def bisheng_compiler_found() -> tuple[bool, str]:
    """Whether triton-ascend will find CANN's BiSheng compiler, looked up as triton-ascend 3.2 does
    (backends/ascend/utils.py, _get_npucompiler_path): bishengir-compile on PATH, else
    TRITON_NPU_COMPILER_PATH. CANN's set_env.sh puts it on PATH."""
    path = shutil.which("bishengir-compile")
    if path:
        return True, f"BiSheng at {path}"
    if os.environ.get("TRITON_NPU_COMPILER_PATH"):
        return True, f"BiSheng under TRITON_NPU_COMPILER_PATH={os.environ['TRITON_NPU_COMPILER_PATH']}"
    return False, ("CANN's BiSheng compiler (bishengir-compile) is not on PATH: source "
                   "<CANN>/ascend-toolkit/set_env.sh; triton-ascend compiles every kernel with it")


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown: no package metadata)"


def _is_available(probe: HardwareProbe) -> tuple[bool, str]:
    has_npu, npu_reason = probe.npu
    if has_npu:
        has_triton, triton_reason = probe.triton
        if not has_triton:
            return False, triton_reason
        ascend_triton, why = triton_has_ascend_backend()
        if not ascend_triton:
            return False, why
        has_bisheng, bisheng = bisheng_compiler_found()
        return (True, f"{npu_reason}, {why}, {bisheng}") if has_bisheng else (False, bisheng)
    if probe.triton_interpret[0] and probe.triton[0]:
        return True, f"{probe.triton_interpret[1]}: the kernels run on CPU tensors in the Triton interpreter"
    # No NPU: say so first, then what else a user would still miss, so one look at
    # `python -m flce info` lists every step left.
    missing = [f"no Ascend NPU: {npu_reason}"]
    ascend_triton, why = triton_has_ascend_backend()
    missing.append(f"{why} is installed" if ascend_triton else why)
    if ascend_triton:
        missing.append(bisheng_compiler_found()[1])
    return False, "; ".join(missing)


def _supports(cfg: LCEConfig, dtype: torch.dtype, hidden_size: int, vocab: int) -> tuple[bool, str]:
    if dtype not in _SUPPORTED_DTYPES:
        return False, f"dtype {dtype} (the kernels take float32, float16, bfloat16)"
    reference_only = options_only_reference_serves(cfg, scan_keeps_logit_stats=False)
    if reference_only:
        return False, "; ".join(reference_only)
    return True, "supported"


def _plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    from flce.backends.ascend.plan import plan_call

    return plan_call(flat, cfg, variant, request)


def _choose(device: DeviceDescription, call: CallDescription) -> CallChoice:
    from flce.backends.ascend.plan import choose

    return choose(device, call)


def _plan_distillation(pair: object, cfg: object, request: PlanRequest) -> object:
    from flce.backends.ascend.distill_ops import plan_distillation

    return plan_distillation(pair, cfg, request)


def _choose_distillation(device: DeviceDescription, desc: object) -> CallChoice:
    from flce.backends.ascend.distill_ops import choose_distillation

    return choose_distillation(device, desc)


BACKEND = Backend(
    name="ascend",
    device_types=("npu", "interpret"),
    priority=100,
    is_available=_is_available,
    supports=_supports,
    plan_call=_plan_call,
    choose=_choose,
    plan_distillation=_plan_distillation,
    choose_distillation=_choose_distillation,
)
register_backend(BACKEND)
