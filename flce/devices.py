"""The device a call that names none runs on: the current accelerator where this process can use one, else
the CPU. A CUDA build of torch on a machine without a GPU (the default wheel on most laptops and CI runners)
has an accelerator at build time and none at run time: that machine is a CPU machine."""

from __future__ import annotations

import torch


def _built_accelerator() -> torch.device | None:
    """The accelerator this torch was built for, usable here or not."""
    return torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None


def _usable(device: torch.device) -> bool:
    if hasattr(torch.accelerator, "is_available"):
        return torch.accelerator.is_available()
    try:
        return torch.get_device_module(device.type).is_available()
    except Exception:  # a device type whose module is missing or broken (e.g. npu without torch_npu)
        return False


def default_device() -> torch.device:
    """The current accelerator when this process can use it, else the CPU (:func:`cpu_fallback_reason` says
    why, where torch was built for an accelerator)."""
    built = _built_accelerator()
    return built if built is not None and _usable(built) else torch.device("cpu")


def cpu_fallback_reason() -> str | None:
    """Why :func:`default_device` is the CPU although torch was built for an accelerator; None otherwise."""
    built = _built_accelerator()
    if built is None or _usable(built):
        return None
    return (f"torch {torch.__version__} is built for {built.type}, but no {built.type} device is usable in this "
            f"process (torch.accelerator.is_available() is False: no device or no driver here), so the CPU")
