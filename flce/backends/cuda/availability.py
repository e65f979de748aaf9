"""Which of the CUDA backend's kernel families this process can build and run, and why not: the
lines ``python -m flce info`` prints. The kernel choice (choice.py) makes the same checks per call and falls back
(warp-specialised Gluon GEMM -> fused Triton GEMM -> cuBLAS and row kernels); this is the summary."""

from __future__ import annotations

import os

import torch

from flce.backends.cuda.gluon_compat import gluon_support, triton_version
from flce.backends.cuda.hardware import describe_device, has_tma, warp_specialized_available


def kernel_availability(device: torch.device) -> list[tuple[str, bool, str]]:
    """(kernel family, available on ``device``, why / why not), fastest family last."""
    version = triton_version()
    if version is None:
        return [("Triton kernels", False, "triton is not installed: the cuda backend is unavailable")]
    triton_name = f"triton {version[0]}.{version[1]}"
    gpu = device.type == "cuda" and torch.cuda.is_available()
    if gpu:
        runs, where = True, triton_name
    elif os.environ.get("TRITON_INTERPRET") == "1":
        runs, where = True, f"{triton_name}, on CPU tensors through the interpreter (TRITON_INTERPRET=1)"
    else:
        runs, where = False, f"{triton_name}; {device} runs them only under TRITON_INTERPRET=1"
    if gpu:
        description = describe_device(device)
        tma = has_tma(description)
        tma_why = f"{description.name} ({description.arch})" if tma else (
            f"needs sm_90 or later, {description.name} is {description.arch}")
        ws, ws_why = warp_specialized_available(description)
    else:
        tma, tma_why = False, f"runs on an sm_90 GPU only, {device} is none"
        ws, ws_why = False, f"{gluon_support()[1]}; {tma_why}"
    return [
        ("row kernels (Triton)", runs, where),
        ("fused statistics and gradient GEMMs (Triton)", runs, where),
        ("  their TMA variants (sm_90)", tma, tma_why),
        ("warp-specialised GEMM (Gluon, sm_90a)", ws, ws_why),
    ]

