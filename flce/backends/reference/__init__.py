"""Pure-PyTorch backend: runs on any device; the CPU path. Its kernels are torch calls, so it has no
launchers (no ops.py); the float64 oracle the tests check every backend against is flce.testing."""

from __future__ import annotations

import torch

from flce.backends.reference import tuning  # noqa: F401  (registers the tuning space)
from flce.backends.reference.distillation import choose_distillation, plan_distillation
from flce.backends.reference.plan import choose, plan_call
from flce.config import LCEConfig
from flce.registry import Backend, HardwareProbe, register_backend


def _always_available(_probe: HardwareProbe) -> tuple[bool, str]:
    return True, "pure PyTorch, runs anywhere"


def _supports_everything(_cfg: LCEConfig, _dtype: torch.dtype, _hidden_size: int, _vocab: int) -> tuple[bool, str]:
    return True, "every option"


BACKEND = Backend(
    name="reference",
    device_types=("any",),
    priority=0,
    is_available=_always_available,
    supports=_supports_everything,
    plan_call=plan_call,
    choose=choose,
    plan_distillation=plan_distillation,
    choose_distillation=choose_distillation,
)
register_backend(BACKEND)
