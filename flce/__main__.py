"""``python -m flce info``: the device, every backend's availability and the selection;
``python -m flce explain``: what a call would run and why (flce/explain.py); ``python -m flce
explain-distillation``: the same for a linear distillation call (flce/explain_distillation.py).

The autotune section is printed by ``flce.autotune.info_lines(device)`` when that module is
importable; flce works without it.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import warnings

import torch

import flce
from flce.config import LCEConfig
from flce.devices import cpu_fallback_reason
from flce.explain import add_arguments as explain_arguments
from flce.explain import run as explain_call
from flce.explain_distillation import add_arguments as explain_distillation_arguments
from flce.explain_distillation import run as explain_distillation_call
from flce.registry import available_backends, candidates_for, choose_for_call, resolve_device
from flce.testing.measure import cpu_model


def device_description(device: torch.device) -> str:
    """A human name for the device: the GPU/NPU model, or the CPU model and thread count."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
    if device.type == "npu" and hasattr(torch, "npu") and torch.npu.is_available():
        return f"{device} ({torch.npu.get_device_name(device.index or 0)})"
    if device.type == "cpu":
        return f"cpu ({cpu_model()}, {torch.get_num_threads()} torch threads)"
    return str(device)


def selection_lines(device: torch.device) -> list[str]:
    """Which backend a default-options call on this device would run, and what was passed over.

    The selection is made for a small probe call in the device's usual dtype (bf16 on
    accelerators, fp32 on the CPU); a backend's ``supports`` can still turn down other calls.
    """
    try:
        cands = candidates_for(device.type)
    except (ValueError, RuntimeError) as exc:
        return [f"selection for {device.type}: error: {exc}"]
    lines = [f"selection order for {device.type}: " + (" > ".join(b.name for b in cands.backends) or "none")
             + (" (forced by FLCE_BACKEND)" if cands.explicit else "")]
    for name, reason in cands.passed_over:
        lines.append(f"  passed over {name}: {reason}")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the passed-over reasons are printed above
            chosen = choose_for_call(cands, LCEConfig(), dtype, 64, 128)
        lines.append(f"selected for a default-options {str(dtype).removeprefix('torch.')} call: {chosen.name} "
                     f"(variant plain; full when a full-feature option is set)")
    except Exception as exc:  # the device may be named but unusable here: report the order alone
        first = cands.backends[0].name if cands.backends else "none"
        lines.append(f"selected: {first} by priority (no probe call possible on {device}: {exc})")
    return lines


def backend_table() -> list[str]:
    rows = available_backends()
    header = ("backend", "device types", "priority", "available", "reason")
    cells = [header] + [(r["name"], ",".join(r["device_types"]), str(r["priority"]),
                         "yes" if r["available"] else "no", r["reason"]) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
            for row in cells]


def cuda_kernel_lines(device: torch.device) -> list[str]:
    """The CUDA backend's kernel families: which this Triton builds and this device runs, and why not."""
    from flce.backends.cuda.availability import kernel_availability

    rows = kernel_availability(device)
    width = max(len(name) for name, _, _ in rows)
    return ["cuda kernels:"] + [f"  {name.ljust(width)}  {'yes' if ok else 'no '}  {why}" for name, ok, why in rows]


def autotune_lines(device: torch.device) -> list[str]:
    """The autotune cache's own report, when the autotune package is installed."""
    try:
        autotune = importlib.import_module("flce.autotune")
    except ImportError:
        return []
    info_lines = getattr(autotune, "info_lines", None)
    if info_lines is None:
        return []
    try:
        return list(info_lines(device))
    except Exception as exc:  # a broken cache must not hide the rest of the report
        return [f"autotune: could not report ({type(exc).__name__}: {exc})"]


def info(device: torch.device, fallback: str | None = None) -> int:
    """The report on ``device``; ``fallback``: why the CPU stands in for the accelerator torch was built for
    (:func:`flce.devices.cpu_fallback_reason`), where no device was named."""
    print(f"flce {flce.__version__} · torch {torch.__version__} · python {platform.python_version()}")
    print(f"device: {device_description(device)}")
    if fallback is not None:
        print(f"  ({fallback})")
    print()
    print("backends:")
    for line in backend_table():
        print(f"  {line}")
    print()
    for line in selection_lines(device):
        print(line)
    print()
    for line in cuda_kernel_lines(device):
        print(line)
    lines = autotune_lines(device)
    if lines:
        print()
        for line in lines:
            print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flce", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser("info", help="the device, the backends and which one is selected")
    info_parser.add_argument("--device", default=None,
                             help="device to report on (default: the current accelerator, else cpu)")
    explain_parser = commands.add_parser("explain", help="what a call would run and why, without running it")
    explain_arguments(explain_parser)
    distillation_parser = commands.add_parser("explain-distillation",
                                              help="what a linear distillation call would run and why")
    explain_distillation_arguments(distillation_parser)
    args = parser.parse_args(argv)
    try:
        code = _run(parser, args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at the interpreter's exit
        return code
    except BrokenPipeError:  # `python -m flce info | head -1`
        from flce.autotune.cli import closed_pipe_exit

        return closed_pipe_exit()


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command in ("explain", "explain-distillation"):
        try:
            return (explain_call if args.command == "explain" else explain_distillation_call)(args)
        except (TypeError, ValueError, RuntimeError) as exc:  # what a call would raise: a usage error here
            parser.error(f"{args.command}: {exc}")
    if args.command == "info":
        try:
            device = resolve_device(args.device)
        except (TypeError, ValueError) as exc:
            parser.error(f"--device: {exc}")  # exits with status 2, the message and no traceback
        named = args.device is not None
        return info(device, None if named or device.type != "cpu" else cpu_fallback_reason())
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
