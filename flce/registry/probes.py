"""Hardware probes, injectable so selection is testable on a machine without the hardware.

``FLCE_PROBE_OVERRIDE="cuda=1,npu=0,triton=1"`` (or a :class:`HardwareProbe` passed to
the selection functions) replaces what the real probes would report.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from flce.errors import InputError

PROBE_ENV = "FLCE_PROBE_OVERRIDE"
PROBE_NAMES = ("cuda", "npu", "triton", "triton_interpret")


@dataclass(frozen=True)
class HardwareProbe:
    """What this process can use. Each field is (present?, reason when not)."""

    cuda: tuple[bool, str]
    npu: tuple[bool, str]
    triton: tuple[bool, str]
    triton_interpret: tuple[bool, str]

    @staticmethod
    def fake(**present: bool) -> HardwareProbe:
        """A probe reporting exactly what is given (missing names: absent)."""
        unknown = set(present) - set(PROBE_NAMES)
        if unknown:
            raise InputError(f"unknown probe names {sorted(unknown)}; expected some of {PROBE_NAMES}")
        return HardwareProbe(**{n: (present.get(n, False), "faked" if present.get(n) else f"{n} faked absent")
                                for n in PROBE_NAMES})


def system_probe() -> HardwareProbe:
    """The real hardware, with FLCE_PROBE_OVERRIDE applied on top."""
    real = _real_probe()
    # The interpreter switch is an environment variable tests flip: never cached.
    real = HardwareProbe(cuda=real.cuda, npu=real.npu, triton=real.triton, triton_interpret=_probe_interpret())
    override = os.environ.get(PROBE_ENV, "").strip()
    if not override:
        return real
    values = dict(zip(PROBE_NAMES, (real.cuda, real.npu, real.triton, real.triton_interpret), strict=True))
    for item in override.split(","):
        name, _, flag = item.partition("=")
        name = name.strip()
        if name not in PROBE_NAMES or flag.strip() not in ("0", "1"):
            raise InputError(f"{PROBE_ENV}={override!r}: expected comma-separated name=0|1 with names {PROBE_NAMES}")
        present = flag.strip() == "1"
        values[name] = (present, f"{name} forced {'present' if present else 'absent'} by {PROBE_ENV}")
    return HardwareProbe(**values)


@lru_cache(maxsize=1)
def _real_probe() -> HardwareProbe:
    return HardwareProbe(cuda=_probe_cuda(), npu=_probe_npu(), triton=_probe_triton(),
                         triton_interpret=(False, "not probed"))


def _probe_cuda() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no NVIDIA/AMD GPU or a CPU-only torch build)"
    # No device_count() here: torch.compile traces this probe in the functional form, and a
    # torch call returning an int breaks the graph.
    return True, "torch.cuda.is_available()"


def _probe_npu() -> tuple[bool, str]:
    # Never import torch_npu unless it is installed: importing it has side effects on torch.
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (from a flce checkout: pip install -e '.[ascend]'; README, Install)"
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # a broken CANN install raises all kinds of errors
        return False, f"import torch_npu failed: {exc}"
    if not torch.npu.is_available():
        return False, "torch.npu.is_available() is False"
    return True, "torch.npu.is_available()"


def _probe_triton() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (from a flce checkout: pip install -e '.[triton]'; README, Install)"
    clash = triton_flavour_clash()
    if clash is not None:
        return False, clash
    return True, "triton importable"


def triton_flavour_clash() -> str | None:
    """Why Triton cannot be trusted when both flavours are installed, else None.

    The distributions ``triton`` (NVIDIA) and ``triton-ascend`` both install the ``triton``
    package: with both, the files of whichever came last overwrite part of the other's, and the
    result is neither. pip cannot refuse the combination (``flce[triton,ascend]`` installs both),
    so flce refuses to run Triton kernels on it. Read once per process, by the cached probe."""
    versions = {}
    for name in ("triton", "triton-ascend"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if len(versions) < 2:
        return None
    return (f"both triton {versions['triton']} and triton-ascend {versions['triton-ascend']} are installed; they "
            "provide the same `triton` package and overwrite each other: pip uninstall -y triton triton-ascend, then "
            "reinstall the one for this machine (flce extra 'triton' for NVIDIA GPUs, 'ascend' for Ascend NPUs)")


def _probe_interpret() -> tuple[bool, str]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True, "TRITON_INTERPRET=1"
    return False, "TRITON_INTERPRET is not 1"
