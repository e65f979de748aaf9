"""Memory figures every backend's planner uses."""

from __future__ import annotations

import os

import torch

GiB = 1 << 30
MiB = 1 << 20


def total_memory_bytes(device: torch.device) -> int:
    """Device memory for accelerators, physical RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "npu":
        return torch.npu.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_logits_save_limit(device: torch.device) -> int:
    """Largest logits (bytes) kept from forward for backward when the cache has no tuned value."""
    return logits_save_limit_for(total_memory_bytes(device))


def logits_save_limit_for(total_memory: int) -> int:
    """max(1 GiB, min(4 GiB, total memory / 8))."""
    return max(GiB, min(4 * GiB, total_memory // 8))
