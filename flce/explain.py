"""``flce.explain`` and ``python -m flce explain``: what a call would run, without running it and without
its device.

The call is described by numbers and names (device type and model, dtype, tokens x H x V, options, whether
gradients follow) and planned by the backend that would serve it, exactly as a real call on that device
plans (the backend's ``choose``, the same function its ``plan_call`` runs on a real call's description),
with the autotune cache's entry for the named device. What it prints is that record (flce.engine.choice):
the schedule and its sizes, the memory plan, and per step the kernel functions and why each was chosen.

    python -m flce explain --device cuda --gpu "NVIDIA H100 80GB HBM3" --dtype bfloat16 \\
        --shape 8192x4096x128256 --reduction none --return_logprobs true --no-grad
    python -m flce explain --shape 16384x4096x151936 --policy sequence --temperature 0.7 --memory_budget 6GiB
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import torch

from flce.autotune.devices import torch_dtype
from flce.config import LCEConfig, config_from_keywords, parse_bytes, resolve_variant
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription, describe_device
from flce.engine.plans import PlanRequest
from flce.policy.api import policy_config
from flce.policy.loss_types import IMPORTANCE_SAMPLING_LEVELS as LEVELS
from flce.registry import HardwareProbe, candidates_for
from flce.registry.selection import choose_for_call

DEFAULT_GPU = "NVIDIA H100 80GB HBM3"
# Ascend NPUs explain can describe by name: vector cores and device memory (UB size follows the SoC name).
KNOWN_NPUS = {"Ascend910B1": (48, 64 * 10**9), "Ascend910B2": (48, 64 * 10**9), "Ascend910B3": (40, 64 * 10**9),
              "Ascend910B4": (40, 32 * 10**9)}
DEFAULT_NPU = "Ascend910B3"


def explain(device: str = "cuda", *, shape: str | tuple[int, int, int], dtype: str | torch.dtype = "bfloat16",
            gpu: str | None = None, npu: str | None = None, backend: str | None = None, variant: str = "auto",
            training: bool = True, bias: bool = False, sharded: bool = False,
            capability: tuple[int, int] | None = None, multiprocessors: int | None = None,
            total_memory: int | None = None, triton: str | None = None, policy: str | None = None,
            **options: Any) -> CallChoice:
    """The record of what a call would run (``print`` it for the text). ``device``: "cuda", "cpu" or "npu"
    ("cpu" with ``backend="cuda"``: the CUDA kernels in the Triton interpreter);
    ``shape``: tokens x H x V; ``gpu``/``npu``: the model as the driver names it (flce.backends.cuda.hardware
    .KNOWN_GPUS, KNOWN_NPUS; an unknown GPU needs ``capability``, ``multiprocessors`` and ``total_memory``);
    ``triton``: the Triton version to assume; ``training``: gradients follow; ``options``: LCEConfig's;
    ``policy``: the call is flce.linear_policy_loss's at this importance-sampling level ("token", "sequence"), its
    ``options`` then flce.policy.api.policy_config's (temperature, memory_budget, ...; ``return_entropy``: the
    entropies computed, for an entropy term or the metrics).

    It refuses what a call would refuse, with the same error: the options, the variant, a dtype the kernels do not
    take, a backend that does not serve the device or the call (selection is the registry's own, flce.registry,
    with the described device's hardware taken as present)."""
    n_rows, hidden, vocab = _shape(shape)
    if policy is not None and policy not in LEVELS:
        raise ValueError(f"policy={policy!r}: expected an importance-sampling level, one of {LEVELS}")
    if policy is None:
        cfg = config_from_keywords("explain", options)
    else:
        options.setdefault("entropy", options.pop("return_entropy", True))
        cfg = policy_config(**options)
    dtype = torch_dtype(dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"hidden: expected a floating-point tensor [..., H], got dtype {dtype}")
    variant = resolve_variant(variant, cfg, sharded=sharded)
    described = _device(device, gpu, npu, capability, multiprocessors, total_memory, triton, backend)
    # The described device's hardware is present; the CPU runs a Triton backend's kernels in its interpreter
    # when asked by name, as a call on CPU tensors does.
    probe = HardwareProbe.fake(cuda=device == "cuda", npu=device == "npu", triton=True,
                               triton_interpret=device == "cpu")
    candidates = candidates_for(described.type, backend, probe, described=described)
    chosen = choose_for_call(candidates, cfg, dtype, hidden, vocab, warn=False)
    if chosen.choose is None:
        raise ValueError(f"backend={chosen.name!r} has no planner to explain (no choose)")
    request = PlanRequest(training=training, sharded=sharded, statistics_first=policy not in (None, "token"))
    call = CallDescription(n_rows=n_rows, hidden=hidden, vocab=vocab, dtype=dtype, bias=bias, rows_aligned=True,
                           cfg=cfg, variant=variant, request=request)
    return chosen.choose(described, call)


def _shape(shape: str | tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(shape, str):
        parts = shape.lower().replace(" ", "").split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape={shape!r}: expected TOKENSxHIDDENxVOCAB, e.g. 8192x4096x128256")
        shape = tuple(int(p) for p in parts)  # type: ignore[assignment]
    if (len(shape) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
            or min(shape) < 0 or min(shape[1:]) < 1):
        raise ValueError(f"shape={shape!r}: expected three whole numbers (tokens >= 0, hidden >= 1, vocab >= 1)")
    return shape  # type: ignore[return-value]


def _device(device: str, gpu: str | None, npu: str | None, capability: tuple[int, int] | None,
            multiprocessors: int | None, total_memory: int | None, triton: str | None,
            backend: str | None) -> DeviceDescription:
    gpu_figures = {"gpu": gpu, "capability": capability, "triton": triton}
    if device != "cuda" and any(value is not None for value in gpu_figures.values()):
        named = ", ".join(f"{k}={v!r}" for k, v in gpu_figures.items() if v is not None)
        raise ValueError(f"{named}: describes a GPU, but device={device!r}; use device='cuda'")
    if device != "npu" and npu is not None:
        raise ValueError(f"npu={npu!r}: describes an NPU, but device={device!r}; use device='npu'")
    if device == "cuda":
        from flce.backends.cuda.hardware import gpu_description

        return gpu_description(gpu or DEFAULT_GPU, capability, multiprocessors, total_memory, triton)
    if device == "npu":
        name = npu or DEFAULT_NPU
        cores, memory = KNOWN_NPUS.get(name, (None, None))
        for what, value in (("multiprocessors", multiprocessors), ("total_memory", total_memory)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{what}={value!r}: expected a positive number")
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
    parser.add_argument("--policy", default=None, choices=LEVELS,
                        help="a policy loss (flce.linear_policy_loss) at this importance-sampling level; its options: "
                             "--temperature, --memory_budget, --return_entropy (default true), ...")
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
                     total_memory=None if args.memory is None else parse_bytes("--memory", args.memory),
                     triton=args.triton, policy=args.policy, **options)
    print(record)
    return 0


def _capability(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    major, _, minor = text.partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        raise ValueError(f"--capability {text!r}: expected MAJOR.MINOR, e.g. 9.0")
    return int(major), int(minor or 0)


def _option_value(name: str, text: str, shape: str) -> object:
    """An option's value from its command-line text, by its type in LCEConfig."""
    lowered = text.strip().lower()
    if name == "class_weight":
        # Only their presence shapes the plan: a stand-in of the vocabulary's length.
        return None if lowered in ("none", "") else torch.ones(_shape(shape)[2], device="meta")
    if name == "accum_dtype":
        return None if lowered == "none" else torch_dtype(lowered)
    if name == "memory_budget":
        return None if lowered == "none" else parse_bytes("--memory_budget", text)
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
