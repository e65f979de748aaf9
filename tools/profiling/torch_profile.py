"""Where flce's time goes: a torch.profiler kernel table for one fwd+bwd at one shape.

    python tools/profile_flce.py 8192x4096x128256 [--memory-budget BYTES]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flce


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape")
    parser.add_argument("--memory-budget", type=int, default=None)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    n, h, v = (int(s) for s in args.shape.split("x"))
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def step() -> None:
        loss = flce.linear_cross_entropy(x, w, t, memory_budget=args.memory_budget)
        torch.autograd.grad(loss, (x, w))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    import triton.testing

    bench = triton.testing.do_bench(step, warmup=100, rep=400, return_mode="median")
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
