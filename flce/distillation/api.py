"""The public linear distillation: ``flce.linear_distillation_loss`` and the module class that
``flce.get_distillation_impl`` returns (docs/distillation.md)."""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

import torch

from flce.distillation.config import DistillationConfig, config_from_keywords
from flce.distillation.inputs import prepare_pair
from flce.distributed.dtensor import localize_pair
from flce.engine.distillation.run import run_distillation
from flce.errors import InputError, InputTypeError
from flce.outputs import DistillationOutput
from flce.registry import HardwareProbe, candidates_for, resolve_device
from flce.registry.distillation import resolve_distillation
from flce.registry.selection import backend_named


class LinearDistillation(torch.nn.Module):
    """A student's distillation loss against a teacher's head, neither model's logits materialised.

    Constructor keywords are :class:`flce.distillation.config.DistillationConfig`'s options;
    ``forward(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, *,
    student_bias=None, teacher_bias=None)`` returns the loss (reduction "none": one per token, the student
    hidden's leading shape), or with ``return_entropy`` a :class:`flce.DistillationOutput`. Subclasses made by
    :func:`get_distillation_impl` fix the device type and backend.
    """

    device_type: ClassVar[str] = "cpu"
    backend_name: ClassVar[str | None] = None
    probe: ClassVar[HardwareProbe | None] = None

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = config_from_keywords(type(self).__name__, options)

    def forward(self, student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                teacher_weight: torch.Tensor, target: torch.Tensor | None = None, *,
                student_bias: torch.Tensor | None = None,
                teacher_bias: torch.Tensor | None = None) -> torch.Tensor | DistillationOutput:
        return _compute(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                        teacher_bias, self.config, self.device_type, self.backend_name, self.probe)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """get_distillation_impl's classes are made at run time: pickle rebuilds the class from what it was
        made of, then restores the instance's state (as LinearCrossEntropy does)."""
        cls = type(self)
        reduced = super().__reduce_ex__(protocol)
        if cls is LinearDistillation or not isinstance(reduced, tuple):
            return reduced
        return (_new_instance, (cls.device_type, cls.backend_name, cls.probe), *reduced[2:])

    def extra_repr(self) -> str:
        options = {k: v for k, v in vars(self.config).items() if k != "process_group"}
        return f"device_type={self.device_type!r}, backend={self.backend_name!r}, {options}"


def _compute(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
             teacher_weight: torch.Tensor, target: torch.Tensor | None, student_bias: torch.Tensor | None,
             teacher_bias: torch.Tensor | None, cfg: DistillationConfig, device_type: str, backend_name: str | None,
             probe: HardwareProbe | None) -> torch.Tensor | DistillationOutput:
    """One call, shared by the module and the functional form: every check before any kernel."""
    # Weights as a parallelism framework holds them (DTensors: tensor parallelism, FSDP2) become plain tensors.
    student, teacher, target, cfg = localize_pair((student_hidden, student_weight, student_bias),
                                                  (teacher_hidden, teacher_weight, teacher_bias), target, cfg)
    (student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias) = student, teacher
    pair = prepare_pair(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                        teacher_bias, cfg)
    weight = pair.student_weight
    # len(range(n)) specialises a symbolic size to the constant the resolution needs under torch.compile.
    name = resolve_distillation(device_type, backend_name, weight.dtype, len(range(weight.shape[1])),
                                len(range(weight.shape[0])), probe)
    backend = backend_named(name)
    if cfg.process_group is not None:
        from flce.distributed.distillation import vocab_parallel_distillation

        result = vocab_parallel_distillation(pair, cfg, backend)
    else:
        result = run_distillation(backend, pair, cfg)
    return DistillationOutput(*result) if cfg.return_entropy else result


def get_distillation_impl(device: str | torch.device | torch.Tensor | None = None, *, backend: str | None = None,
                          probe: HardwareProbe | None = None) -> type[LinearDistillation]:
    """The distillation module class for ``device`` (None: the current accelerator, else the CPU); ``backend``
    forces one backend (else ``FLCE_BACKEND``, else the best available with distillation kernels)."""
    device_type = resolve_device(device).type
    candidates_for(device_type, backend, probe)  # an unavailable or unknown backend fails here, not at the call
    if backend is not None and backend_named(backend).plan_distillation is None:
        raise InputError(f"backend={backend!r}: has no linear distillation kernels")
    return _impl_class(device_type, backend, probe)


@cache
def _impl_class(device_type: str, backend: str | None, probe: HardwareProbe | None) -> type[LinearDistillation]:
    attrs = {"device_type": device_type, "backend_name": backend, "probe": probe, "__module__": __name__}
    return type(f"LinearDistillation_{device_type}_{backend or 'auto'}", (LinearDistillation,), attrs)


def _new_instance(device_type: str, backend: str | None, probe: HardwareProbe | None) -> LinearDistillation:
    cls = _impl_class(device_type, backend, probe)
    return cls.__new__(cls)


def linear_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    backend: str | None = None,
    memory_budget: int | None = None,
    process_group: Any = None,
    teacher_grad: bool = False,
    return_entropy: bool = False,
) -> torch.Tensor | DistillationOutput:
    """The distillation loss of ``student_hidden @ student_weight.T (+ student_bias)`` against
    ``teacher_hidden @ teacher_weight.T (+ teacher_bias)``, on the student hidden's device
    (docs/distillation.md): ``loss`` "forward_kl" KL(P||Q), "reverse_kl" KL(Q||P) or "jsd" (beta), P and Q the
    teacher's and the student's softmax at ``temperature``; plus ``hard_label_weight`` times the student's
    cross-entropy with ``target`` (whose ``ignore_index`` rows count nowhere). The teacher takes gradients
    only with ``teacher_grad=True`` (and then those of its tensors that require grad). ``return_entropy``: a
    :class:`flce.DistillationOutput` (loss, each token's entropy of Q, no gradient), made in the statistics'
    pass instead of another GEMM of the student's head."""
    if not isinstance(student_hidden, torch.Tensor):
        raise InputTypeError(f"student_hidden: expected a torch.Tensor, got {type(student_hidden).__name__}")
    cfg = DistillationConfig(loss=loss, beta=beta, temperature=temperature, hard_label_weight=hard_label_weight,
                             ignore_index=ignore_index, reduction=reduction, memory_budget=memory_budget,
                             process_group=process_group, teacher_grad=teacher_grad, return_entropy=return_entropy)
    return _compute(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                    teacher_bias, cfg, student_hidden.device.type, backend, None)
