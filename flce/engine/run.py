"""Where a call enters the engine: the compile path's custom ops while torch.compile traces (so the
graph does not break), else the backend's own entry point, by default the eager Function."""

from __future__ import annotations

import torch
from torch import Tensor

from flce.config import LCEConfig
from flce.engine.custom_ops import apply_op
from flce.engine.function import apply_eager, needs_autograd
from flce.engine.objective import needs_statistics_first
from flce.engine.plans import PlanRequest
from flce.engine.schedule import planned_call
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry import Backend


def run_backend(backend: Backend, flat: FlatInputs, cfg: LCEConfig, variant: str) -> Tensor | LCEOutput:
    """Compute one unsharded call on ``backend``."""
    if backend.plan_call is not None and torch.compiler.is_compiling():
        return apply_op(backend.name, flat, cfg, variant)
    if backend.run is not None:
        return backend.run(flat, cfg, variant)
    request = PlanRequest(training=needs_autograd(flat), statistics_first=needs_statistics_first(flat))
    return apply_eager(flat, planned_call(backend, flat, cfg, variant, request))
