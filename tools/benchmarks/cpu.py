"""CPU benchmark of a fused forward+backward: flce against the 3-GEMM floor and PyTorch.

    python tools/benchmarks/cpu.py                      # 4096 x 1024 x 32000 fp32
    python tools/benchmarks/cpu.py --markdown           # also print the table (benchmarks_template.md's CPU part)

Inputs: flce.testing.measure's draw for the shape (logits of std 1, every 17th target ignored), fp32.

Time: all methods run in this one process, interleaved (``--warmup`` rounds, then ``--repeats``
rounds, each method once per round; flce.testing.measure.interleaved_timings) so that a change in
machine load hits every method alike. Per method, for wall time and for the process CPU time (all
threads; it moves less than wall time on a shared machine, since time spent descheduled is not
counted): the median over the rounds with its spread (min-max), and its ratio to the floor's median
with the range of the per-round ratios (each method against the floor of the same round), which
says how far one run's ratio can be trusted. The header states the machine (CPU model, usable
cores, torch threads) and the load average before and after.

Memory: each method runs once more in a fresh child process, which reports its peak RSS
growth: the high-water mark (VmHWM, reset through /proc/self/clear_refs once the inputs
exist) minus the RSS at that point. The gradients themselves ((V*H + BT*H) * 4 bytes) are
part of every method's growth; the table also gives the growth above them.

Methods:
  floor          x @ W.T, G @ W, G.T @ x (G: the [BT, V] product of the first GEMM)
  eager          F.cross_entropy(x @ W.T, t), materialised logits
  torch_chunked  F.linear_cross_entropy(x, W, t, options=torch.nn.LinearCrossEntropyOptions()), where this
                 torch has it
  flce           flce.linear_cross_entropy(x, W, t) (the backend flce.get_impl picks)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from flce.testing.measure import MiB, Timing, cpu_description, interleaved_timings, shape_inputs

METHODS = ("floor", "eager", "torch_chunked", "flce")
# torch's own chunked loss (F.linear_cross_entropy) is newer than the oldest torch flce supports.
TORCH_CHUNKED = hasattr(torch.nn, "LinearCrossEntropyOptions")
AVAILABLE = tuple(m for m in METHODS if m != "torch_chunked" or TORCH_CHUNKED)
CPU = torch.device("cpu")


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w, t, _ = shape_inputs(tokens, hidden, vocab, CPU, torch.float32, seed=seed, requires_grad=False)
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


def per_round_ratios(times: Timing, floor: Timing) -> tuple[float, float]:
    """(min, max) over the rounds of this method's time over the same round's floor time."""
    ratios = [t / f for t, f in zip(times.samples_ms, floor.samples_ms, strict=True)]
    return min(ratios), max(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (each method once per round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(AVAILABLE),
                        help=f"comma-separated subset of {METHODS} (default: those this torch has)")
    parser.add_argument("--no-memory", action="store_true", help="skip the child-process RSS measurements")
    parser.add_argument("--markdown", action="store_true", help="print the table for docs/benchmarks.md (its template)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_peak_rss(args)
        return

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            parser.error(f"--methods: unknown method {m!r}; expected some of {METHODS}")
        if m not in AVAILABLE:
            parser.error(f"--methods: {m} needs torch.nn.LinearCrossEntropyOptions, which torch {torch.__version__} "
                         "lacks")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: expected an int >= 1")
    started = datetime.now(timezone.utc)
    load_before = load_average()
    machine = f"{cpu_description()}; torch {torch.__version__}"
    print(f"{args.tokens} x {args.hidden} x {args.vocab} fp32 fwd+bwd; {machine}; load average {load_before}",
          flush=True)

    x, w, t = make_inputs(args.tokens, args.hidden, args.vocab, args.seed)
    runs = {m: method_fn(m, x, w, t) for m in methods}

    def show(label: str, method: str, wall_ms: float, cpu_ms: float) -> None:
        print(f"  {label:8s} {method:14s} {wall_ms / 1e3:7.3f} s   ({cpu_ms / 1e3:7.3f} CPU s)", flush=True)

    timings = interleaved_timings(runs, CPU, rounds=args.repeats, warmup_rounds=args.warmup, on_sample=show)

    memory = {}
    if not args.no_memory:
        for m in methods:
            memory[m] = measure_memory(m, args)
            print(f"  memory   {m:14s} {memory[m]['rss_growth_mib']:7.0f} MiB RSS growth", flush=True)
    load_after = load_average()

    grads_mib = (args.vocab * args.hidden + args.tokens * args.hidden) * 4 / MiB
    rows = []
    for m in methods:
        cells = [m]
        for clock in (timings.wall, timings.cpu):
            t = clock[m]
            cells.append(f"{t.median_ms / 1e3:.2f} ({t.min_ms / 1e3:.2f}-{t.max_ms / 1e3:.2f})")
            floor = clock.get("floor")
            if floor is None:
                cells.append("-")
            else:
                low, high = per_round_ratios(t, floor)
                cells.append(f"{t.median_ms / floor.median_ms:.2f}x ({low:.2f}-{high:.2f}x)")
        growth = memory.get(m, {}).get("rss_growth_mib")
        cells += ["-", "-"] if growth is None else [f"{growth:.0f}", f"{growth - grads_mib:.0f}"]
        rows.append(tuple(cells))
    print()
    header = ("method", "median s (min-max)", "vs floor (per round)", "median CPU s (min-max)",
              "CPU vs floor (per round)", "peak RSS growth MiB", "above gradients MiB")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)))
    print(f"\n{args.repeats} timed rounds after {args.warmup} warm-up; load average before {load_before}, "
          f"after {load_after}; gradients {grads_mib:.0f} MiB")
    if args.markdown:
        print(f"\n<!-- {started:%Y-%m-%d %H:%M} UTC, `python tools/benchmarks/cpu.py {' '.join(sys.argv[1:])}`; "
              f"{machine}; load average {load_before} before, {load_after} after -->")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
