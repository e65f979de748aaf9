"""Stable names for devices and dtypes, the first two parts of every cache key."""

from __future__ import annotations

import platform

import torch

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
    "fp64": "float64", "double": "float64", "float64": "float64",
}

_device_names: dict[tuple[str, int | None], str] = {}
_dtype_names: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype | str) -> str:
    """"bfloat16", "float16", "float32", ... for a torch dtype or a common spelling of one."""
    if isinstance(dtype, torch.dtype):
        name = _dtype_names.get(dtype)
        if name is None:
            name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.strip().lower().removeprefix("torch."))
        if name is not None:
            return name
    raise ValueError(f"dtype={dtype!r}: expected a floating torch dtype or one of {sorted(_DTYPE_ALIASES)}")


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype_name(dtype))


def device_name(device: torch.device) -> str:
    """What the cache files call this device: the accelerator's marketing name
    (``torch.cuda.get_device_name``, ``torch.npu.get_device_name``), or ``cpu:<model name>``."""
    index = device.index
    if index is None and device.type in ("cuda", "npu", "xpu"):
        index = torch.get_device_module(device.type).current_device()
    key = (device.type, index)
    name = _device_names.get(key)
    if name is None:
        name = _device_names[key] = _query_device_name(device.type, index)
    return name


def _query_device_name(device_type: str, index: int | None) -> str:
    if device_type == "cpu":
        return f"cpu:{cpu_model_name()}"
    module = getattr(torch, device_type, None)
    get_name = getattr(module, "get_device_name", None)
    if get_name is None:
        return device_type
    return str(get_name(index))


def cpu_model_name() -> str:
    """The "model name" line of /proc/cpuinfo (x86), else what the platform module reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
