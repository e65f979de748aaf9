"""Test helpers for the CUDA backend's kernel choice: the choice for given inputs on a described GPU (so
Hopper's decisions are testable without one) with a given autotune entry, and launchers with a chosen
configuration for the interpreter. Import as ``from planning import ...`` (tests/ is on sys.path)."""

from __future__ import annotations

import torch

from flce.autotune.lookup import TunedEntry
from flce.config import LCEConfig
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription
from flce.engine.plans import Plan, PlanRequest
from flce.inputs import FlatInputs


def described_gpu(name: str = "NVIDIA H100 80GB HBM3") -> DeviceDescription:
    from flce.backends.cuda.hardware import gpu_description

    return gpu_description(name, triton="3.6.0")


def cuda_choice(flat: FlatInputs, cfg: LCEConfig | None = None, *, training: bool = True, sharded: bool = False,
                params: dict | None = None, limit: int | None = None, device: DeviceDescription | None = None,
                variant: str | None = None, failed: dict | None = None) -> tuple[CallChoice, object]:
    """(record, KernelChoice) of the CUDA backend for ``flat`` on ``device`` (default: the inputs' own) with
    the autotune entry ``params``/``limit`` (None: nothing cached)."""
    from flce.backends.cuda.choice import choose
    from flce.backends.cuda.hardware import describe_device

    cfg = cfg or LCEConfig()
    variant = variant or ("full" if cfg.needs_full or sharded else "plain")
    call = CallDescription.of(flat, cfg, variant, PlanRequest(training=training, sharded=sharded))
    entry = TunedEntry(params, limit, "the test's entry" if params or limit is not None else "none")
    return choose(device or describe_device(flat.hidden.device), call, entry, failed)


def cuda_plan(flat: FlatInputs, cfg: LCEConfig | None = None, **kwargs) -> Plan:
    return cuda_choice(flat, cfg, **kwargs)[0].plan


def meta_inputs(n: int, h: int, v: int, dtype: torch.dtype = torch.bfloat16, bias: bool = False) -> FlatInputs:
    """Inputs of a shape that allocate nothing, for planning."""
    def empty(*size: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device="meta")

    target = empty(n, dtype=torch.int64)
    return FlatInputs(hidden=empty(n, h), weight=empty(v, h), target=target, bias=empty(v) if bias else None,
                      token_shape=target.shape)


def interpreter_kernels(launch: object = None, **families: str) -> object:
    """The CUDA launchers as the choice configures them for the interpreter (the Triton GEMM without TMA in every
    fused role, cuBLAS for the products), with ``launch`` (a LaunchParams) and, per role, a family by name
    (``statistics="warp_specialized"``; families/family.py's ROLES), each followed by cuBLAS in its chain."""
    from flce.backends.cuda.configs import LaunchParams, LaunchSettings, default_gemm_config
    from flce.backends.cuda.families import KernelChoice, family_named
    from flce.backends.cuda.families.family import PRODUCTS, ROLES
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.ops import TritonChunkKernels

    names = {role: "triton" for role in ROLES} | {PRODUCTS: "cublas"} | families
    cublas = family_named("cublas")
    chains = {role: (family_named(name),) + ((cublas,) if name != "cublas" else ()) for role, name in names.items()}
    gemm = default_gemm_config(describe_device(torch.device("cpu")), torch.float32)
    settings = LaunchSettings(launch=launch or LaunchParams(block_v=4096), gemm=gemm, fallback_scan_block=512)
    return TritonChunkKernels(KernelChoice(chains=chains, settings=settings))


def reference_plan(flat: FlatInputs, cfg: LCEConfig | None = None, *, training: bool = True) -> Plan:
    """The reference planner's plan for ``flat`` on its own device."""
    from flce.backends.reference.plan import choose
    from flce.engine.choice import describe_device

    cfg = cfg or LCEConfig()
    call = CallDescription.of(flat, cfg, "full" if cfg.needs_full else "plain", PlanRequest(training=training))
    return choose(describe_device(flat.hidden.device), call).plan


def reference_bytes_per_row(flat: FlatInputs, cfg: LCEConfig | None = None) -> int:
    """The reference planner's working memory per token row for these inputs."""
    from flce.backends.reference.plan import working_bytes_per_row

    return working_bytes_per_row(flat.hidden.device.type, flat.weight.shape[0], flat.weight.dtype, cfg or LCEConfig())


def ascend_plan(flat: FlatInputs, cfg: LCEConfig, props: object, variant: str) -> Plan:
    """The Ascend planner's plan for ``flat`` on a device of these AscendDeviceProperties."""
    from flce.backends.ascend.plan import choose

    device = DeviceDescription(type="npu", name="test NPU", total_memory=props.total_memory_bytes,
                               multiprocessors=props.vector_cores)
    return choose(device, CallDescription.of(flat, cfg, variant, PlanRequest(training=True)), props=props).plan
