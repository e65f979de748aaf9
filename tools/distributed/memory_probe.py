"""Where a CPU run's memory peak comes from, without a GPU: torch.profiler's allocation events.

The CPU allocator reports every allocation and free to the profiler (``profile_memory=True``), each
with the running total and, with ``with_stack=True``, the Python frames and ops that made it. From
them :func:`probe` finds the peak of the running total and lists the allocations alive at that
moment, grouped by the innermost frame of interest that made them (flce's, the calling script's, or
torch.distributed's). What the CPU and GPU runs share (DTensor and FSDP2 handling, flce's engine and
its buffers, a script's own copies) keeps its structure on the GPU; the backends' kernels and their
temporaries differ (the reference backend's here, Triton's there).

    torchrun --nproc-per-node 2 tools/distributed/memory_probe.py --mode tp     # the client's step, both losses

runs one training step of tools/distributed/dtensor_client.py's model (after a warm-up step) under the
probe, once with PyTorch's loss and once with flce's, and prints each peak and what was alive at it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

# Frames that name who allocated, innermost first: flce's own code, the tools, DTensor/FSDP.
DEFAULT_SITES = ("flce/", "tools/", "torch/distributed/")


@dataclass
class MemoryPeak:
    """The peak of one profiled call, relative to what was allocated before it."""

    peak_bytes: int
    end_bytes: int
    live_at_peak: dict[str, int] = field(default_factory=dict)  # site -> bytes alive at the peak

    def table(self, top: int = 12) -> str:
        lines = [f"peak {self.peak_bytes / 2**20:.2f} MiB above the start (end {self.end_bytes / 2**20:.2f} MiB)"]
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
    return MemoryPeak(peak, end, live_at_peak=dict(by_site))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="tp", choices=("tp", "fsdp", "fsdp_tp"))
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--top", type=int, default=12)
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dtensor_client as client

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    args = client.ModelArgs(vocab=options.vocab, dim=options.dim, layers=options.layers, heads=options.heads,
                            ffn=4 * options.dim, seq=options.seq, batch=options.batch)
    plan = client.parallelism(options.mode, device)
    for kind in ("torch", "flce"):
        model, optimizer = client.build(plan, args, device, options.mixed)

        def step(index: int, model: Any = model, optimizer: Any = optimizer, kind: str = kind) -> None:
            tokens, labels = client._batch(args, plan.batch_seed, index, device)
            client.train_step(model, optimizer, plan, kind, tokens, labels, options.mixed)
            optimizer.step()

        step(0)
        peak = probe(lambda step=step: step(1))
        if dist.get_rank() == 0:
            print(f"== {options.mode}, {kind} loss, one training step: {peak.table(options.top)}", flush=True)
        del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
