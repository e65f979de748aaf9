"""Backend descriptors, device detection and selection."""

from flce.registry.backend import VARIANTS, Backend
from flce.registry.dispatch import dispatch, engine_candidates, resolve_call
from flce.registry.probes import HardwareProbe, system_probe
from flce.registry.selection import (
    BACKEND_ENV,
    Candidates,
    available_backends,
    candidates_for,
    choose_for_call,
    register_backend,
    registered_backends,
    resolve_device,
)

__all__ = [
    "BACKEND_ENV", "VARIANTS", "Backend", "Candidates", "HardwareProbe", "available_backends",
    "candidates_for", "choose_for_call", "engine_candidates", "dispatch", "register_backend",
    "registered_backends", "resolve_call", "resolve_device", "system_probe",
]
