"""The descriptor every backend registers once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flce.config import VARIANTS, LCEConfig
from flce.errors import InputError
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry.probes import HardwareProbe

# run(flat_inputs, config, variant) -> loss or LCEOutput: a backend's own entry point.
RunFn = Callable[[FlatInputs, LCEConfig, str], "torch.Tensor | LCEOutput"]
# plan_call(flat_inputs, config, variant, request: flce.engine.plans.PlanRequest) -> flce.engine.call.EngineCall:
# the backend's kernels and the named plan the shared engine runs (request.training says whether
# gradients follow: a caller inside an autograd op, where grad mode is off, must say so).
PlanCallFn = Callable[[FlatInputs, LCEConfig, str, Any], Any]
# choose(device, call) -> flce.engine.choice.CallChoice for a flce.engine.choice.DeviceDescription and
# CallDescription: what plan_call decides for such a call, without its tensors or its device (explain).
ChooseFn = Callable[[Any, Any], Any]
# plan_distillation(pair, config, request) -> flce.engine.distillation.call.DistillCall for a
# flce.distillation.inputs.FlatPair and DistillationConfig; choose_distillation(device, description) -> the
# record of the same decision (flce.engine.choice.CallChoice) from a DistillDescription (explain).
PlanDistillationFn = Callable[[Any, Any, Any], Any]
# supports(config, dtype, hidden_size, vocab) -> (ok, reason): decided once per call signature.
SupportsFn = Callable[[LCEConfig, torch.dtype, int, int], tuple[bool, str]]


@dataclass(frozen=True)
class Backend:
    """name: what users pass as backend=; device_types: torch device types it serves;
    priority: higher wins among available backends; is_available(probe) and supports(config,
    dtype, hidden_size, vocab) answer (ok, reason). A backend built on the shared engine gives
    ``plan_call`` and the kernel ``capabilities`` it offers (flce.engine.kernels), and ``choose``, the same
    decision from descriptions (``python -m flce explain``); ``plan_distillation`` and ``choose_distillation`` the
    same for linear distillation (None: the backend has no distillation kernels); ``run`` replaces
    the engine for a backend with an entry point of its own (None: the engine runs ``plan_call``'s
    plan)."""

    name: str
    device_types: tuple[str, ...]
    priority: int
    is_available: Callable[[HardwareProbe], tuple[bool, str]]
    supports: SupportsFn
    plan_call: PlanCallFn | None = None
    choose: ChooseFn | None = None
    run: RunFn | None = None
    capabilities: frozenset[str] = frozenset()
    variants: tuple[str, ...] = VARIANTS
    # unavailable_on(device) -> why a described device (flce.engine.choice.DeviceDescription, ``python -m flce
    # explain``) could not run this backend, or None: what is_available checks here, asked of the description.
    unavailable_on: Callable[[Any], str | None] | None = None
    plan_distillation: PlanDistillationFn | None = None
    choose_distillation: ChooseFn | None = None

    def __post_init__(self) -> None:
        if self.plan_call is None and self.run is None:
            raise InputError(f"backend {self.name!r}: give plan_call (the shared engine runs it) or run")

    def serves(self, device_type: str) -> bool:
        """True for its own device types (every type for "any")."""
        return "any" in self.device_types or device_type in self.device_types

    def serves_when_asked(self, device_type: str, probe: HardwareProbe) -> bool:
        """Also CPU tensors under the Triton interpreter, for Triton backends (that list
        "interpret"), but only when asked for by name: never picked automatically."""
        if self.serves(device_type):
            return True
        return device_type == "cpu" and "interpret" in self.device_types and probe.triton_interpret[0]
