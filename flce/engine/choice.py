"""What a backend's planner decides for one call, as one record: the plan, the memory it may use and,
step by step, the kernel that runs it and why.

Every engine backend's planner is a pure function of a :class:`DeviceDescription`, a
:class:`CallDescription` and the autotune cache's entry, and returns a :class:`CallChoice`. A real call
describes its tensors and device and plans from those descriptions (``Backend.plan_call``);
``python -m flce explain`` builds the same descriptions from names and numbers, so it prints exactly what
a call of that shape would run, without the device (``Backend.choose``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from flce.autotune.devices import device_name
from flce.config import LCEConfig
from flce.engine.memory import total_memory_bytes
from flce.engine.plans import Plan, PlanRequest, describe
from flce.inputs import FlatInputs

# TMA and vectorised loads want each row of an operand to start on a 16-byte boundary.
ROW_ALIGNMENT = 16


@dataclass(frozen=True)
class DeviceDescription:
    """What a planner may know about the device: nothing it has to ask a driver for."""

    type: str  # the torch device type the call's tensors are on: "cuda", "npu", "cpu"
    name: str  # as the autotune cache names it: "NVIDIA H100 80GB HBM3", "cpu:<model>"
    total_memory: int  # bytes of device memory (RAM for the CPU)
    capability: tuple[int, int] | None = None  # CUDA compute capability
    multiprocessors: int = 0  # streaming multiprocessors (CUDA), vector cores (Ascend)
    interpreter: bool = False  # Triton kernels run in its interpreter, on CPU tensors
    triton: str | None = None  # the version of Triton the kernels compile with (None: not installed)
    # The GPU the kernels run on where the call is planned as another (FLCE_CUDA_PLAN_AS), else None.
    runs_on: str | None = None
    shared_memory: int = 0  # bytes of shared memory one block may use (CUDA); 0: unknown

    @property
    def arch(self) -> str:
        """``sm_90`` and the like, from the compute capability."""
        return "no compute capability" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"

    def text(self) -> str:
        parts = [self.name]
        if self.capability is not None:
            parts.append(self.arch)
        if self.multiprocessors:
            parts.append(f"{self.multiprocessors} {'SMs' if self.type == 'cuda' else 'cores'}")
        parts.append(f"{self.total_memory / 2**30:.0f} GiB")
        if self.interpreter:
            parts.append("Triton interpreter on CPU tensors")
        if self.triton:
            parts.append(f"triton {self.triton}")
        if self.runs_on:
            parts.append(f"planned as this GPU, running on an {self.runs_on} (FLCE_CUDA_PLAN_AS)")
        return ", ".join(parts)


_described: dict[tuple[str, int | None], DeviceDescription] = {}


def describe_device(device: torch.device) -> DeviceDescription:
    """A real device's description as every backend but CUDA needs it (its name and memory), once per device.
    The CUDA backend adds what its kernels depend on (backends/cuda/hardware.py)."""
    key = (device.type, device.index)
    found = _described.get(key)
    if found is None:
        found = _described[key] = DeviceDescription(type=device.type, name=device_name(device),
                                                    total_memory=total_memory_bytes(device))
    return found


@dataclass(frozen=True)
class CallDescription:
    """What a planner reads of one call's inputs: sizes, dtype, the bias, how the operands lie in
    memory, the options, the variant and what follows the call (``request``)."""

    n_rows: int
    hidden: int
    vocab: int
    dtype: torch.dtype
    bias: bool
    rows_aligned: bool  # hidden and weight rows 16-byte aligned with unit column stride, as a launcher sees them
    cfg: LCEConfig
    variant: str  # "plain" or "full"
    request: PlanRequest

    @staticmethod
    def of(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> CallDescription:
        vocab, hidden = flat.weight.shape
        return CallDescription(n_rows=flat.target.shape[0], hidden=hidden, vocab=vocab, dtype=flat.weight.dtype,
                               bias=flat.bias is not None,
                               rows_aligned=rows_aligned(flat.hidden) and rows_aligned(flat.weight),
                               cfg=cfg, variant=variant, request=request)

    @property
    def plain(self) -> bool:
        return self.variant == "plain"

    @property
    def key(self) -> tuple:
        """What a planner's answer depends on, hashable: the options by value, tensors by shape and dtype
        (a planner reads no tensor option's values). Planners memoise their records by it."""
        options = tuple(vars(self.cfg).values())  # every option, in field order (one tensor: class_weight)
        weights = self.cfg.class_weight
        if weights is not None:
            options = tuple((tuple(weights.shape), weights.dtype) if value is weights else value for value in options)
        return (self.n_rows, self.hidden, self.vocab, self.dtype, self.bias, self.rows_aligned, self.variant,
                self.request, options)

    def text(self) -> str:
        what = "training" if self.request.training else "no gradient"
        set_options = [f"{f.name}={_option_text(getattr(self.cfg, f.name))}" for f in fields(self.cfg)
                       if not _is_default(getattr(self.cfg, f.name), f.default)]
        return (f"{str(self.dtype).removeprefix('torch.')} {self.n_rows} tokens x H {self.hidden} x V {self.vocab}"
                f"{' + bias' if self.bias else ''}, {what}, variant {self.variant}"
                f"{', vocabulary shard' if self.request.sharded else ''}"
                f"{', operand rows not 16-byte aligned' if not self.rows_aligned else ''}; "
                f"options: {', '.join(set_options) or 'defaults'}")


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether every row of ``t`` starts on a 16-byte boundary with unit column stride as the launchers
    pass it (a tensor without unit column stride is copied to a contiguous one first). A tensor whose
    memory cannot be seen (a torch.func wrapper of one) counts as unaligned."""
    row_bytes = t.shape[-1] * t.element_size()
    if t.stride(-1) != 1:
        return row_bytes % ROW_ALIGNMENT == 0
    rows_apart = t.stride(0) * t.element_size() if t.dim() > 1 else row_bytes
    address = _address(t)
    return rows_apart % ROW_ALIGNMENT == 0 and address is not None and address % ROW_ALIGNMENT == 0


def _address(t: torch.Tensor) -> int | None:
    """The first element's address, through torch.func's wrappers (which have no storage of their own)."""
    functorch = getattr(torch._C, "_functorch", None)
    while functorch is not None and functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _is_default(value: object, default: object) -> bool:
    if value is None or default is None or isinstance(value, torch.Tensor):
        return value is default
    return value == default


def _option_text(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"[{value.shape[0]}] {str(value.dtype).removeprefix('torch.')}"
    return str(value).removeprefix("torch.")


@dataclass(frozen=True)
class Step:
    """One step of a call and what runs it: ``kernels``, the functions launched (dotted paths that
    import, e.g. ``flce.backends.cuda.kernels._row_stats_kernel`` or ``torch.mm``), and why.
    ``fallback``: what runs instead if one of them fails to compile. ``launch``: its tiles or blocks."""

    name: str
    kernels: tuple[str, ...]
    reason: str
    launch: str = ""
    fallback: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryPlan:
    """The working memory a plan was sized to: the budget and where it came from, what one chunk (or
    vocabulary block) of the plan holds, and the logits a deferred backward keeps (and its limit)."""

    budget: int
    budget_from: str
    working_bytes: int
    saved_logits_bytes: int = 0
    save_limit: int | None = None  # None: no logits are kept by this plan's schedule
    save_limit_from: str = ""

    def without_kept_logits(self, working_bytes: int) -> MemoryPlan:
        """The plan of a call that keeps no logits (no gradient follows, or they are computed in forward)."""
        return MemoryPlan(self.budget, self.budget_from, working_bytes)

    def text(self) -> list[str]:
        working = ("none beyond the kept logits" if self.working_bytes == 0 and self.saved_logits_bytes
                   else _bytes(self.working_bytes))
        lines = [f"budget {_bytes(self.budget)} ({self.budget_from}); working memory {working}"]
        if self.save_limit is not None:
            lines.append(f"kept logits {_bytes(self.saved_logits_bytes)} of a limit of {_bytes(self.save_limit)} "
                         f"({self.save_limit_from})")
        return lines


def _bytes(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class CallChoice:
    """The record of one call's decision (module docstring). Equal records plan the same work."""

    backend: str
    device: str
    inputs: str
    cache: str  # the autotune entry the knobs came from, or why none applied
    plan: Plan
    gradients: str  # when the gradients are computed, and why (flce.engine.call.gradient_timing)
    memory: MemoryPlan
    steps: tuple[Step, ...]
    kernel_package: str  # the package the kernel paths are printed relative to
    # What the schedule line needs of the call: its tokens, whether gradients follow and whether they are formed in
    # the forward (engine/call.py call_record fills them).
    n_rows: int = 0
    training: bool = False
    in_forward: bool = False
    statistics_first: bool = False  # the gradients follow every row's statistics (a sequence-level policy loss)

    def with_plan(self, plan: Plan) -> CallChoice:
        """The record with the plan an engine path adjusted (the compile path keeps no logits)."""
        return replace(self, plan=plan)

    def kernel_names(self) -> set[str]:
        """Every function any step launches (not the fallbacks)."""
        return {k for step in self.steps for k in step.kernels}

    def lines(self) -> list[str]:
        prefix = self.kernel_package + "."
        lines = [f"backend: {self.backend}", f"device: {self.device}", f"call: {self.inputs}",
                 f"autotune cache: {self.cache}",
                 f"schedule: {describe(self.plan, self.n_rows, self.training, self.in_forward, self.statistics_first)}",
                 f"gradients: {self.gradients}", "memory:"]
        lines += [f"  {line}" for line in self.memory.text()]
        lines.append(f"steps (kernels in {self.kernel_package} unless named in full):")
        for step in self.steps:
            lines.append(f"  {step.name}: {', '.join(k.removeprefix(prefix) for k in step.kernels) or 'nothing'}")
            if step.launch:
                lines.append(f"      launch: {step.launch}")
            lines.append(f"      why: {step.reason}")
            if step.fallback:
                fallback = ", ".join(k.removeprefix(prefix) for k in step.fallback)
                lines.append(f"      if it fails to compile: {fallback}")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())
