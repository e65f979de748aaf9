"""The CUDA backend's hardware predicates, on a DeviceDescription (flce.engine.choice) and never on the
driver: the choice of kernels is a pure function of the description, so ``python -m flce explain`` makes
it on a machine without the GPU. :func:`describe_device` is the one place that asks the driver (the launchers
read the SM count from it: :func:`multiprocessors`).

``FLCE_CUDA_PLAN_AS`` (a GPU name of :data:`KNOWN_GPUS`, e.g. ``"NVIDIA A100-SXM4-80GB"``) makes every call plan
as that GPU would: its compute capability decides which kernel families fit (an sm_80 or sm_89 GPU has neither
TMA nor the warp-specialised Gluon GEMM) and the autotune cache is read under its name, while the kernels run
on the GPU at hand, with its SM count and memory. Tests and benchmarks use it to run the generic kernels on a
Hopper GPU; the record says so.

Neither torch.cuda nor triton is imported for a predicate: Triton's version is read from the installed
package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import replace
from functools import cache

import torch

from flce.engine.choice import DeviceDescription

KiB, MiB = 1 << 10, 1 << 20
# GPUs explain can describe by name (the names torch.cuda.get_device_name reports, as the autotune cache keys
# them): compute capability, streaming multiprocessors, memory (about what the driver reports; the planners read it
# only for the logits-save limit, 4 GiB on every GPU of 32 GiB or more) and the shared memory one block may use (the
# CUDA programming guide's opt-in maximum per compute capability: the Triton GEMMs' tiles must fit it).
KNOWN_GPUS: dict[str, tuple[tuple[int, int], int, int, int]] = {
    "NVIDIA H100 80GB HBM3": ((9, 0), 132, 81559 * MiB, 227 * KiB),
    "NVIDIA H100 PCIe": ((9, 0), 114, 81559 * MiB, 227 * KiB),
    "NVIDIA H100 NVL": ((9, 0), 132, 95830 * MiB, 227 * KiB),
    "NVIDIA H200": ((9, 0), 132, 143771 * MiB, 227 * KiB),
    "NVIDIA GH200 480GB": ((9, 0), 132, 97871 * MiB, 227 * KiB),
    "NVIDIA A100-SXM4-80GB": ((8, 0), 108, 81251 * MiB, 163 * KiB),
    "NVIDIA A100-SXM4-40GB": ((8, 0), 108, 40536 * MiB, 163 * KiB),
    "NVIDIA A100 80GB PCIe": ((8, 0), 108, 81251 * MiB, 163 * KiB),
    "NVIDIA L40S": ((8, 9), 142, 46068 * MiB, 99 * KiB),
    "NVIDIA GeForce RTX 4090": ((8, 9), 128, 24564 * MiB, 99 * KiB),
    "NVIDIA B200": ((10, 0), 148, 183359 * MiB, 227 * KiB),
    "NVIDIA GeForce RTX 5090": ((12, 0), 170, 32607 * MiB, 99 * KiB),
}
# The oldest Triton flce's kernels build with (pyproject.toml's triton>=3.5; gluon_compat.py maps Gluon's names
# from 3.5 to 3.9), and the Triton a described GPU is assumed to have where none is installed or named (the GPU
# machines' and CI's).
OLDEST_TRITON = (3, 5)
TESTED_TRITON = "3.6.0"
PLAN_AS_ENV = "FLCE_CUDA_PLAN_AS"


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


def triton_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string ("3.6.0", "3.5.1+git..."), None where it cannot be read."""
    try:
        major, minor = version.split("+")[0].split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()))
    except ValueError:
        return None


def triton_too_old(triton_version: str | None) -> str | None:
    """Why flce's kernels cannot be built with this Triton (absent, unreadable, older than OLDEST_TRITON), or
    None where they can."""
    if triton_version is None:
        return "triton is not installed"
    release = triton_release(triton_version)
    if release is None:
        return f"triton {triton_version}: cannot read its version"
    if release < OLDEST_TRITON:
        return (f"triton {triton_version} is older than {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]}, the oldest flce's "
                "kernels build with")
    return None


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
    """The description of a real call's device: a CUDA GPU from its driver (once per device), planned as the GPU
    FLCE_CUDA_PLAN_AS names where it is set, or the Triton interpreter's CPU."""
    if device.type != "cuda":
        return _interpreter(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu(index, os.environ.get(PLAN_AS_ENV) or None)


def multiprocessors(device: torch.device) -> int:
    """The SM count a launcher sizes its grid by: the GPU's own (also where it plans as another), 4 for the
    interpreter's CPU."""
    return describe_device(device).multiprocessors if device.type == "cuda" else 4


@cache
def _gpu(index: int, plan_as: str | None) -> DeviceDescription:
    props = torch.cuda.get_device_properties(index)
    real = DeviceDescription(type="cuda", name=torch.cuda.get_device_name(index), total_memory=props.total_memory,
                             capability=(props.major, props.minor), multiprocessors=props.multi_processor_count,
                             triton=installed_triton(),
                             shared_memory=getattr(props, "shared_memory_per_block_optin", 0))
    if plan_as is None:
        return real
    if plan_as not in KNOWN_GPUS:
        raise ValueError(f"{PLAN_AS_ENV}={plan_as!r}: not a GPU flce knows by name; expected one of "
                         f"{sorted(KNOWN_GPUS)}")
    capability, _, _, shared_memory = KNOWN_GPUS[plan_as]
    return replace(real, name=plan_as, capability=capability, shared_memory=min(shared_memory, real.shared_memory),
                   runs_on=real.name)


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
    for what, value in (("multiprocessors", multiprocessors), ("total_memory", total_memory)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what}={value!r}: expected a positive number")
    if capability is not None and not (len(capability) == 2 and all(isinstance(c, int) and c >= 0 for c in capability)
                                       and capability >= (1, 0)):
        raise ValueError(f"capability={capability!r}: expected (major, minor), e.g. (9, 0)")
    return DeviceDescription(type="cuda", name=name, total_memory=total_memory or known[2],
                             capability=capability or known[0], multiprocessors=multiprocessors or known[1],
                             triton=triton or installed_triton() or TESTED_TRITON,
                             shared_memory=known[3] if known and not capability else 0)
