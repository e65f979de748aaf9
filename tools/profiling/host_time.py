"""Whether the GPU waits for the host during a training call, and where the host's time goes, one GPU, bf16.

Per shape and ``memory_budget``, for the default training call (loss and the gradients of x and W):

* GPU ms: ``triton.testing.do_bench``'s median, the host running ahead across calls;
* host ms: the time one call takes to return when the GPU is idle and synchronised before it (median of
  HOST_REPEATS): every launch and every Python step the host makes for it;
* from a ``torch.profiler`` trace of one call after a synchronize (*from idle*) and of STEADY_CALLS calls
  queued back to back (*steady*, the median of all but the first, as do_bench sees them): the span from the
  call's first GPU activity to its last, the GPU's busy time, its idle time between consecutive activities,
  and the part of that idle time in which the host had not yet returned from launching the next activity
  (*starved*: the GPU waited for the host), with the longest gaps of the call from idle and the kernels on
  either side.

With ``--cprofile N``: the N functions with the most own time (or ``--sort cumulative``) over CPROFILE_CALLS
calls (cProfile of the calling thread: the forward, where the default schedule makes its gradients;
autograd runs the backward on its own thread).

    python tools/profiling/host_time.py [--shapes 16384x2048x151936,4096x4096x32000] [--budgets 0,2048]
                                        [--cprofile 40 [--sort cumulative]] [--trace-dir DIR] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import flce
from flce.testing.clocks import ClockSampler
from flce.testing.measure import (
    budget_label,
    budget_options,
    host_ms,
    median_ms,
    parse_shape,
    publish,
    shape_inputs,
)

HOST_REPEATS = 10
STEADY_CALLS = 4
CPROFILE_CALLS = 5
LONGEST_GAPS = 8
# GPU activities in a kineto trace, and the host calls that issue them (by their correlation id).
_GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def trace_events(step, trace_dir: str | None, name: str, calls: int = 1) -> list[dict]:
    """The chrome-trace events of ``calls`` calls of ``step`` queued back to back under torch.profiler (CPU
    and CUDA activities), each after a short spin kernel that marks where it begins on the GPU."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda._sleep(1000)
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:  # the trace is read back, kept only under --trace-dir
        path = os.path.join(trace_dir or scratch, f"{name}.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            return json.load(handle)["traceEvents"]


def split_calls(events: list[dict]) -> tuple[list[list[dict]], dict]:
    """The GPU activities of each traced call (split at the spin kernels, which are left out), and the time
    each activity's launch call returned on the host, by correlation id."""
    launch_end = {}
    for event in events:
        if event.get("cat") in _LAUNCH_CATEGORIES and "correlation" in event.get("args", {}):
            launch_end[event["args"]["correlation"]] = event["ts"] + event.get("dur", 0)
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])
    calls: list[list[dict]] = []
    for event in gpu:
        if "spin_kernel" in event["name"]:
            calls.append([])
        elif calls:
            calls[-1].append(event)
    return calls or [gpu], launch_end  # no spin kernel seen (a renamed one): one call


def gap_summary(gpu: list[dict], launch_end: dict) -> dict:
    """Busy and idle GPU time of one traced call's activities, and the idle time during which the next
    activity's launch call had not yet returned on the host (the GPU starved)."""
    if not gpu:
        return {"activities": 0, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "starved_ms": 0.0, "longest": []}
    busy = sum(e.get("dur", 0) for e in gpu)
    idle = starved = 0.0
    gaps = []
    end = gpu[0]["ts"] + gpu[0].get("dur", 0)
    for previous, event in zip(gpu, gpu[1:], strict=False):
        gap = event["ts"] - end
        if gap > 0:
            launched = launch_end.get(event.get("args", {}).get("correlation"))
            waited = launched is not None and launched > end
            idle += gap
            starved += gap if waited else 0.0
            gaps.append((gap, waited, previous["name"][:60], event["name"][:60]))
        end = max(end, event["ts"] + event.get("dur", 0))
    gaps.sort(reverse=True)
    return {"activities": len(gpu), "span_ms": (end - gpu[0]["ts"]) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": idle / 1e3, "starved_ms": starved / 1e3, "longest": gaps[:LONGEST_GAPS]}


def cprofile_text(step, top: int, sort: str) -> str:
    """cProfile's table of the ``top`` functions by ``sort`` (pstats' key) over CPROFILE_CALLS calls of ``step``."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(CPROFILE_CALLS):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x2048x151936,8192x4096x128256,4096x4096x32000")
    parser.add_argument("--budgets", default="0,2048", help="memory_budget in MiB; 0: the default")
    parser.add_argument("--cprofile", type=int, default=0, help="cProfile's top N functions")
    parser.add_argument("--sort", default="tottime", help="cProfile's order: tottime (own time), cumulative")
    parser.add_argument("--trace-dir", default=None, help="keep each call's chrome trace here")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flce {flce.__version__}", "",
             "Traced columns: one call from idle / the median steady call.", "",
             "| shape | memory_budget | GPU ms (do_bench) | host ms (one call) | traced span ms | GPU busy ms | "
             "idle ms | of it starved ms | activities |", "|---|---|---|---|---|---|---|---|---|"]
    details = []
    with ClockSampler(torch.device("cuda")) as clocks:
        measure_shapes(args, lines, details)
    if clocks.summary is not None:
        lines += ["", clocks.summary.describe() + "."]
    publish("\n".join(lines + details), args.markdown)


def measure_shapes(args: argparse.Namespace, lines: list[str], details: list[str]) -> None:
    """Every shape and budget of ``args``: a table row into ``lines``, the longest gaps (and cProfile's
    table) into ``details``."""
    for label in args.shapes.split(","):
        x, w, t, _ = shape_inputs(*parse_shape(label))
        for budget in (int(b) for b in args.budgets.split(",")):
            opts = budget_options(budget)

            def step(opts=opts, x=x, w=w, t=t):
                return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, **opts), (x, w))

            for _ in range(3):
                step()
            gpu = median_ms(step)
            host = host_ms(step, repeats=HOST_REPEATS)
            name = f"{label}-{budget_label(budget).replace(' ', '')}"
            calls, launch_end = split_calls(trace_events(step, args.trace_dir, name))
            gaps = gap_summary(calls[0], launch_end)
            calls, launch_end = split_calls(trace_events(step, args.trace_dir, f"{name}-steady", STEADY_CALLS))
            steady = [gap_summary(call, launch_end) for call in calls[1:]]

            def cell(key, gaps=gaps, steady=steady):
                return f"{gaps[key]:.2f} / {statistics.median(s[key] for s in steady):.2f}"

            lines.append(f"| {label} | {budget_label(budget)} | {gpu:.2f} | {host:.2f} | {cell('span_ms')} | "
                         f"{cell('busy_ms')} | {cell('idle_ms')} | {cell('starved_ms')} | {gaps['activities']} |")
            print(lines[-1], flush=True)
            details.append(f"\n### {label}, {budget_label(budget)}: longest gaps of the call from idle (us, GPU "
                           "starved?, before, after)\n")
            details.extend(f"- {gap:.1f} us, {'starved' if waited else 'queued'}: `{before}` -> `{after}`"
                           for gap, waited, before, after in gaps["longest"])
            if args.cprofile:
                details.append(f"\n```\n{cprofile_text(step, args.cprofile, args.sort)}```")


if __name__ == "__main__":
    main()
