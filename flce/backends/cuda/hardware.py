"""The CUDA backend's hardware predicates, on a DeviceDescription (flce.engine.choice) and never on the
driver: the choice of kernels is a pure function of the description, so ``python -m flce explain`` makes
it on a machine without the GPU. :func:`describe_device` is the one place that asks the driver.

Neither torch.cuda nor triton is imported for a predicate: Triton's version is read from the installed
package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import logging
from functools import cache

import torch

from flce.engine.choice import DeviceDescription

MiB = 1 << 20
# GPUs explain can describe by name alone (the names torch.cuda.get_device_name reports, as the autotune
# cache keys them): compute capability, streaming multiprocessors, memory (about what the driver reports;
# the planners read it only for the logits-save limit, 4 GiB on every GPU of 32 GiB or more).
KNOWN_GPUS: dict[str, tuple[tuple[int, int], int, int]] = {
    "NVIDIA H100 80GB HBM3": ((9, 0), 132, 81559 * MiB),
    "NVIDIA H100 PCIe": ((9, 0), 114, 81559 * MiB),
    "NVIDIA H100 NVL": ((9, 0), 132, 95830 * MiB),
    "NVIDIA H200": ((9, 0), 132, 143771 * MiB),
    "NVIDIA GH200 480GB": ((9, 0), 132, 97871 * MiB),
    "NVIDIA A100-SXM4-80GB": ((8, 0), 108, 81251 * MiB),
    "NVIDIA A100-SXM4-40GB": ((8, 0), 108, 40536 * MiB),
    "NVIDIA A100 80GB PCIe": ((8, 0), 108, 81251 * MiB),
    "NVIDIA L40S": ((8, 9), 142, 46068 * MiB),
    "NVIDIA GeForce RTX 4090": ((8, 9), 128, 24564 * MiB),
    "NVIDIA B200": ((10, 0), 148, 183359 * MiB),
}
# The oldest Triton whose Gluon API the warp-specialised kernels build with (gluon_compat.py maps 3.5 to 3.9;
# its OLDEST_TRITON, restated here so that a predicate imports no Triton), and the Triton a described GPU
# is assumed to have where none is installed or named (the GPU machines' and CI's).
OLDEST_GLUON_TRITON = (3, 5)
TESTED_TRITON = "3.6.0"


def is_hopper(device: DeviceDescription) -> bool:
    """sm_90 (H100, H200, GH200): the architecture the warp-specialised kernels (wgmma, setmaxnreg,
    TMA) are compiled for. Not sm_100 and later, whose tensor cores take other instructions."""
    return device.capability == (9, 0) and not device.interpreter


def has_tma(device: DeviceDescription) -> bool:
    """Tensor-memory-accelerator loads and stores (tensor descriptors): sm_90 and later."""
    return device.capability is not None and device.capability >= (9, 0) and not device.interpreter


def has_16bit_tensor_cores(device: DeviceDescription) -> bool:
    """bf16/fp16 tensor cores that a Triton dot reaches at full rate: sm_80 and later."""
    return device.capability is not None and device.capability >= (8, 0) and not device.interpreter


def triton_supports_gluon_hopper(triton_version: str | None) -> tuple[bool, str]:
    """Whether this Triton has the Gluon API the warp-specialised kernels are written against
    (``triton.experimental.gluon`` with Hopper's warpgroup MMA, TMA and warp specialisation)."""
    if triton_version is None:
        return False, "triton is not installed"
    try:
        release = tuple(int(part) for part in triton_version.split("+")[0].split(".")[:2])
    except ValueError:
        return False, f"triton {triton_version}: cannot read its version"
    if release < OLDEST_GLUON_TRITON:
        return False, (f"triton {triton_version} predates the Gluon API the kernels build with (3.5 and later, "
                       "gluon_compat.py)")
    return True, f"triton {triton_version} has Gluon"


def warp_specialized_available(device: DeviceDescription) -> tuple[bool, str]:
    """(available, why) for the warp-specialised Gluon kernel family on this device."""
    if device.interpreter:
        return False, "the Triton interpreter runs no Gluon kernel"
    if not is_hopper(device):
        return False, f"{device.arch}: the kernels are written for sm_90 (Hopper)"
    builds, why = triton_supports_gluon_hopper(device.triton)
    if builds and device.triton == installed_triton():
        # The Triton installed here: whether its Gluon module has what the kernels call (a broken install, or
        # triton-ascend under the same name, has the version but not the API), probed once per process.
        from flce.backends.cuda.gluon_compat import gluon_support

        builds, why = gluon_support()
        if not builds:
            _say_once(f"flce: the warp-specialised Gluon GEMM cannot be built here ({why}); the fused Triton GEMM "
                      "and cuBLAS take its place")
    return builds, why


@cache
def _say_once(message: str) -> None:
    logging.getLogger("flce").warning(message)


@cache
def installed_triton() -> str | None:
    """The installed Triton's version, from its package metadata (triton is not imported)."""
    for name in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def describe_device(device: torch.device) -> DeviceDescription:
    """The description of a real call's device: a CUDA GPU from its driver (once per device), or the
    Triton interpreter's CPU."""
    if device.type != "cuda":
        return _interpreter(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu(index)


@cache
def _gpu(index: int) -> DeviceDescription:
    props = torch.cuda.get_device_properties(index)
    return DeviceDescription(type="cuda", name=torch.cuda.get_device_name(index), total_memory=props.total_memory,
                             capability=(props.major, props.minor), multiprocessors=props.multi_processor_count,
                             triton=installed_triton())


@cache
def _interpreter(device_type: str) -> DeviceDescription:
    from flce.autotune.devices import device_name
    from flce.engine.memory import total_memory_bytes

    device = torch.device(device_type)
    return DeviceDescription(type=device_type, name=device_name(device), total_memory=total_memory_bytes(device),
                             interpreter=True, triton=installed_triton())


def gpu_description(name: str, capability: tuple[int, int] | None = None, multiprocessors: int | None = None,
                    total_memory: int | None = None, triton: str | None = None) -> DeviceDescription:
    """A GPU described by name (KNOWN_GPUS), each figure replaceable; an unknown name needs them all.
    ``triton``: the version the kernels compile with (default: the installed one, else the tested one)."""
    known = KNOWN_GPUS.get(name)
    if known is None and None in (capability, multiprocessors, total_memory):
        raise ValueError(f"gpu={name!r}: not a GPU flce knows by name (one of {sorted(KNOWN_GPUS)}); give its "
                         "compute capability, SM count and memory too")
    capability = capability or known[0]
    return DeviceDescription(type="cuda", name=name, total_memory=total_memory or known[2],
                             capability=capability, multiprocessors=multiprocessors or known[1],
                             triton=triton or installed_triton() or TESTED_TRITON)
