"""Where a distillation call enters the engine: the custom ops while torch.compile traces, else the
eager Function."""

from __future__ import annotations

import torch
from torch import Tensor

from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import FlatPair
from flce.engine.distillation.custom_ops import apply_op
from flce.engine.distillation.function import apply_eager, wanted_gradients
from flce.engine.plans import PlanRequest
from flce.registry import Backend


def run_distillation(backend: Backend, pair: FlatPair, cfg: DistillationConfig) -> Tensor:
    """Compute one unsharded call on ``backend``."""
    if torch.compiler.is_compiling():
        return apply_op(backend.name, pair, cfg)
    training = wanted_gradients(pair, cfg.teacher_grad).any
    return apply_eager(pair, backend.plan_distillation(pair, cfg, PlanRequest(training=training)))
