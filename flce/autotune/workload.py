"""What the tuner runs and how it times it: the benchmark tools' inputs for the shape, one
forward+backward of a backend with a variant's representative options (each loss kind's call and inputs in
LOSS_WORKLOADS), and flce.testing.measure's timer and peak memory."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flce.autotune.measurement import Skip
from flce.autotune.spaces import CROSS_ENTROPY, DISTILLATION, TuneShape
from flce.engine.memory import total_memory_bytes
from flce.testing import measure

# The timed repeats of one measurement should agree: (upper - lower quartile) / median at most this
# (with fewer than 4 repeats, (max - min) / median). Otherwise it is measured again, up to
# MEASURE_ATTEMPTS times, and the steadiest attempt is kept.
MAX_REPEAT_SPREAD = 0.25
MEASURE_ATTEMPTS = 3
# The floor is measured until two attempts agree this closely (the smaller one kept), at most
# FLOOR_ATTEMPTS times: a process's first GEMMs pay for thread pools and kernel selection (143 ms,
# then 84 ms, once on a loaded 2-core CPU), so one attempt, however steady its repeats, is not enough.
FLOOR_AGREEMENT = 0.03
FLOOR_ATTEMPTS = 8


@dataclass
class WorkloadInputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    # A distillation shape's teacher (no gradient), of the student's hidden size: the cache keys its entries
    # by the student's.
    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None

    def clear_grads(self) -> None:
        self.hidden.grad = self.weight.grad = None

    def flat(self):
        from flce.inputs import FlatInputs

        return FlatInputs(hidden=self.hidden, weight=self.weight, target=self.target, bias=None,
                          token_shape=self.target.shape)


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


# A loss's call on the workload's inputs: (hidden, weight, target) -> its output (a loss, or an LCEOutput).
LossCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def _cross_entropy_call(shape: TuneShape, inputs: WorkloadInputs, backend: str, deferred: bool) -> LossCall:
    import flce

    return flce.get_impl(shape.device, backend=backend, variant=shape.variant)(
        **workload_options(shape.variant, deferred=deferred))


def _distillation_call(shape: TuneShape, inputs: WorkloadInputs, backend: str, deferred: bool) -> LossCall:
    """flce.linear_distillation_loss's JSD: a scalar loss, or per-token losses where deferred."""
    import flce

    module = flce.get_distillation_impl(shape.device, backend=backend)(
        loss="jsd", reduction="none" if deferred else "mean")
    return lambda x, w, t: module(x, w, inputs.teacher_hidden, inputs.teacher_weight, t)


@dataclass(frozen=True)
class LossWorkload:
    """What the tuner runs for one loss kind: whether its inputs carry a teacher, and its call."""

    teacher: bool
    call: Callable[[TuneShape, WorkloadInputs, str, bool], LossCall]


LOSS_WORKLOADS = {CROSS_ENTROPY: LossWorkload(teacher=False, call=_cross_entropy_call),
                  DISTILLATION: LossWorkload(teacher=True, call=_distillation_call)}


def make_inputs(shape: TuneShape, seed: int) -> WorkloadInputs:
    """The benchmark tools' inputs for the shape (logits O(1), every 17th target ignored), on the device, with a
    teacher where its loss has one; raises Skip where they cannot be allocated (a shape larger than the device's
    memory, or than any)."""
    try:
        hidden, weight, target, _ = measure.shape_inputs(shape.tokens, shape.hidden, shape.vocab, shape.device,
                                                         shape.dtype, seed=seed)
        if not LOSS_WORKLOADS[shape.kind].teacher:
            return WorkloadInputs(hidden, weight, target)
        teacher_hidden, teacher_weight, _, _ = measure.shape_inputs(shape.tokens, shape.hidden, shape.vocab,
                                                                    shape.device, shape.dtype, seed=seed + 1,
                                                                    requires_grad=False)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError, the CPU allocator's, a size overflow
        release_memory(shape.device)
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise Skip("inputs not allocated", f"{type(exc).__name__}: {first_line}") from None
    return WorkloadInputs(hidden, weight, target, teacher_hidden, teacher_weight)


class Workload:
    """One forward+backward of the backend on the shape's inputs: its loss kind's call (LOSS_WORKLOADS)."""

    def __init__(self, shape: TuneShape, inputs: WorkloadInputs, backend: str, deferred: bool):
        self.inputs = inputs
        self.module = LOSS_WORKLOADS[shape.kind].call(shape, inputs, backend, deferred)

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
              reset: Callable[[], None] | None = None) -> tuple[float, int | None, float]:
    """Median milliseconds of ``fn``; with ``reset`` (which frees what the previous call left
    behind, such as gradients) on accelerators with allocator statistics, the peak bytes of one more
    call above what was allocated before it and what it leaves allocated; and how far the timed
    repeats disagree (:func:`spread`)."""
    timing = measure.counted_timing(fn, device, warmup=warmup, repeats=repeats)
    ms, disagreement = timing.median_ms, spread(timing)
    if reset is None:
        return ms, None, disagreement
    reset()
    gc.collect()
    return ms, measure.peak_bytes_above(fn, device), disagreement


def spread(timing: measure.Timing) -> float:
    """How far the repeats of one measurement disagree, relative to their median: the interquartile
    range (the full range with fewer than 4 repeats, where quartiles say nothing)."""
    median = timing.median_ms
    if median <= 0:
        return 0.0 if timing.max_ms <= 0 else math.inf
    if len(timing.samples_ms) < 4:
        return (timing.max_ms - timing.min_ms) / median
    lower, upper = timing.quartiles_ms
    return (upper - lower) / median


class Floors:
    """The floor of each (dtype, H, V, tokens), measured once and shared by the variants of that shape,
    which run the same three GEMMs (measured per variant, one shape's floor once read 143.1 ms for one
    and 83.9 ms for the other): one per loss kind (distillation's has four GEMMs)."""

    def __init__(self, warmup: int, repeats: int):
        self.warmup, self.repeats = warmup, repeats
        self._ms: dict[tuple, float | None] = {}

    def of(self, shape: TuneShape, inputs: WorkloadInputs) -> float | None:
        key = self._key(shape)
        if key not in self._ms:
            self._ms[key] = floor_ms(shape, inputs, self.warmup, self.repeats)
        return self._ms[key]

    def measure_again(self, shape: TuneShape, inputs: WorkloadInputs) -> float | None:
        """The smaller of the floor and a new measurement (noise only ever adds time), kept from now on."""
        floor = self.of(shape, inputs)
        again = floor_ms(shape, inputs, self.warmup, self.repeats)
        lower = again if floor is None or (again is not None and again < floor) else floor
        self._ms[self._key(shape)] = lower
        return lower

    @staticmethod
    def _key(shape: TuneShape) -> tuple:
        return shape.dtype, shape.hidden, shape.vocab, shape.tokens, shape.kind


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        if hasattr(module, "empty_cache"):
            module.empty_cache()


def floor_ms(shape: TuneShape, inputs: WorkloadInputs, warmup: int, repeats: int) -> float | None:
    """The three GEMMs of forward+backward at full size (distillation: four, the teacher's logits too); None
    when the [tokens, V] logits and their gradient would take more than a quarter of the device's memory."""
    teacher = inputs.teacher_hidden is not None
    logits_bytes = shape.tokens * shape.vocab * shape.dtype.itemsize
    if (3 if teacher else 2) * logits_bytes > total_memory_bytes(shape.device) // 4:
        return None
    x, w = inputs.hidden.detach(), inputs.weight.detach()
    try:
        grad_logits = measure.floor_gradient(shape.tokens, shape.vocab, shape.dtype, shape.device)

        def gemms() -> None:
            if teacher:
                torch.mm(inputs.teacher_hidden, inputs.teacher_weight.t())
            torch.mm(x, w.t())
            torch.mm(grad_logits, w)
            torch.mm(grad_logits.t(), x)

        # At least one warm-up, and attempts until one is within FLOOR_AGREEMENT of the smallest
        # before it; the smallest is kept: noise only ever adds time.
        attempts: list[float] = []
        for _ in range(FLOOR_ATTEMPTS):
            ms, _, _ = time_call(gemms, shape.device, max(1, warmup), repeats)
            steady = bool(attempts) and abs(ms - min(attempts)) <= FLOOR_AGREEMENT * min(attempts)
            attempts.append(ms)
            if steady:
                break
    except torch.OutOfMemoryError:
        release_memory(shape.device)
        return None
    return min(attempts)
