"""``flce.explain_distillation`` and ``python -m flce explain-distillation``: what a linear distillation call
would run, without running it and without its device (flce/explain.py's counterpart).

The call is described by numbers and names and planned by the backend that would serve it, exactly as a
real call on that device plans (the backend's ``choose_distillation``, the function its ``plan_distillation``
runs on a real call's description), with the autotune cache's ``distillation`` entry for the named device.

    python -m flce explain-distillation --device cuda --gpu "NVIDIA H100 80GB HBM3" --dtype bfloat16 \\
        --shape 8192x4096x8192x128256 --loss jsd --memory_budget 512MiB
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import torch

from flce.autotune.devices import torch_dtype
from flce.config import LCEConfig, parse_bytes
from flce.distillation.config import DistillationConfig, config_from_keywords
from flce.engine.choice import CallChoice
from flce.engine.distillation.call import DistillDescription
from flce.engine.plans import PlanRequest
from flce.explain import DEFAULT_GPU, DEFAULT_NPU, _device
from flce.registry import Backend, registered_backends
from flce.registry.selection import backend_named


def explain_distillation(device: str = "cuda", *, shape: str | tuple[int, int, int, int],
                         dtype: str | torch.dtype = "bfloat16", gpu: str | None = None, npu: str | None = None,
                         backend: str | None = None, training: bool = True, student_bias: bool = False,
                         teacher_bias: bool = False, sharded: bool = False, capability: tuple[int, int] | None = None,
                         multiprocessors: int | None = None, total_memory: int | None = None,
                         triton: str | None = None, **options: Any) -> CallChoice:
    """The record of what a distillation call would run (``print`` it for the text). ``shape``: tokens x
    student H x teacher H x V; ``options``: flce.linear_distillation_loss's (loss, beta, temperature,
    hard_label_weight, reduction, memory_budget, teacher_grad, ...); the rest as :func:`flce.explain`'s."""
    n_rows, student_size, teacher_size, vocab = _shape(shape)
    cfg = config_from_keywords("explain_distillation", options)
    dtype = torch_dtype(dtype)
    described = _device(device, gpu, npu, capability, multiprocessors, total_memory, triton, backend)
    chosen = _backend(described.type, backend, dtype, student_size, vocab)
    desc = DistillDescription(n_rows=n_rows, student_hidden=student_size, teacher_hidden=teacher_size, vocab=vocab,
                              dtype=dtype, student_bias=student_bias, teacher_bias=teacher_bias, rows_aligned=True,
                              cfg=cfg, request=PlanRequest(training=training, sharded=sharded))
    return chosen.choose_distillation(described, desc)


def _shape(shape: str | tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    if isinstance(shape, str):
        parts = shape.lower().replace(" ", "").split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape={shape!r}: expected TOKENSxSTUDENT_HxTEACHER_HxVOCAB, e.g. 8192x4096x8192x128256")
        shape = tuple(int(p) for p in parts)  # type: ignore[assignment]
    if len(shape) != 4 or shape[0] < 0 or min(shape[1:]) < 1:
        raise ValueError(f"shape={shape!r}: expected (tokens >= 0, student hidden >= 1, teacher hidden >= 1, "
                         "vocab >= 1)")
    return shape  # type: ignore[return-value]


def _backend(device_type: str, name: str | None, dtype: torch.dtype, hidden: int, vocab: int) -> Backend:
    """The named backend, else the one selection would pick on that device with its hardware present: the
    highest priority among those serving the device type with distillation kernels that take the dtype."""
    if name is not None:
        chosen = backend_named(name)
        if chosen.choose_distillation is None:
            raise ValueError(f"backend={name!r} has no linear distillation kernels to explain")
        return chosen
    serving = sorted((b for b in registered_backends() if b.serves(device_type) and b.choose_distillation),
                     key=lambda b: -b.priority)
    for candidate in serving:
        if candidate.supports(LCEConfig(), dtype, hidden, vocab)[0]:
            return candidate
    return backend_named("reference")


# ----------------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``python -m flce explain-distillation``'s arguments; every DistillationConfig option as ``--name value``."""
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu", "npu"), help="device type (default cuda)")
    parser.add_argument("--gpu", default=None, help=f"GPU model as the driver names it (default {DEFAULT_GPU!r})")
    parser.add_argument("--npu", default=None, help=f"NPU model (default {DEFAULT_NPU!r})")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (default bfloat16)")
    parser.add_argument("--shape", required=True, help="TOKENSxSTUDENT_HxTEACHER_HxVOCAB, e.g. 8192x4096x8192x128256")
    parser.add_argument("--backend", default=None, help="a backend by name (default: what selection picks)")
    parser.add_argument("--no-grad", dest="training", action="store_false", help="no gradient: a forward-only call")
    parser.add_argument("--student-bias", action="store_true", help="the student's head has a bias")
    parser.add_argument("--teacher-bias", action="store_true", help="the teacher's head has a bias")
    parser.add_argument("--vocab-shard", dest="sharded", action="store_true",
                        help="the weights are one rank's vocabulary shard (process_group)")
    for field in fields(DistillationConfig):
        if field.name == "process_group":
            continue
        parser.add_argument(f"--{field.name}", dest=f"option_{field.name}", default=None, metavar="VALUE",
                            help=f"{field.name} (default {field.default!r})")


def run(args: argparse.Namespace) -> int:
    options = {name.removeprefix("option_"): _option_value(name.removeprefix("option_"), value)
               for name, value in vars(args).items() if name.startswith("option_") and value is not None}
    print(explain_distillation(args.device, shape=args.shape, dtype=args.dtype, gpu=args.gpu, npu=args.npu,
                               backend=args.backend, training=args.training, student_bias=args.student_bias,
                               teacher_bias=args.teacher_bias, sharded=args.sharded, **options))
    return 0


def _option_value(name: str, text: str) -> object:
    kind = {f.name: f.type for f in fields(DistillationConfig)}[name]
    lowered = text.strip().lower()
    if name == "memory_budget":
        return None if lowered == "none" else parse_bytes("--memory_budget", text)
    if kind == "bool":
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--{name} {text!r}: expected true or false")
        return lowered in ("true", "1", "yes")
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text
