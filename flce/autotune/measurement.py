"""What the tuner checks and records of one measurement: a run's result, why a candidate was skipped,
whether it computed what the heuristic computes, and the figures an entry stores."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flce.autotune.schema import Scalar

# Relative tolerance of a candidate's loss / hidden gradient against the heuristic's, per dtype.
_AGREEMENT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_LOW_PRECISION_RTOL = 3e-2


@dataclass
class Run:
    ms: float
    working_bytes: int | None
    peak_kind: str
    loss: float
    grad_hidden: torch.Tensor | None


class Skip(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail


def versions() -> dict[str, str]:
    import flce

    found = {"flce": flce.__version__, "torch": torch.__version__.split("+")[0]}
    try:
        import triton

        found["triton"] = triton.__version__
    except Exception:  # triton is optional; a broken install must not stop a tune
        found["triton"] = "none"
    return found


def check_agreement(dtype: torch.dtype, reference: Run, loss: float, grad_hidden: torch.Tensor | None) -> None:
    """A candidate must compute what the heuristic computes: chunking may only reorder sums."""
    rtol = _AGREEMENT_RTOL.get(dtype, _LOW_PRECISION_RTOL)
    if not math.isfinite(loss) or abs(loss - reference.loss) > rtol * max(1.0, abs(reference.loss)):
        raise Skip("wrong result", f"loss {loss} vs heuristic {reference.loss}")
    if grad_hidden is not None and reference.grad_hidden is not None:
        ref = reference.grad_hidden.double()
        error = float((grad_hidden.double() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not error <= rtol:
            raise Skip("wrong result", f"hidden gradient relative error {error:.2e} > {rtol:.0e}")


def size_text(value: int | None) -> str:
    if value is None:
        return "unknown size"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} B"


def round4(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def params_text(params: Mapping[str, Scalar] | None) -> str:
    if not params:
        return "heuristic"
    return " ".join(f"{k}={v}" for k, v in params.items())
