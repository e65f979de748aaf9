"""Timing and memory helpers shared by the GPU benchmark scripts in tools/ (one GPU, one process)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

MiB = 1 << 20


def shape_inputs(label: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Generator]:
    """For a shape "NxHxV": bf16 hidden [N, H] and weight [V, H] (logits O(1)) that require grad,
    targets with every 17th ignored, and the generator (seeded by the shape) that drew them."""
    n, h, v = (int(p) for p in label.split("x"))
    g = torch.Generator(device=device).manual_seed(n + h + v)
    x = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device=device, generator=g) / h**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[::17] = -100
    return x, w, t, g


def median_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of fn() from device events (triton.testing.do_bench)."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def peak_mib_above(fn: Callable[[], object]) -> float:
    """MiB allocated at the peak of fn() beyond what was allocated before and what fn returns
    (a step that returns its gradients is measured above them)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return (peak - kept) / MiB


def publish(text: str, markdown: str | None) -> None:
    """Print a report and, with a path, write it there as markdown."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
