"""Which backend runs a call: the registry, device resolution and the selection order.

Order (docs/design.md, "Backend selection"): explicit ``backend=`` > ``FLCE_BACKEND`` > the
highest-priority available backend that supports the call > the reference backend, with a
one-time warning saying why the better one was passed over.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch

from flce.config import LCEConfig
from flce.devices import default_device
from flce.errors import InputError, InputTypeError
from flce.registry.backend import Backend
from flce.registry.probes import HardwareProbe, system_probe

BACKEND_ENV = "FLCE_BACKEND"
# Modules that register the built-in backends when imported. Each imports its
# heavy dependencies (triton, torch_npu) only when a kernel first runs.
_BUILTIN_MODULES = ("flce.backends.reference", "flce.backends.cuda", "flce.backends.ascend")

_registry: dict[str, Backend] = {}
_builtins_loaded = False
_warned: set[str] = set()


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend (third parties too). Re-registering a name needs replace=True."""
    if backend.name in _registry and not replace:
        raise InputError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
    _registry[backend.name] = backend


def backend_named(name: str) -> Backend:
    """The registered backend called ``name`` (a name selection has already resolved)."""
    return _registry[name]


def registry_state() -> tuple[tuple[str, Backend], ...]:
    """What is registered now, hashable: memoised selections are keyed by it, so registering or
    replacing a backend is seen at once."""
    _load_builtins()
    return tuple(_registry.items())


def registered_backends() -> list[Backend]:
    _load_builtins()
    return sorted(_registry.values(), key=lambda b: -b.priority)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in _BUILTIN_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def resolve_device(device: str | torch.device | torch.Tensor | None) -> torch.device:
    """A str, torch.device or tensor names the device; None means the current accelerator
    (CUDA, NPU, ...) if this process can use one, else the CPU."""
    if isinstance(device, torch.Tensor):
        return device.device
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise InputError(f"device={device!r}: not a device torch knows ({exc})") from None
    if device is None:
        return default_device()  # a CUDA build of torch without a GPU is a CPU machine
    raise InputTypeError(f"device={device!r}: expected a str, torch.device, tensor or None")


@dataclass(frozen=True)
class Candidates:
    """Backends to try for a device, best first; explicit when the user named one."""

    backends: tuple[Backend, ...]
    explicit: bool
    passed_over: tuple[tuple[str, str], ...]  # (name, reason) of better backends left out


def candidates_for(device_type: str, backend: str | None = None, probe: HardwareProbe | None = None,
                   described: object = None) -> Candidates:
    """The backends that may serve a call on ``device_type``: the named one (``backend``, else FLCE_BACKEND), or
    every registered backend that serves the type and is available, best first. ``described``: a
    flce.engine.choice.DeviceDescription of a device that is not here (``python -m flce explain``): its hardware
    and software are taken as present, and a backend is available unless its ``unavailable_on`` says why not."""
    probe = probe or system_probe()
    _load_builtins()

    def availability(b: Backend) -> tuple[bool, str]:
        if described is None:
            return b.is_available(probe)
        why_not = b.unavailable_on(described) if b.unavailable_on is not None else None
        return (False, why_not) if why_not else (True, "described")

    name = backend or os.environ.get(BACKEND_ENV) or None
    if name:
        source = "backend=" if backend else f"{BACKEND_ENV}="
        if name not in _registry:
            raise InputError(f"{source}{name!r}: unknown backend; registered: {sorted(_registry)}")
        chosen = _registry[name]
        ok, reason = availability(chosen)
        if not ok:
            raise RuntimeError(f"{source}{name!r}: backend is not available: {reason}")
        if not chosen.serves_when_asked(device_type, probe):
            raise RuntimeError(
                f"{source}{name!r}: backend serves device types {chosen.device_types}, not {device_type!r}"
            )
        return Candidates((chosen,), explicit=True, passed_over=())
    usable, passed_over = [], []
    for b in registered_backends():
        if not b.serves(device_type):
            continue
        ok, reason = availability(b)
        if ok:
            usable.append(b)
        elif "any" not in b.device_types:
            passed_over.append((b.name, reason))
    return Candidates(tuple(usable), explicit=False, passed_over=tuple(passed_over))


def choose_for_call(cands: Candidates, cfg: LCEConfig, dtype: torch.dtype, hidden_size: int, vocab: int,
                    warn: bool = True) -> Backend:
    """The first candidate that supports this call; warns once when a better one is skipped (``warn``)."""
    reasons = list(cands.passed_over)
    for b in cands.backends:
        ok, reason = b.supports(cfg, dtype, hidden_size, vocab)
        if ok:
            if reasons and warn:
                warn_passed_over(b.name, reasons)
            return b
        if cands.explicit:
            raise InputError(f"backend {b.name!r} does not support this call: {reason}")
        reasons.append((b.name, reason))
    raise RuntimeError(f"no backend supports this call: {reasons}")


def warn_passed_over(chosen: str, reasons: list[tuple[str, str]], what: str = "", stacklevel: int = 4) -> None:
    """The one-time warning that ``chosen`` serves a call (``what``: which kind, e.g. "linear distillation ")
    because the better backends in ``reasons`` were passed over."""
    key = f"{what}{chosen}|{reasons}"
    if key in _warned:
        return
    _warned.add(key)
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons)
    warnings.warn(f"flce: {what}using the {chosen!r} backend because a better one was passed over ({why})",
                  RuntimeWarning, stacklevel=stacklevel)


def available_backends(probe: HardwareProbe | None = None) -> list[dict]:
    """One row per registered backend: name, device types, priority, available, reason."""
    probe = probe or system_probe()
    rows = []
    for b in registered_backends():
        ok, reason = b.is_available(probe)
        rows.append({"name": b.name, "device_types": b.device_types, "priority": b.priority,
                     "available": ok, "reason": reason})
    return rows
