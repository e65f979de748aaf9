"""``flce.explain`` and ``python -m flce explain``: what a call would run, without running it and without
its device.

The call is described by numbers and names (device type and model, dtype, tokens x H x V, options, whether
gradients follow) and planned by the backend that would serve it, exactly as a real call on that device
plans (the backend's ``choose``, the same function its ``plan_call`` runs on a real call's description),
with the autotune cache's entry for the named device. What it prints is that record (flce.engine.choice):
the schedule and its sizes, the memory plan, and per step the kernel functions and why each was chosen.

    python -m flce explain --device cuda --gpu "NVIDIA H100 80GB HBM3" --dtype bfloat16 \\
        --shape 8192x4096x128256 --reduction none --return_logprobs true --no-grad
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any

import torch

from flce.autotune.devices import torch_dtype
from flce.config import LCEConfig, config_from_keywords
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription, describe_device
from flce.engine.plans import PlanRequest
from flce.registry import Backend, registered_backends
from flce.registry.selection import backend_named

DEFAULT_GPU = "NVIDIA H100 80GB HBM3"
# Ascend NPUs explain can describe by name: vector cores and device memory (UB size follows the SoC name).
KNOWN_NPUS = {"Ascend910B1": (48, 64 * 10**9), "Ascend910B2": (48, 64 * 10**9), "Ascend910B3": (40, 64 * 10**9),
              "Ascend910B4": (40, 32 * 10**9)}
DEFAULT_NPU = "Ascend910B3"
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def explain(device: str = "cuda", *, shape: str | tuple[int, int, int], dtype: str | torch.dtype = "bfloat16",
            gpu: str | None = None, npu: str | None = None, backend: str | None = None, variant: str = "auto",
            training: bool = True, bias: bool = False, sharded: bool = False,
            capability: tuple[int, int] | None = None, multiprocessors: int | None = None,
            total_memory: int | None = None, triton: str | None = None, **options: Any) -> CallChoice:
    """The record of what a call would run (``print`` it for the text). ``device``: "cuda", "cpu" or "npu"
    ("cpu" with ``backend="cuda"``: the CUDA kernels in the Triton interpreter);
    ``shape``: tokens x H x V; ``gpu``/``npu``: the model as the driver names it (flce.backends.cuda.hardware
    .KNOWN_GPUS, KNOWN_NPUS; an unknown GPU needs ``capability``, ``multiprocessors`` and ``total_memory``);
    ``triton``: the Triton version to assume; ``training``: gradients follow; ``options``: LCEConfig's."""
    n_rows, hidden, vocab = _shape(shape)
    cfg = config_from_keywords("explain", options)
    dtype = torch_dtype(dtype)
    described = _device(device, gpu, npu, capability, multiprocessors, total_memory, triton, backend)
    if sharded:
        variant = "full"  # a vocabulary shard's scan is the full variant's (flce.distributed)
    elif variant == "auto":
        variant = "full" if cfg.needs_full else "plain"
    elif variant == "plain" and cfg.needs_full:
        raise ValueError(f"variant='plain' cannot serve {', '.join(cfg.full_feature_options())}; use 'full' or 'auto'")
    chosen = _backend(described.type, backend, cfg, dtype, hidden, vocab)
    call = CallDescription(n_rows=n_rows, hidden=hidden, vocab=vocab, dtype=dtype, bias=bias, rows_aligned=True,
                           cfg=cfg, variant=variant, request=PlanRequest(training=training, sharded=sharded))
    return chosen.choose(described, call)


def _shape(shape: str | tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(shape, str):
        parts = shape.lower().replace(" ", "").split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape={shape!r}: expected TOKENSxHIDDENxVOCAB, e.g. 8192x4096x128256")
        shape = tuple(int(p) for p in parts)  # type: ignore[assignment]
    if len(shape) != 3 or min(shape) < 0 or min(shape[1:]) < 1:
        raise ValueError(f"shape={shape!r}: expected (tokens >= 0, hidden >= 1, vocab >= 1)")
    return shape  # type: ignore[return-value]


def _device(device: str, gpu: str | None, npu: str | None, capability: tuple[int, int] | None,
            multiprocessors: int | None, total_memory: int | None, triton: str | None,
            backend: str | None) -> DeviceDescription:
    if device == "cuda":
        from flce.backends.cuda.hardware import gpu_description

        return gpu_description(gpu or DEFAULT_GPU, capability, multiprocessors, total_memory, triton)
    if device == "npu":
        name = npu or DEFAULT_NPU
        cores, memory = KNOWN_NPUS.get(name, (None, None))
        if None in (cores or multiprocessors, memory or total_memory):
            raise ValueError(f"npu={name!r}: not an NPU flce knows by name (one of {sorted(KNOWN_NPUS)}); give its "
                             "vector cores and memory too")
        return DeviceDescription(type="npu", name=name, total_memory=total_memory or memory,
                                 multiprocessors=multiprocessors or cores)
    if device == "cpu" and backend == "cuda":
        # The CUDA backend's kernels on CPU tensors: the Triton interpreter (TRITON_INTERPRET=1).
        from flce.backends.cuda.hardware import describe_device as describe_for_cuda

        return describe_for_cuda(torch.device("cpu"))
    if device == "cpu":
        return describe_device(torch.device("cpu"))
    raise ValueError(f"device={device!r}: expected 'cuda', 'cpu' or 'npu'")


def _backend(device_type: str, name: str | None, cfg: LCEConfig, dtype: torch.dtype, hidden: int,
             vocab: int) -> Backend:
    """The named backend, else the one selection would pick on that device with its hardware present: the
    highest priority among those serving the device type that support the call, else the reference."""
    if name is not None:
        chosen = backend_named(name)
        if chosen.choose is None:
            raise ValueError(f"backend={name!r} has no planner to explain (no choose)")
        return chosen
    serving = sorted((b for b in registered_backends() if b.serves(device_type) and b.choose is not None),
                     key=lambda b: -b.priority)
    for candidate in serving:
        if candidate.supports(cfg, dtype, hidden, vocab)[0]:
            return candidate
    return backend_named("reference")


# ----------------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``python -m flce explain``'s arguments; every LCEConfig option as ``--name value``."""
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu", "npu"), help="device type (default cuda)")
    parser.add_argument("--gpu", default=None, help=f"GPU model as the driver names it (default {DEFAULT_GPU!r})")
    parser.add_argument("--npu", default=None, help=f"NPU model (default {DEFAULT_NPU!r})")
    parser.add_argument("--capability", default=None, help="compute capability of an unknown GPU, e.g. 9.0")
    parser.add_argument("--sms", type=int, default=None, help="streaming multiprocessors (vector cores on an NPU)")
    parser.add_argument("--memory", default=None, help="device memory, e.g. 80GiB")
    parser.add_argument("--triton", default=None, help="Triton version to assume (default: the installed one)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (default bfloat16)")
    parser.add_argument("--shape", required=True, help="TOKENSxHIDDENxVOCAB, e.g. 8192x4096x128256")
    parser.add_argument("--backend", default=None, help="a backend by name (default: what selection picks)")
    parser.add_argument("--variant", default="auto", choices=("auto", "plain", "full"))
    grads = parser.add_mutually_exclusive_group()
    grads.add_argument("--training", dest="training", action="store_true", default=True,
                       help="gradients follow (the default)")
    grads.add_argument("--no-grad", dest="training", action="store_false", help="no gradient: a forward-only call")
    parser.add_argument("--bias", action="store_true", help="the LM head has a bias")
    parser.add_argument("--vocab-shard", dest="sharded", action="store_true",
                        help="the weight is one rank's vocabulary shard (process_group)")
    for field in fields(LCEConfig):
        if field.name in ("process_group",):
            continue
        flags = sorted({f"--{field.name}", f"--{field.name.replace('_', '-')}"})
        parser.add_argument(*flags, dest=f"option_{field.name}", default=None, metavar="VALUE",
                            help=f"LCEConfig.{field.name} (default {field.default!r})")


def run(args: argparse.Namespace) -> int:
    options = {name.removeprefix("option_"): _option_value(name.removeprefix("option_"), value, args.shape)
               for name, value in vars(args).items() if name.startswith("option_") and value is not None}
    record = explain(args.device, shape=args.shape, dtype=args.dtype, gpu=args.gpu, npu=args.npu,
                     backend=args.backend, variant=args.variant, training=args.training, bias=args.bias,
                     sharded=args.sharded, capability=_capability(args.capability), multiprocessors=args.sms,
                     total_memory=None if args.memory is None else parse_size("--memory", args.memory),
                     triton=args.triton, **options)
    print(record)
    return 0


def _capability(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    major, _, minor = text.partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        raise ValueError(f"--capability {text!r}: expected MAJOR.MINOR, e.g. 9.0")
    return int(major), int(minor or 0)


def parse_size(flag: str, text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{flag} {text!r}: expected bytes, optionally with KiB, MiB or GiB")
    return int(match.group(1)) * _UNITS[(match.group(2) or "")[:1].lower()]


def _option_value(name: str, text: str, shape: str) -> object:
    """An option's value from its command-line text, by its type in LCEConfig."""
    lowered = text.strip().lower()
    if name == "class_weight":
        # Only their presence shapes the plan: a stand-in of the vocabulary's length.
        return None if lowered in ("none", "") else torch.ones(_shape(shape)[2], device="meta")
    if name == "accum_dtype":
        return None if lowered == "none" else torch_dtype(lowered)
    if name == "memory_budget":
        return None if lowered == "none" else parse_size("--memory_budget", text)
    kind = {f.name: f.type for f in fields(LCEConfig)}[name]
    if lowered == "none" and "None" in kind:
        return None
    if kind == "bool":
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--{name} {text!r}: expected true or false")
        return lowered in ("true", "1", "yes")
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    return text
