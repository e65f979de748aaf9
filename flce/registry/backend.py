"""The descriptor every backend registers once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry.probes import HardwareProbe

VARIANTS = ("plain", "full")

# run(flat_inputs, config, variant) -> loss or LCEOutput
RunFn = Callable[[FlatInputs, LCEConfig, str], "torch.Tensor | LCEOutput"]
# chunked(flat_inputs, config, variant, training=None) -> flce.backends.chunked_function.ChunkedCall:
# the backend's kernels and plan, for callers that drive the chunk loop themselves (vocab-parallel,
# custom ops). training says whether gradients follow; None infers it from grad mode and the inputs,
# which a caller already inside an autograd op (grad mode off) must not rely on.
ChunkedFn = Callable[[FlatInputs, LCEConfig, str], Any]


@dataclass(frozen=True)
class Backend:
    """name: what users pass as backend=; device_types: torch device types it serves;
    priority: higher wins among available backends; is_available(probe) and
    supports(config, flat_inputs) answer (ok, reason); run computes a call; chunked, for
    backends built on the shared chunk loop, exposes their kernels and plan."""

    name: str
    device_types: tuple[str, ...]
    priority: int
    is_available: Callable[[HardwareProbe], tuple[bool, str]]
    supports: Callable[[LCEConfig, FlatInputs], tuple[bool, str]]
    run: RunFn
    chunked: ChunkedFn | None = None
    variants: tuple[str, ...] = VARIANTS

    def serves(self, device_type: str) -> bool:
        """True for its own device types (every type for "any")."""
        return "any" in self.device_types or device_type in self.device_types

    def serves_when_asked(self, device_type: str, probe: HardwareProbe) -> bool:
        """Also CPU tensors under the Triton interpreter, for Triton backends (that list
        "interpret"), but only when asked for by name: never picked automatically."""
        if self.serves(device_type):
            return True
        return device_type == "cpu" and "interpret" in self.device_types and probe.triton_interpret[0]
