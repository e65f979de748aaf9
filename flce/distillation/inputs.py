"""The checks on one distillation call's tensors, done before any kernel runs, and its flattened form.

Errors name the argument, its value and what was expected. As for cross-entropy, targets on the CPU
are range-checked here; on an accelerator the engine asserts their range on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.distillation.config import DistillationConfig
from flce.errors import InputError, InputTypeError
from flce.inputs import FlatInputs, _check_target_range

_NAMES = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")


@dataclass(frozen=True)
class FlatPair:
    """A call's tensors flattened to [N, H] rows, in the dtype the kernels compute in."""

    student_hidden: torch.Tensor  # [N, H_s]
    student_weight: torch.Tensor  # [V, H_s]
    student_bias: torch.Tensor | None  # [V]
    teacher_hidden: torch.Tensor  # [N, H_t]
    teacher_weight: torch.Tensor  # [V, H_t]
    teacher_bias: torch.Tensor | None  # [V]
    target: torch.Tensor | None  # [N] int64
    token_shape: torch.Size  # the student hidden's leading shape: reduction="none"'s output shape

    @property
    def n_rows(self) -> int:
        return self.student_hidden.shape[0]

    def student(self) -> FlatInputs:
        """The student's head as the cross-entropy engine's inputs (its gradient accumulator reads them)."""
        return FlatInputs(self.student_hidden, self.student_weight, self._target_or_stand_in(), self.student_bias,
                          self.token_shape)

    def teacher(self) -> FlatInputs:
        return FlatInputs(self.teacher_hidden, self.teacher_weight, self._target_or_stand_in(), self.teacher_bias,
                          self.token_shape)

    def _target_or_stand_in(self) -> torch.Tensor:
        if self.target is not None:
            return self.target
        return torch.zeros((), dtype=torch.int64, device=self.student_hidden.device).expand(self.n_rows)


def prepare_pair(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                 teacher_weight: torch.Tensor, target: torch.Tensor | None, student_bias: torch.Tensor | None,
                 teacher_bias: torch.Tensor | None, cfg: DistillationConfig) -> FlatPair:
    tensors = (student_hidden, student_weight, teacher_hidden, teacher_weight)
    for name, value in zip(_NAMES, tensors, strict=True):
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    for name, value in (("target", target), ("student_bias", student_bias), ("teacher_bias", teacher_bias)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
    for name, value in zip(_NAMES, tensors, strict=True):
        weight = name.endswith("weight")
        if not value.is_floating_point() or (value.dim() != 2 if weight else value.dim() < 1):
            raise InputError(f"{name}: expected a floating-point tensor {'[V, H]' if weight else '[..., H]'}, "
                             f"got dtype {value.dtype}, shape {tuple(value.shape)}")
    vocab, student_size = student_weight.shape
    teacher_vocab, teacher_size = teacher_weight.shape
    if teacher_vocab != vocab:
        raise InputError(f"teacher_weight: has vocabulary {teacher_vocab} but student_weight has {vocab}; expected "
                         "equal vocabularies (the same tokenizer; pad the smaller head's rows if one is padded)")
    if cfg.process_group is None:  # a vocabulary shard: every rank's size is checked at once (distributed)
        check_vocabulary(vocab)
    for name, hidden, size in (("student_hidden", student_hidden, student_size),
                               ("teacher_hidden", teacher_hidden, teacher_size)):
        if hidden.shape[-1] != size:
            weight = name.replace("hidden", "weight")
            raise InputError(f"{name}: last dimension is {hidden.shape[-1]} but {weight} is [V={vocab}, "
                             f"H={size}]; expected {name} [..., {size}]")
    tokens = student_hidden.shape[:-1].numel()
    if teacher_hidden.shape[:-1].numel() != tokens:
        raise InputError(f"teacher_hidden: has {teacher_hidden.shape[:-1].numel()} tokens (shape "
                         f"{tuple(teacher_hidden.shape)}) but student_hidden has {tokens} (shape "
                         f"{tuple(student_hidden.shape)}); expected one teacher row per student row")
    if target is not None:
        if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            raise InputTypeError(f"target: expected an integer tensor of class ids, got dtype {target.dtype}")
        if target.shape != student_hidden.shape[:-1]:
            raise InputError(f"target: has shape {tuple(target.shape)} but student_hidden has shape "
                             f"{tuple(student_hidden.shape)}; expected target of shape "
                             f"{tuple(student_hidden.shape[:-1])}")
    elif cfg.hard:
        raise InputError(f"hard_label_weight={cfg.hard_label_weight}: the hard-label term needs target; pass "
                         "target, or hard_label_weight=0")
    for name, bias in (("student_bias", student_bias), ("teacher_bias", teacher_bias)):
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != vocab):
            raise InputError(f"{name}: expected shape [V={vocab}], got {tuple(bias.shape)}")
    present = [(n, t) for n, t in zip((*_NAMES, "target", "student_bias", "teacher_bias"),
                                      (*tensors, target, student_bias, teacher_bias), strict=True) if t is not None]
    for name, value in present[1:]:
        if value.device != student_hidden.device:
            raise InputError(f"{name} is on {value.device} but student_hidden is on {student_hidden.device}; "
                             "expected all tensors on one device")
    floats = _common_dtype([(n, t) for n, t in present if n != "target"], student_hidden.device.type)
    flat_target = None
    if target is not None:
        flat_target = target.reshape(-1).long()
        _check_target_range(flat_target, vocab, cfg.ignore_index, cfg.process_group is not None)
    return FlatPair(student_hidden=floats["student_hidden"].reshape(tokens, student_size),
                    student_weight=floats["student_weight"], student_bias=floats.get("student_bias"),
                    teacher_hidden=floats["teacher_hidden"].reshape(tokens, teacher_size),
                    teacher_weight=floats["teacher_weight"], teacher_bias=floats.get("teacher_bias"),
                    target=flat_target, token_shape=student_hidden.shape[:-1])


def check_vocabulary(vocab: int) -> None:
    """Both heads' softmaxes need a class: an empty vocabulary is refused before compute."""
    if vocab == 0:
        raise InputError("student_weight: has no classes; expected [V, H] with V >= 1")


def _common_dtype(named: list[tuple[str, torch.Tensor]], device_type: str) -> dict[str, torch.Tensor]:
    """Under autocast every tensor in the autocast dtype; outside, one dtype for all (both heads' logits
    share the kernels' compute dtype)."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return {name: t.to(dtype) for name, t in named}
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise InputTypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}; expected one "
                            "dtype for both heads' tensors (or call inside torch.autocast)")
    return dict(named)
