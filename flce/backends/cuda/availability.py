"""Which of the CUDA backend's kernel families this process can build and run, and why not: the lines
``python -m flce info`` prints, one per registered family (cuda/families), fastest last. The kernel choice makes
the same checks per call and falls back down each role's chain; this is the summary."""

from __future__ import annotations

import os

import torch

from flce.backends.cuda import families
from flce.backends.cuda.gluon_compat import triton_version
from flce.backends.cuda.hardware import describe_device


def kernel_availability(device: torch.device) -> list[tuple[str, bool, str]]:
    """(kernel family, available on ``device``, why / why not), fastest family last."""
    version = triton_version()
    if version is None:
        return [("Triton kernels", False, "triton is not installed: the cuda backend is unavailable")]
    triton_name = f"triton {version[0]}.{version[1]}"
    gpu = describe_device(device) if device.type == "cuda" and torch.cuda.is_available() else None
    if gpu is not None:
        runs, where = True, triton_name
    elif os.environ.get("TRITON_INTERPRET") == "1":
        runs, where = True, f"{triton_name}, on CPU tensors through the interpreter (TRITON_INTERPRET=1)"
    else:
        runs, where = False, f"{triton_name}; {device} runs them only under TRITON_INTERPRET=1"
    rows = [("row kernels (Triton)", runs, where)]
    for family in reversed(families.FAMILIES):
        available, why = family.available(gpu)
        rows.append((f"{family.name}: {family.title}", runs and available, why if runs else f"{where}; {why}"))
    return rows
