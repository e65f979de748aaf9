"""Timing and memory helpers shared by the GPU benchmark scripts in tools/ (one GPU, one process)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

MiB = 1 << 20


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
