"""CPU benchmark of a fused forward+backward: flce against the 3-GEMM floor and PyTorch.

    python tools/bench_cpu.py                      # issue 2's shape: 4096 x 1024 x 32000 fp32
    python tools/bench_cpu.py --markdown           # also print the docs/benchmarks.md table

Time: all methods run in this one process, interleaved (warm-up round, then ``--repeats``
rounds, each method once per round) so that a change in machine load hits every method
alike; the median per method is reported, with its ratio to the floor's median. The
median process CPU time (all threads) is reported too: on a machine shared with other
work it moves less than wall time, since time spent descheduled is not counted.

Memory: each method runs once more in a fresh child process, which reports its peak RSS
growth: the high-water mark (VmHWM, reset through /proc/self/clear_refs once the inputs
exist) minus the RSS at that point. The gradients themselves ((V*H + BT*H) * 4 bytes) are
part of every method's growth; the table also gives the growth above them.

Methods:
  floor          x @ W.T, G @ W, G.T @ x (G: the [BT, V] product of the first GEMM)
  eager          F.cross_entropy(x @ W.T, t), materialised logits
  torch_chunked  F.linear_cross_entropy(x, W, t, options=torch.nn.LinearCrossEntropyOptions())
  flce           flce.linear_cross_entropy(x, W, t) (the backend flce.get_impl picks)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

METHODS = ("floor", "eager", "torch_chunked", "flce")
MiB = 1 << 20


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden**0.5)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return x, w, t


def method_fn(name: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Callable[[], None]:
    """One forward+backward; gradients land on fresh leaves and are dropped afterwards."""
    if name == "floor":
        def run() -> None:
            g = x @ w.T
            g @ w
            g.T @ x
        return run

    if name == "eager":
        def loss(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(xx @ ww.T, t)
    elif name == "torch_chunked":
        options = torch.nn.LinearCrossEntropyOptions()

        def loss(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
            return F.linear_cross_entropy(xx, ww, t, options=options)
    elif name == "flce":
        import flce

        module = flce.get_impl(x)()

        def loss(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
            return module(xx, ww, t)
    else:
        raise ValueError(f"method={name!r}: expected one of {METHODS}")

    def run() -> None:
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss(xx, ww).backward()

    return run


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child_peak_rss(args: argparse.Namespace) -> None:
    """Runs in a fresh process: one forward+backward of args.child; prints JSON with the growth."""
    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, args.seed)
    run = method_fn(args.child, x, w, t)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = proc_status_kib("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = proc_status_kib("VmHWM")
    print(json.dumps({"method": args.child, "rss_growth_mib": (peak - base) / 1024, "cold_seconds": seconds}))


def measure_memory(method: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--no-memory", action="store_true", help="skip the child-process RSS measurements")
    parser.add_argument("--markdown", action="store_true", help="print the table for docs/benchmarks.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_peak_rss(args)
        return

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            parser.error(f"--methods: unknown method {m!r}; expected some of {METHODS}")
    started = datetime.now(timezone.utc)
    load_before = load_average()
    print(f"{args.tokens} x {args.hidden} x {args.vocab} fp32 fwd+bwd; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {cpu_model()}; load average {load_before}", flush=True)

    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, args.seed)
    runs = {m: method_fn(m, x, w, t) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu_times: dict[str, list[float]] = {m: [] for m in methods}
    for round_index in range(args.repeats + 1):
        for m in methods:
            start, cpu_start = time.perf_counter(), time.process_time()
            runs[m]()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            label = "warm-up" if round_index == 0 else f"run {round_index}"
            print(f"  {label:8s} {m:14s} {elapsed:7.3f} s   ({cpu:7.3f} CPU s)", flush=True)
            if round_index:
                times[m].append(elapsed)
                cpu_times[m].append(cpu)
    medians = {m: statistics.median(v) for m, v in times.items()}
    cpu_medians = {m: statistics.median(v) for m, v in cpu_times.items()}

    memory = {}
    if not args.no_memory:
        for m in methods:
            memory[m] = measure_memory(m, args)
            print(f"  memory   {m:14s} {memory[m]['rss_growth_mib']:7.0f} MiB RSS growth", flush=True)
    load_after = load_average()

    grads_mib = (args.vocab * args.hidden + args.tokens * args.hidden) * 4 / MiB
    floor, cpu_floor = medians.get("floor"), cpu_medians.get("floor")
    rows = []
    for m in methods:
        ratio = f"{medians[m] / floor:.2f}x" if floor else "-"
        cpu_ratio = f"{cpu_medians[m] / cpu_floor:.2f}x" if cpu_floor else "-"
        growth = memory.get(m, {}).get("rss_growth_mib")
        growth_cells = ("-", "-") if growth is None else (f"{growth:.0f}", f"{growth - grads_mib:.0f}")
        rows.append((m, f"{medians[m]:.2f}", ratio, f"{cpu_medians[m]:.2f}", cpu_ratio, *growth_cells))
    print()
    header = ("method", "median s", "vs floor", "median CPU s", "CPU vs floor", "peak RSS growth MiB",
              "above gradients MiB")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)))
    print(f"\nload average before {load_before}, after {load_after}; gradients {grads_mib:.0f} MiB")
    if args.markdown:
        print(f"\n<!-- {started:%Y-%m-%d %H:%M} UTC, `python tools/bench_cpu.py {' '.join(sys.argv[1:])}` -->")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
