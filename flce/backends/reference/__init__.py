"""Pure-PyTorch backend: runs on any device; the ground truth and the CPU path."""

from __future__ import annotations

from flce.backends.reference import tuning  # noqa: F401  (registers the tuning space)
from flce.backends.reference.function import reference_chunked_call, reference_linear_cross_entropy
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.registry import Backend, HardwareProbe, register_backend


def _always_available(_probe: HardwareProbe) -> tuple[bool, str]:
    return True, "pure PyTorch, runs anywhere"


def _supports_everything(_cfg: LCEConfig, _flat: FlatInputs) -> tuple[bool, str]:
    return True, "every option"


BACKEND = Backend(
    name="reference",
    device_types=("any",),
    priority=0,
    is_available=_always_available,
    supports=_supports_everything,
    run=reference_linear_cross_entropy,
    chunked=reference_chunked_call,
)
register_backend(BACKEND)
