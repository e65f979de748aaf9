"""The CUDA launchers' one fallback: a kernel family whose kernel for a role fails to compile (a GPU or Triton
version it was not written for, too little shared memory for its tiles) is logged once, recorded here, and the
next family of the role's chain (the kernel choice's, cuda/configs.py KernelChoice) runs instead, now and for
every later launch on that device and dtype. The kernel choice reads the record (:func:`failures`), so later
calls plan the fallback from the start and their records say why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from flce.backends.cuda.configs import LaunchSettings
    from flce.backends.cuda.families.family import KernelFamily

T = TypeVar("T")
_log = logging.getLogger("flce")
# (device, dtype, family, compile key) -> the compiler's error, first line
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


def launch_or_fall_back(chain: tuple[KernelFamily, ...], role: str, settings: LaunchSettings, on: torch.Tensor,
                        launch: Callable[[KernelFamily], T]) -> T:
    """``launch(family)`` with the first family of ``chain`` whose kernel for ``role`` has not failed to compile on
    ``on``'s device and dtype, now or before; the chain's last family (cuBLAS: nothing of it compiles) runs
    whatever happened before it."""
    for position, family in enumerate(chain):
        if position == len(chain) - 1:
            return launch(family)
        key = (str(on.device), str(on.dtype), family.name, family.compile_key(role, settings))
        if key in _failed:
            continue
        try:
            return launch(family)
        except compile_errors() as error:
            text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            _failed[key] = text
            _log.warning("flce: %s (%s, %s) failed to compile on %s %s (%s); using %s instead", family.title, role,
                         key[3], on.device, on.dtype, text, chain[position + 1].title)
    raise ValueError(f"no kernel family for {role}: the kernel choice gave an empty chain")


def failures(device: torch.device, dtype: torch.dtype) -> dict[tuple[str, str], str]:
    """(family, compile key) -> error of the kernels that failed on this device and dtype."""
    if not _failed:
        return {}
    where = (str(device), str(dtype))
    return {(family, key): error for (dev, dt, family, key), error in _failed.items() if (dev, dt) == where}


def failed_kernels() -> dict[tuple[str, str, str, str], str]:
    """Every failure so far: (device, dtype, family, compile key) -> error."""
    return dict(_failed)


def forget() -> None:
    """Try every kernel again (tests; a process whose GPU setup changed)."""
    _failed.clear()
