"""Where flce's time goes: a torch.profiler kernel table for one fwd+bwd at one shape.

    python tools/profiling/torch_profile.py 8192x4096x128256 [--memory-budget BYTES]

Inputs and the do_bench median come from flce.testing.measure, as in the benchmark tables.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flce
from flce.testing.measure import median_ms, parse_shape, shape_inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape")
    parser.add_argument("--memory-budget", type=int, default=None)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    x, w, t, _ = shape_inputs(*parse_shape(args.shape), "cuda")

    def step() -> None:
        loss = flce.linear_cross_entropy(x, w, t, memory_budget=args.memory_budget)
        torch.autograd.grad(loss, (x, w))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    bench = median_ms(step, warmup_ms=100, rep_ms=400)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"do_bench median {bench:.2f} ms; back-to-back mean of 20 steps {start.elapsed_time(end) / 20:.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"== {args.shape} budget={args.memory_budget} (5 steps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
