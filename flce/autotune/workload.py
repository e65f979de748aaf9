"""What the tuner runs and how it times it: inputs drawn on the device, one forward+backward of a
backend with a variant's representative options, and a timer that also reads the peak memory."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flce.autotune.spaces import TuneShape


@dataclass
class WorkloadInputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor

    def clear_grads(self) -> None:
        self.hidden.grad = self.weight.grad = None

    @property
    def grad_bytes(self) -> int:
        return (self.hidden.numel() + self.weight.numel()) * self.hidden.element_size()

    def flat(self):
        from flce.inputs import FlatInputs

        return FlatInputs(hidden=self.hidden, weight=self.weight, target=self.target, bias=None,
                          token_shape=self.target.shape)


def make_inputs(shape: TuneShape, generator: torch.Generator) -> WorkloadInputs:
    """Random hidden states and weights scaled so logits are O(1), targets with 5% ignored; drawn
    on the device (a CPU detour would cost seconds at V = 128k)."""
    def randn(*size: int, scale: float) -> torch.Tensor:
        values = torch.randn(*size, generator=generator, dtype=shape.dtype, device=shape.device)
        return values.mul_(scale).requires_grad_(True)

    hidden = randn(shape.tokens, shape.hidden, scale=1.0)
    weight = randn(shape.vocab, shape.hidden, scale=1.0 / math.sqrt(shape.hidden))
    target = torch.randint(0, shape.vocab, (shape.tokens,), generator=generator, device=shape.device)
    ignored = torch.rand(shape.tokens, generator=generator, device=shape.device) < 0.05
    return WorkloadInputs(hidden, weight, target.masked_fill_(ignored, -100))


def workload_options(variant: str, *, deferred: bool) -> dict:
    """Representative options per variant. In-forward: the plain loss; for the full variant,
    label smoothing and z-loss. Deferred (where the logits-save limit matters): per-token losses
    for plain, per-token log-probs for full."""
    cfg: dict = {}
    if variant == "full":
        cfg.update(return_logprobs=True) if deferred else cfg.update(label_smoothing=0.1, lse_square_scale=1e-4)
    elif deferred:
        cfg["reduction"] = "none"
    return cfg


class Workload:
    """One forward+backward of the backend on the shape's inputs, with the variant's options."""

    def __init__(self, shape: TuneShape, inputs: WorkloadInputs, backend: str, deferred: bool):
        import flce

        options = workload_options(shape.variant, deferred=deferred)
        self.module = flce.get_impl(shape.device, backend=backend, variant=shape.variant)(**options)
        self.inputs = inputs

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.inputs.clear_grads()
        out = self.module(self.inputs.hidden, self.inputs.weight, self.inputs.target)
        if isinstance(out, tuple):  # an LCEOutput: the loss and the mean log-prob are both differentiated
            objective = out.loss + out.logprobs.float().mean()
        else:
            objective = out.sum() if out.dim() else out
        objective.backward()
        return objective.detach(), self.inputs.hidden.grad

    def forward(self) -> object:
        """The call alone (under no_grad: what evaluation and RL log-prob passes run)."""
        return self.module(self.inputs.hidden, self.inputs.weight, self.inputs.target)

    def values(self) -> tuple[float, torch.Tensor | None]:
        """The objective (one host sync, outside the timed calls) and the hidden gradient."""
        objective, grad_hidden = self()
        return float(objective), grad_hidden


def time_call(fn: Callable, device: torch.device, warmup: int, repeats: int,
          reset: Callable[[], None] | None = None) -> tuple[float, int | None]:
    """Median milliseconds of ``fn`` and, on accelerators with allocator statistics, the peak
    allocated bytes above what was allocated before the first timed call (after ``reset``, which
    frees what the previous call left behind, such as gradients)."""
    module = None if device.type == "cpu" else torch.get_device_module(device.type)
    for _ in range(warmup):
        fn()
    if module is None:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), None
    if reset is not None:
        reset()
    module.synchronize()
    gc.collect()
    base = None
    if hasattr(module, "reset_peak_memory_stats"):
        module.reset_peak_memory_stats(device)
        base = module.memory_allocated(device)
    events = []
    for _ in range(repeats):
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    module.synchronize()
    times = [start.elapsedtime_call(end) for start, end in events]
    peak = None if base is None else module.max_memory_allocated(device) - base
    return statistics.median(times), peak


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        if hasattr(module, "empty_cache"):
            module.empty_cache()
