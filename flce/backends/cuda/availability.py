"""Which of the CUDA backend's kernel families this process can build and run, and why not: the
lines ``python -m flce info`` prints. The launchers make the same checks per call and fall back
(warp-specialised Gluon GEMM -> fused Triton GEMM -> cuBLAS and row kernels); this is the summary."""

from __future__ import annotations

import os

import torch

from flce.backends.cuda.gluon_compat import gluon_support, triton_version


def kernel_availability(device: torch.device) -> list[tuple[str, bool, str]]:
    """(kernel family, available on ``device``, why / why not), fastest family last."""
    version = triton_version()
    if version is None:
        return [("Triton kernels", False, "triton is not installed: the cuda backend is unavailable")]
    triton_name = f"triton {version[0]}.{version[1]}"
    if device.type == "cuda" and torch.cuda.is_available():
        runs, where = True, triton_name
    elif os.environ.get("TRITON_INTERPRET") == "1":
        runs, where = True, f"{triton_name}, on CPU tensors through the interpreter (TRITON_INTERPRET=1)"
    else:
        runs, where = False, f"{triton_name}; {device} runs them only under TRITON_INTERPRET=1"
    hopper, hopper_why = _hopper(device)
    gluon_ok, gluon_why = gluon_support()
    return [
        ("row kernels (Triton)", runs, where),
        ("fused statistics and gradient GEMMs (Triton)", runs, where),
        ("  their TMA variants (sm_90)", hopper, hopper_why),
        ("warp-specialised GEMM (Gluon, sm_90a)", gluon_ok and hopper,
         f"{gluon_why}; {hopper_why}" if gluon_ok else gluon_why),
    ]


def _hopper(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"runs on an sm_90 GPU only, {device} is none"
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if capability != (9, 0):
        return False, f"runs on an sm_90 GPU only, {name} is sm_{capability[0]}{capability[1]}"
    return True, f"{name} (sm_90)"
