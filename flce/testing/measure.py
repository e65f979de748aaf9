"""How flce measures a call: inputs drawn by shape, median times with their spread, peak memory
above what the call returns, and tables published to stdout and a file.

The scripts in ``tools/`` and the tuner (:mod:`flce.autotune.tuner`) both use it, so that a time in
a benchmark table and one in an autotune entry come from the same inputs and the same clock. It
imports nothing else of flce, and Triton only to time a GPU.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

T = TypeVar("T")

MiB = 1 << 20
IGNORE_INDEX = -100
# Every 17th target is ignore_index (5.9% padding), as in the published benchmark tables.
IGNORED_EVERY = 17
# triton.testing.do_bench empties the L2 cache before each timed call by writing this much; the
# counted timer does the same, so its times mean what do_bench's do.
L2_FLUSH_BYTES = 256 * MiB


# Inputs --------------------------------------------------------------------------------------


class ShapeInputs(NamedTuple):
    hidden: torch.Tensor  # [tokens, hidden]
    weight: torch.Tensor  # [vocab, hidden]
    target: torch.Tensor  # [tokens], int64
    generator: torch.Generator  # the one that drew them, for further draws (upstream gradients, advantages)


def parse_shape(label: str) -> tuple[int, int, int]:
    """``"8192x4096x128256"`` -> (tokens, hidden, vocab)."""
    parts = label.strip().lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"shape={label!r}: expected TOKENSxHIDDENxVOCAB, e.g. 8192x4096x128256")
    tokens, hidden, vocab = (int(part) for part in parts)
    return tokens, hidden, vocab


def budget_options(mib: int) -> dict:
    """``linear_cross_entropy``'s keywords for a ``--budgets`` entry: ``memory_budget`` of ``mib`` MiB, or none
    for 0 (the default plan)."""
    return {"memory_budget": mib * MiB} if mib else {}


def budget_label(mib: int) -> str:
    """A table's name for a ``--budgets`` entry: ``"2048 MiB"``, or ``"default"`` for 0."""
    return f"{mib} MiB" if mib else "default"


def shape_inputs(tokens: int, hidden: int, vocab: int, device: torch.device | str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, *, seed: int = 0, requires_grad: bool = True) -> ShapeInputs:
    """The inputs every measurement uses at one shape: hidden states ~ N(0, 1), a weight ~ N(0, 1/H)
    (logits of std 1, as a trained head gives), uniform targets with every 17th ignored.

    Drawn on ``device`` in ``dtype`` (a CPU detour costs seconds at V = 128k) by a generator seeded
    with ``tokens + hidden + vocab + seed``, so a shape gets the same inputs in every script.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(tokens + hidden + vocab + seed)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=generator)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype, generator=generator).mul_(hidden**-0.5)
    t = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    t[::IGNORED_EVERY] = IGNORE_INDEX
    if requires_grad:
        x.requires_grad_()
        w.requires_grad_()
    return ShapeInputs(x, w, t, generator)


def floor_gradient(tokens: int, vocab: int, dtype: torch.dtype, device: torch.device | str = "cuda", *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The logits' gradient G [tokens, vocab] the floor's two gradient products multiply: N(0, 1) in ``dtype``.

    Every floor in flce's tools and tuner takes it from here, because a product's speed under the GPU's power cap
    follows its data: on an H100 (docs/data/products/h100-2026-11-27-floor-gradient.md) the loss's own gradient
    (softmax - onehot) / count and N(0, 1) timed the whole-batch products within 0.5% of each other, N(0, 1) / V
    1-2% slower, zeros 11-12% faster."""
    return torch.randn(tokens, vocab, device=device, dtype=dtype, generator=generator)


# Timing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Milliseconds of repeated calls: the median is the figure, the rest says how far to trust it."""

    samples_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples_ms:
            raise ValueError("samples_ms=(): expected at least one timed call")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def quartiles_ms(self) -> tuple[float, float]:
        """First and third quartile (both the only sample when there is one)."""
        if len(self.samples_ms) == 1:
            return self.samples_ms[0], self.samples_ms[0]
        q1, _, q3 = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q1, q3


def gpu_timing(fn: Callable[[], object], *, warmup_ms: float = 50, rep_ms: float = 300) -> Timing:
    """Every timed call of ``triton.testing.do_bench`` on the current GPU: device events around each
    call, the L2 cache emptied before it, as many calls as fit in ``rep_ms`` after ``warmup_ms``."""
    import triton.testing

    return Timing(tuple(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")))


def host_ms(fn: Callable[[], object], device: torch.device | str = "cuda", *, repeats: int = 10) -> float:
    """The host's part of a call: the median wall time for ``fn()`` to return with the device synchronised
    (idle) before each of ``repeats`` calls, every launch and Python step it makes. Where this exceeds the
    device's time for the call, calls queued back to back wait on the host."""
    module = torch.get_device_module(torch.device(device).type)
    samples = []
    for _ in range(repeats):
        module.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    module.synchronize()
    return statistics.median(samples)


def median_ms(fn: Callable[[], object], *, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """The median of :func:`gpu_timing`: what ``do_bench(..., return_mode="median")`` returns."""
    return gpu_timing(fn, warmup_ms=warmup_ms, rep_ms=rep_ms).median_ms


def counted_timing(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> Timing:
    """``repeats`` timed calls after ``warmup`` untimed ones, on any device: on the CPU by
    ``time.perf_counter``; on accelerators as do_bench times (device events around each call, the L2
    cache emptied before it), but with fixed counts (the tuner's ``--repeats``) instead of a budget."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected an int >= 1")
    for _ in range(warmup):
        fn()
    if device.type == "cpu":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return Timing(tuple(samples))
    module = torch.get_device_module(device.type)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    events = []
    for _ in range(repeats):
        flush.zero_()
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    module.synchronize()
    return Timing(tuple(start.elapsed_time(end) for start, end in events))


def floor_products(hidden: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> Callable[[], tuple]:
    """The floor's three cuBLAS products as one call, ``x @ W.T``, ``G @ W`` and ``G.T @ x`` (G:
    :func:`floor_gradient`'s [N, V]), for tools that time the floor in one timing beside a whole training call."""
    x, w = hidden.detach(), weight.detach()
    return lambda: (x @ w.T, grad @ w, grad.T @ x)


def cublas_products_ms(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """Median ms (:func:`median_ms`) of the three products any implementation of the loss must do, by
    cuBLAS (torch.mm): ``x @ W.T``, ``G @ W``, ``G.T @ x`` for hidden x [N, H], weight W [V, H] and
    :func:`floor_gradient`'s G [N, V] in their dtype. Their sum is the floor a training call is measured against."""
    x, w = hidden.detach(), weight.detach()
    g = floor_gradient(x.shape[0], w.shape[0], x.dtype, x.device)
    return median_ms(lambda: x @ w.T), median_ms(lambda: g @ w), median_ms(lambda: g.T @ x)


def ulp_spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of the 16-bit ``dtype`` (bfloat16, float16) at each of the float64 ``values`` (its smallest
    normal one below that range): the unit a 16-bit result's error is counted in."""
    tiny = torch.finfo(dtype).tiny
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    return torch.pow(2.0, torch.floor(torch.log2(values.abs().clamp_min(tiny))) - mantissa)


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64: how far one implementation's output is
    from another's (or from an oracle's); the plain ``||actual - expected||`` where expected is all 0."""
    diff = (actual.double() - expected.double()).norm()
    scale = expected.double().norm()
    return float(diff if scale == 0 else diff / scale)


class InterleavedTimings(NamedTuple):
    wall: dict[str, Timing]  # elapsed time of each call (after a device synchronize)
    cpu: dict[str, Timing]  # this process's CPU time (all threads) over the same calls


def round_order(items: Iterable[T], round_index: int) -> list[T]:
    """The methods of a benchmark round in the order they run: as given, every other round reversed. On an H200 one
    call measured up to 1.5% faster run last in a round than run first
    (docs/data/distillation/h200-2026-11-29-streams-abba-4b5c4c7.md): pairs of rounds weigh a method's place alike on
    every method."""
    ordered = list(items)
    return ordered[::-1] if round_index % 2 else ordered


def interleaved_timings(calls: Mapping[str, Callable[[], object]], device: torch.device, *, rounds: int,
                        warmup_rounds: int = 1,
                        on_sample: Callable[[str, str, float, float], None] | None = None) -> InterleavedTimings:
    """Each call once per round, in turn (every other round in the reverse order: round_order), for
    ``warmup_rounds`` untimed rounds and ``rounds`` timed ones: a change of machine load during the run
    hits every call alike, which back-to-back repeats of one call after another's would not (what a CPU
    shared with other work needs), and so does a call's place in a round. On a shared
    machine CPU time moves less than wall time, since time spent descheduled is not counted.
    ``on_sample(round_label, name, wall_ms, cpu_ms)`` sees every call, warm-up included."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected an int >= 1")
    module = None if device.type == "cpu" else torch.get_device_module(device.type)
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup_rounds + rounds):
        for name, fn in round_order(calls.items(), round_index):
            if module is not None:
                module.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            fn()
            if module is not None:
                module.synchronize()
            wall_ms, cpu_ms = (time.perf_counter() - start) * 1e3, (time.process_time() - cpu_start) * 1e3
            timed = round_index >= warmup_rounds
            if on_sample is not None:
                on_sample(f"run {round_index - warmup_rounds + 1}" if timed else "warm-up", name, wall_ms, cpu_ms)
            if timed:
                wall[name].append(wall_ms)
                cpu[name].append(cpu_ms)
    return InterleavedTimings({k: Timing(tuple(v)) for k, v in wall.items()},
                              {k: Timing(tuple(v)) for k, v in cpu.items()})


# Memory --------------------------------------------------------------------------------------


def peak_bytes_above(fn: Callable[[], object], device: torch.device | str = "cuda", *,
                     include_kept: bool = False) -> int | None:
    """Bytes allocated at the peak of ``fn()`` beyond what was allocated before it and what is still
    allocated after it (what it returns or leaves behind, such as gradients): the call's working
    memory. ``include_kept``: count what it leaves allocated too (the call's whole footprint above
    what was there before). None on devices without allocator statistics (the CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    if not hasattr(module, "reset_peak_memory_stats"):
        return None
    module.synchronize()
    before = module.memory_allocated(device)
    module.reset_peak_memory_stats(device)
    out = fn()
    module.synchronize()
    kept = module.memory_allocated(device) - before
    peak = module.max_memory_allocated(device) - before
    del out
    return peak if include_kept else peak - kept


def peak_mib_above(fn: Callable[[], object], device: torch.device | str = "cuda", *,
                   include_kept: bool = False) -> float:
    """:func:`peak_bytes_above` in MiB, on a GPU (a step that returns its gradients is measured above them)."""
    above = peak_bytes_above(fn, device, include_kept=include_kept)
    if above is None:
        raise ValueError(f"device={device!r}: expected a device with allocator statistics (cuda, npu)")
    return above / MiB


def kernel_times(fn: Callable[[], object], calls: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, ms per call, launches per call) of ``calls`` calls of ``fn`` by the torch profiler, after one
    untimed call, largest first; names cut to 90 characters (cuBLAS's run on)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total / 1e3 / calls
            entry[1] += 1
    return sorted(((name, ms, int(count) // calls) for name, (ms, count) in totals.items()), key=lambda r: -r[1])


# Machine and publishing ----------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """The CPU model and the cores this process may run on (what bounds a CPU figure)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {usable} cores usable of {os.cpu_count()}, {torch.get_num_threads()} torch threads"


def publish(text: str, markdown: str | None) -> None:
    """Print a report and, with a path, write it there as markdown."""
    print(text, flush=True)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


def median_range(values: list[float]) -> str:
    """A table cell: the median of ``values`` and their range, three decimals."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def save_gpu_results(path: str | None, results: list) -> None:
    """With a path, write ``results`` there as JSON beside the current GPU's name and the torch version."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)
