"""Where a CPU run's memory peak comes from, without a GPU: torch.profiler's allocation events.

The CPU allocator reports every allocation and free to the profiler (``profile_memory=True``), each
with the running total and, with ``with_stack=True``, the Python frames and ops that made it. From
them :func:`probe` finds the peak of the running total and lists the allocations alive at that
moment, grouped by the innermost frame of interest that made them (flce's, the calling script's, or
torch.distributed's): the GPU's ``max_memory_allocated`` has the same structure, so a difference
between two code paths found here is there too (sizes scale with the shape; the CUDA allocator's
rounding and cuBLAS workspaces are the only things the CPU does not show).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.profiler import ProfilerActivity, profile

# Frames that name who allocated, innermost first: flce's own code, the tools, DTensor/FSDP.
DEFAULT_SITES = ("flce/", "tools/", "torch/distributed/")


@dataclass
class MemoryPeak:
    """The peak of one profiled call, relative to what was allocated before it."""

    peak_bytes: int
    end_bytes: int
    start_bytes: int = 0  # what the CPU allocator held before the call (the process's tensors)
    live_at_peak: dict[str, int] = field(default_factory=dict)  # site -> bytes alive at the peak

    def table(self, top: int = 12) -> str:
        lines = [f"peak {self.peak_bytes / 2**20:.2f} MiB above the start (end {self.end_bytes / 2**20:.2f} MiB), "
                 f"{self.start_bytes / 2**20:.2f} MiB held before it"]
        for site, size in sorted(self.live_at_peak.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {size / 2**20:10.2f} MiB  {site}")
        return "\n".join(lines)


def _site(event: Any, sites: tuple[str, ...]) -> str:
    ops, node = [], event.parent
    while node is not None:
        name = node.name
        if any(marker in name for marker in sites) and "memory_probe.py" not in name:
            op = next((o for o in ops if o.startswith("aten::") or "Backward" in o), ops[0] if ops else "")
            return f"{name} [{op}]"
        ops.append(name)
        node = node.parent
    return ops[0] if ops else "(no op)"


def probe(fn: Callable[[], Any], sites: tuple[str, ...] = DEFAULT_SITES) -> MemoryPeak:
    """Run ``fn`` (on CPU tensors) under the profiler; the peak and what was alive at it, by site."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        fn()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append(event)
    allocations.sort(key=lambda e: e.start_time_ns)
    if not allocations:
        return MemoryPeak(0, 0)
    first = allocations[0].extra_fields
    base = first.total_allocated - first.alloc_size
    live: dict[int, tuple[int, str]] = {}
    peak, peak_live = 0, {}
    for event in allocations:
        fields = event.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = (fields.alloc_size, _site(event, sites))
        else:
            live.pop(fields.ptr, None)
        total = fields.total_allocated - base
        if total > peak:
            peak, peak_live = total, dict(live)
    by_site: dict[str, int] = defaultdict(int)
    for size, site in peak_live.values():
        by_site[site] += size
    end = allocations[-1].extra_fields.total_allocated - base
    return MemoryPeak(peak, end, start_bytes=base, live_at_peak=dict(by_site))
