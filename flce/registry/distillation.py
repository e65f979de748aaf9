"""Which backend serves a linear distillation call: the cross-entropy's selection order (explicit
``backend=`` > ``FLCE_BACKEND`` > the best available), among the backends that have distillation kernels
(``Backend.plan_distillation``), with a one-time warning that says why a better one was passed over.

As :func:`flce.registry.dispatch.resolve_call`, the resolution takes and returns constants only and is
marked constant for Dynamo: a compiled step calls it once per graph, outside the trace.
"""

from __future__ import annotations

import os

import torch

from flce.config import LCEConfig
from flce.errors import InputError
from flce.registry.dispatch import _SELECTION_ENV
from flce.registry.probes import HardwareProbe
from flce.registry.selection import candidates_for, registry_state, warn_passed_over

_memo: dict[tuple, str] = {}


def resolve_distillation(device_type: str, backend: str | None, dtype: torch.dtype, hidden_size: int, vocab: int,
                         probe: HardwareProbe | None) -> str:
    """The name of the backend that runs a distillation call on ``device_type`` (raises as selection does)."""
    key = (device_type, backend, dtype, hidden_size, vocab, probe,
           tuple(os.environ.get(name) for name in _SELECTION_ENV), registry_state())
    name = _memo.get(key)
    if name is None:
        name = _memo[key] = _resolve(device_type, backend, dtype, hidden_size, vocab, probe)
    return name


resolve_distillation._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _resolve(device_type: str, backend: str | None, dtype: torch.dtype, hidden_size: int, vocab: int,
             probe: HardwareProbe | None) -> str:
    candidates = candidates_for(device_type, backend, probe)
    passed_over = list(candidates.passed_over)
    # A plain call of the same dtype and sizes stands for what the backend's kernels take.
    plain = LCEConfig()
    for b in candidates.backends:
        if b.plan_distillation is None:
            if candidates.explicit:
                raise InputError(f"backend {b.name!r} has no linear distillation kernels; backends that have: "
                                 f"{distillation_backends()}")
            passed_over.append((b.name, "no linear distillation kernels"))
            continue
        ok, reason = b.supports(plain, dtype, hidden_size, vocab)
        if ok:
            if passed_over:
                warn_passed_over(b.name, passed_over, "linear distillation ", stacklevel=5)
            return b.name
        if candidates.explicit:
            raise InputError(f"backend {b.name!r} does not support this distillation call: {reason}")
        passed_over.append((b.name, reason))
    raise RuntimeError(f"no backend supports this distillation call: {passed_over}")


def distillation_backends() -> list[str]:
    """The registered backends with distillation kernels."""
    return sorted(name for name, b in registry_state() if b.plan_distillation is not None)

