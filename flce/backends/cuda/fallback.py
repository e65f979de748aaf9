"""The CUDA launchers' one fallback: a kernel that fails to compile (a GPU or Triton version it was not
written for, too little shared memory for its tiles) is logged once, recorded here, and its fallback runs
instead, now and for every later launch of it on that device and dtype. The kernel choice reads the record
(:func:`failures`), so later calls plan the fallback from the start and their records say why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
_log = logging.getLogger("flce")
# (device, dtype, kernel, configuration) -> the compiler's error, first line
_failed: dict[tuple[str, str, str, str], str] = {}


def compile_errors() -> tuple[type[BaseException], ...]:
    """What Triton raises when a kernel does not compile or does not fit the GPU."""
    import triton

    errors: list[type[BaseException]] = [triton.CompilationError, triton.OutOfResources]
    try:
        from triton.runtime.errors import PTXASError  # ptxas rejecting the kernel (e.g. an sm_90a-only instruction)

        errors.append(PTXASError)
    except ImportError:
        pass
    return tuple(errors)


def launch_or_fall_back(kernel: str, config: str, on: torch.Tensor, launch: Callable[[], T],
                        fallback: Callable[[], T], fallback_text: str) -> T:
    """``launch()``, or ``fallback()`` where ``kernel`` (with ``config``) failed to compile on ``on``'s device
    and dtype, now or before."""
    key = (str(on.device), str(on.dtype), kernel, config)
    if key not in _failed:
        try:
            return launch()
        except compile_errors() as error:
            text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            _failed[key] = text
            _log.warning("flce: %s (%s) failed to compile on %s %s (%s); using %s instead", kernel, config or "-",
                         on.device, on.dtype, text, fallback_text)
    return fallback()


def failures(device: torch.device, dtype: torch.dtype) -> dict[tuple[str, str], str]:
    """(kernel, configuration) -> error of the kernels that failed on this device and dtype."""
    if not _failed:
        return {}
    where = (str(device), str(dtype))
    return {(kernel, config): error for (dev, dt, kernel, config), error in _failed.items() if (dev, dt) == where}


def failed_kernels() -> dict[tuple[str, str, str, str], str]:
    """Every failure so far: (device, dtype, kernel, configuration) -> error."""
    return dict(_failed)


def forget() -> None:
    """Try every kernel again (tests; a process whose GPU setup changed)."""
    _failed.clear()
