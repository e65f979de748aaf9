"""flce's main job, end to end: a fused forward+backward against the materialised PyTorch one.

    python tools/demo.py               # or: make demo

Detects the device, lets flce.get_impl() pick the backend, runs one LM-head loss
(``CE(hidden @ weight.T, target)``, mean over tokens) forward and backward at a realistic
shape with both flce and plain PyTorch (which materialises the [tokens, vocab] logits),
and prints how well they agree, how long each took and how much memory each needed.

Shapes: CPU 4096 tokens x H 1024 x V 32000 in fp32; GPU/NPU 8192 x 4096 x 128256 in bf16.

Memory: on the CPU each method runs in its own fresh child process, which reports its peak
RSS growth (the VmHWM high-water mark, reset once the inputs exist, minus the RSS then);
on accelerators, torch's peak allocated bytes above what was allocated before the call.
Both include the gradients themselves, which every method has to produce.
Time: on the CPU the second of two runs (the first warms up kernels and allocators); on
accelerators the median of 10 runs after a warm-up. Low-precision losses are printed as
each method returns them: flce's in float32, PyTorch's in the input dtype.
The exit status is 1 when the two computations disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flce
from flce.__main__ import device_description
from flce.config import LCEConfig
from flce.registry import candidates_for, choose_for_call, resolve_device

MiB = 1 << 20
CPU_SHAPE = (4096, 1024, 32000, torch.float32)
ACCELERATOR_SHAPE = (8192, 4096, 128256, torch.bfloat16)
ACCELERATOR_TIMED_RUNS = 10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Result:
    loss: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    seconds: float
    peak_mib: float


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and an LM head scaled like a trained model's (logits of std ~2), 10% padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden**0.5)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < 0.1] = -100
    return x.to(device, dtype), w.to(device, dtype), t.to(device)


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
    forward_backward(fn, x, w, t)  # warm-up: kernels compiled, allocator primed
    synchronize(device)
    memory = torch.cuda if device.type == "cuda" else torch.npu
    memory.empty_cache()
    before = memory.memory_allocated(device)
    memory.reset_peak_memory_stats(device)
    loss, gx, gw = forward_backward(fn, x, w, t)
    synchronize(device)
    peak = (memory.max_memory_allocated(device) - before) / MiB
    # A step takes tens of milliseconds here: the median of several is the time.
    times = []
    for _ in range(ACCELERATOR_TIMED_RUNS):
        start = time.perf_counter()
        forward_backward(fn, x, w, t)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Result(loss, gx, gw, statistics.median(times), peak)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_child(args: argparse.Namespace) -> None:
    """In a fresh process: peak RSS growth of a cold run, the time of a warm one, the results."""
    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], torch.device("cpu"))
    fn = loss_fn(args.child, torch.device("cpu"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    base = _proc_status_kib("VmRSS")
    forward_backward(fn, x, w, t)
    peak_mib = (_proc_status_kib("VmHWM") - base) / 1024
    start = time.perf_counter()
    loss, gx, gw = forward_backward(fn, x, w, t)
    seconds = time.perf_counter() - start
    torch.save({"loss": loss, "grad_hidden": gx, "grad_weight": gw, "seconds": seconds, "peak_mib": peak_mib},
               args.out)


def run_on_cpu(method: str, args: argparse.Namespace, workdir: str) -> Result:
    out = os.path.join(workdir, f"{method}.pt")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--out", out, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype]
    subprocess.run(cmd, check=True)
    r = torch.load(out)
    return Result(r["loss"], r["grad_hidden"], r["grad_weight"], r["seconds"], r["peak_mib"])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="default: the current accelerator, else cpu")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
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
        del x, w  # the children build their own copies
        with tempfile.TemporaryDirectory(prefix="flce-demo-") as workdir:
            for method in ("torch", "flce"):
                results[method] = run_on_cpu(method, args, workdir)
    else:
        for method in ("torch", "flce"):
            results[method] = run_on_accelerator(method, x, w, t)

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
    print(f"{'time (s)':32s}{theirs.seconds:24.3f}{ours.seconds:14.3f}")
    print(f"{memory_kind + ' (MiB)':32s}{theirs.peak_mib:24.0f}{ours.peak_mib:14.0f}")
    print()
    print(f"agreement: |loss diff| = {loss_diff:.2e}, grad hidden rel. error = {err_hidden:.2e}, "
          f"grad weight rel. error = {err_weight:.2e} -> {'OK' if agree else 'MISMATCH'} "
          f"(tolerance {grad_tol:g})")
    print(f"flce: {theirs.seconds / ours.seconds:.2f}x the speed, {ours.peak_mib / theirs.peak_mib:.0%} of the "
          f"memory of materialised PyTorch")
    print(json.dumps({"device": str(device), "backend": backend, "agree": agree, "loss_diff": loss_diff,
                      "grad_hidden_rel_err": err_hidden, "grad_weight_rel_err": err_weight,
                      "seconds": {"torch": theirs.seconds, "flce": ours.seconds},
                      "peak_mib": {"torch": theirs.peak_mib, "flce": ours.peak_mib}}))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
