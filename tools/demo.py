"""flce's main job, end to end: a fused forward+backward against the materialised PyTorch one.

    python tools/demo.py               # or: make demo

Detects the device, lets flce.get_impl() pick the backend, runs one LM-head loss
(``CE(hidden @ weight.T, target)``, mean over tokens) forward and backward at a realistic
shape with both flce and plain PyTorch (which materialises the [tokens, vocab] logits),
and prints how well they agree, how long each took and how much memory each needed.

Shapes: CPU 4096 tokens x H 1024 x V 32000 in fp32; GPU/NPU 8192 x 4096 x 128256 in bf16.

Inputs: flce.testing.measure's draw for the shape (logits of std 1, every 17th target ignored),
the same as every benchmark's.
Memory: on the CPU each method runs in its own fresh child process, which reports its peak
RSS growth (the VmHWM high-water mark, reset once the inputs exist, minus the RSS then) and
its results; on accelerators, torch's peak allocated bytes above what was allocated before the
call. Both include the gradients themselves, which every method has to produce.
Time: PyTorch and flce alternate, one call each per round (flce.testing.measure.interleaved_timings),
for ``--rounds`` rounds (3 on the CPU; 10 on accelerators) after one warm-up round, so that a
change of machine load hits both alike. The verdict is the ratio of the two medians, printed with
the range of the per-round ratios. Low-precision losses are printed as each method returns them:
flce's in float32, PyTorch's in the input dtype.
The exit status is 1 when the two computations disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flce
from flce.__main__ import device_description
from flce.config import LCEConfig
from flce.registry import candidates_for, choose_for_call, resolve_device
from flce.testing.measure import InterleavedTimings, MiB, interleaved_timings, peak_bytes_above, shape_inputs

CPU_SHAPE = (4096, 1024, 32000, torch.float32)
ACCELERATOR_SHAPE = (8192, 4096, 128256, torch.bfloat16)
TIMED_ROUNDS = {"cpu": 3, "accelerator": 10}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Result:
    loss: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    peak_mib: float


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w, t, _ = shape_inputs(tokens, hidden, vocab, device, dtype, requires_grad=False)
    return x, w, t


def loss_fn(method: str, device: torch.device):
    if method == "flce":
        return flce.get_impl(device)()
    if method == "torch":
        return lambda x, w, t: F.cross_entropy(x @ w.T, t)
    raise ValueError(f"method={method!r}: expected 'flce' or 'torch'")


def forward_backward(fn, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(xx, ww, t)
    loss.backward()
    return loss.detach(), xx.grad, ww.grad


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def run_on_accelerator(method: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Result:
    device = x.device
    fn = loss_fn(method, device)
    loss, gx, gw = forward_backward(fn, x, w, t)  # also the warm-up: kernels compiled, allocator primed
    synchronize(device)
    torch.get_device_module(device.type).empty_cache()
    peak = peak_bytes_above(lambda: forward_backward(fn, x, w, t), device, include_kept=True)
    return Result(loss, gx, gw, peak / MiB)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_child(args: argparse.Namespace) -> None:
    """In a fresh process: the peak RSS growth of one run, and its results."""
    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], torch.device("cpu"))
    fn = loss_fn(args.child, torch.device("cpu"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    base = _proc_status_kib("VmRSS")
    loss, gx, gw = forward_backward(fn, x, w, t)
    peak_mib = (_proc_status_kib("VmHWM") - base) / 1024
    torch.save({"loss": loss, "grad_hidden": gx, "grad_weight": gw, "peak_mib": peak_mib}, args.out)


def run_on_cpu(method: str, args: argparse.Namespace, workdir: str) -> Result:
    out = os.path.join(workdir, f"{method}.pt")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--out", out, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype]
    subprocess.run(cmd, check=True)
    r = torch.load(out)
    return Result(r["loss"], r["grad_hidden"], r["grad_weight"], r["peak_mib"])


def interleaved_seconds(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rounds: int) -> InterleavedTimings:
    """PyTorch and flce alternating, one call each per round, after one warm-up round."""
    calls: dict[str, Callable[[], object]] = {}
    for method in ("torch", "flce"):
        fn = loss_fn(method, x.device)
        calls[method] = lambda fn=fn: forward_backward(fn, x, w, t)

    def show(label: str, method: str, wall_ms: float, cpu_ms: float) -> None:
        print(f"  {label:8s} {method:6s} {wall_ms / 1e3:8.3f} s   ({cpu_ms / 1e3:8.3f} CPU s)", flush=True)

    return interleaved_timings(calls, x.device, rounds=rounds, warmup_rounds=1, on_sample=show)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="default: the current accelerator, else cpu")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, help="timed rounds (default: 3 on the CPU, 10 on accelerators)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cpu_child(args)
        return 0

    device = resolve_device(args.device)
    default = CPU_SHAPE if device.type == "cpu" else ACCELERATOR_SHAPE
    args.tokens = args.tokens or default[0]
    args.hidden = args.hidden or default[1]
    args.vocab = args.vocab or default[2]
    args.dtype = args.dtype or str(default[3]).removeprefix("torch.")
    args.rounds = args.rounds or TIMED_ROUNDS["cpu" if device.type == "cpu" else "accelerator"]
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: expected an int >= 1")
    dtype = DTYPES[args.dtype]

    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, dtype, device)
    cfg = LCEConfig()
    backend = choose_for_call(candidates_for(device.type), cfg, w.dtype, w.shape[1], w.shape[0]).name
    print(f"device:  {device_description(device)}")
    print(f"backend: {backend} (flce.get_impl({str(device)!r}) picks it; `python -m flce info` shows why)")
    print(f"shape:   {args.tokens} tokens x H {args.hidden} x V {args.vocab}, {args.dtype}, forward + backward, "
          f"mean cross-entropy, {int((t == -100).sum())} padding tokens ignored")
    logits_mib = args.tokens * args.vocab * x.element_size() / MiB
    grads_mib = (args.vocab + args.tokens) * args.hidden * x.element_size() / MiB
    print(f"         (the logits alone would take {logits_mib:.0f} MiB; the gradients need {grads_mib:.0f} MiB)")
    print("running ...", flush=True)

    results: dict[str, Result] = {}
    if device.type == "cpu":
        with tempfile.TemporaryDirectory(prefix="flce-demo-") as workdir:
            for method in ("torch", "flce"):
                results[method] = run_on_cpu(method, args, workdir)
    else:
        for method in ("torch", "flce"):
            results[method] = run_on_accelerator(method, x, w, t)
    print(f"timing: {args.rounds} rounds of PyTorch and flce in turn, after a warm-up round", flush=True)
    timings = interleaved_seconds(x, w, t, args.rounds)
    seconds = timings.wall
    speed = seconds["torch"].median_ms / seconds["flce"].median_ms
    # This process's CPU time moves less than wall time when other jobs share the cores.
    cpu_speed = timings.cpu["torch"].median_ms / timings.cpu["flce"].median_ms
    per_round = [a / b for a, b in zip(seconds["torch"].samples_ms, seconds["flce"].samples_ms, strict=True)]

    ours, theirs = results["flce"], results["torch"]
    loss_diff = abs(float(ours.loss) - float(theirs.loss))
    err_hidden = relative_error(ours.grad_hidden, theirs.grad_hidden)
    err_weight = relative_error(ours.grad_weight, theirs.grad_weight)
    # fp32 differs only in summation order; low precision by rounding of the logits and gradients.
    loss_tol, grad_tol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    agree = loss_diff <= loss_tol * max(1.0, abs(float(theirs.loss))) and max(err_hidden, err_weight) <= grad_tol

    memory_kind = "peak RSS growth" if device.type == "cpu" else "peak memory above inputs"
    print()
    print(f"{'':32s}{'PyTorch (materialised)':>24s}{'flce':>14s}")
    def dtype_name(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    loss_label = f"loss ({dtype_name(theirs.loss)} / {dtype_name(ours.loss)})"
    print(f"{loss_label:32s}{float(theirs.loss):24.6f}{float(ours.loss):14.6f}")
    spreads = {m: f"{seconds[m].min_ms / 1e3:.3f}-{seconds[m].max_ms / 1e3:.3f}" for m in ("torch", "flce")}
    print(f"{'time (s), median of ' + str(args.rounds):32s}{seconds['torch'].median_ms / 1e3:24.3f}"
          f"{seconds['flce'].median_ms / 1e3:14.3f}")
    print(f"{'time (s), min-max':32s}{spreads['torch']:>24s}{spreads['flce']:>14s}")
    print(f"{memory_kind + ' (MiB)':32s}{theirs.peak_mib:24.0f}{ours.peak_mib:14.0f}")
    print()
    print(f"agreement: |loss diff| = {loss_diff:.2e}, grad hidden rel. error = {err_hidden:.2e}, "
          f"grad weight rel. error = {err_weight:.2e} -> {'OK' if agree else 'MISMATCH'} "
          f"(tolerance {grad_tol:g})")
    print(f"flce: {speed:.2f}x the speed (median of {args.rounds} interleaved rounds; per round "
          f"{min(per_round):.2f}-{max(per_round):.2f}x; by this process's CPU time {cpu_speed:.2f}x), "
          f"{ours.peak_mib / theirs.peak_mib:.0%} of the "
          f"memory of materialised PyTorch")
    print(json.dumps({"device": str(device), "backend": backend, "agree": agree, "loss_diff": loss_diff,
                      "grad_hidden_rel_err": err_hidden, "grad_weight_rel_err": err_weight,
                      "seconds": {m: seconds[m].median_ms / 1e3 for m in ("torch", "flce")},
                      "seconds_per_round": {m: [ms / 1e3 for ms in seconds[m].samples_ms] for m in ("torch", "flce")},
                      "speed": speed, "speed_per_round": per_round, "cpu_time_speed": cpu_speed,
                      "peak_mib": {"torch": theirs.peak_mib, "flce": ours.peak_mib}}))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
