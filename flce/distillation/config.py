"""The options of one linear distillation call, validated once, before any kernel runs.

Every backend's distillation kernels receive a :class:`DistillationConfig`; docs/distillation.md is the
user's table of the same options.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from flce.config import Primitive, _check_bool, _check_int, _check_memory_budget, _check_reduction, check_finite_real
from flce.errors import InputError, InputTypeError

LOSSES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillationConfig:
    """A call's options. ``loss``: the divergence between P = softmax(teacher / temperature) and
    Q = softmax(student / temperature); ``beta``: JSD's mixture weight of P, in (0, 1);
    ``hard_label_weight``: w in ``w * CE(student at temperature 1, target) + (1 - w) * divergence``;
    ``teacher_grad``: whether the teacher's tensors (those that require grad) get gradients (False: the
    teacher is a constant, whatever its tensors' requires_grad says); ``return_entropy``: the call also returns
    each token's entropy of Q (no gradient; a trainer's logged metric), made in the statistics' pass."""

    loss: str = "jsd"
    beta: float = 0.5
    temperature: float = 1.0
    hard_label_weight: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    memory_budget: int | None = None
    process_group: Any = None
    teacher_grad: bool = False
    return_entropy: bool = False

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            check(getattr(self, name))
        _check_beta(self.beta, self.loss)
        # Whole numbers are accepted for the real-valued options and stored as floats (the op schema's type).
        for name in ("beta", "temperature", "hard_label_weight"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def hard(self) -> bool:
        """The hard-label cross-entropy term is part of the loss."""
        return self.hard_label_weight != 0.0

    @property
    def soft(self) -> bool:
        """The divergence term is part of the loss."""
        return self.hard_label_weight != 1.0

    @property
    def hard_needs_own_lse(self) -> bool:
        """The cross-entropy's softmax (temperature 1) differs from the divergence's: its own statistics."""
        return self.hard and self.temperature != 1.0

    def replace(self, **changes: Any) -> DistillationConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DistillationConfig(**values)


def _check_loss(value: Any) -> None:
    if value not in LOSSES:
        close = difflib.get_close_matches(str(value), LOSSES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"loss={value!r}: expected one of {LOSSES}{hint}")


def _check_beta(value: Any, loss: str) -> None:
    """JSD's beta is in (0, 1). The KL divergences do not read it, but take any value in [0, 1]: a trainer that
    names them by beta (TRL's GKD: 0 is KL(P || Q), 1 is KL(Q || P)) can pass its beta along."""
    check_finite_real("beta", value)
    if loss == "jsd" and not 0.0 < value < 1.0:
        raise InputError(f"beta={value}: expected a value in the open interval (0, 1) (beta -> 0 and 1 are "
                         "the KL divergences: pass loss='forward_kl' or 'reverse_kl')")
    if not 0.0 <= value <= 1.0:
        raise InputError(f"beta={value}: expected a value in [0, 1] (loss={loss!r} does not use it)")


def loss_of_beta(beta: float) -> str:
    """The loss a trainer that names the KL divergences by beta means (TRL's GKD and DistillationTrainer, Liger's
    JSD: 0 is KL(P || Q), 1 is KL(Q || P), between them the generalized JSD)."""
    return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(float(beta), "jsd")


def _check_temperature(value: Any) -> None:
    check_finite_real("temperature", value)
    if not value > 0.0:
        raise InputError(f"temperature={value}: expected a value > 0")


def _check_hard_label_weight(value: Any) -> None:
    check_finite_real("hard_label_weight", value)
    if not 0.0 <= value <= 1.0:
        raise InputError(f"hard_label_weight={value}: expected a value in [0, 1]")


# The options cross-entropy has too are checked by its checks (flce.config), with its errors.
_CHECKS = {
    "loss": _check_loss,
    "temperature": _check_temperature,
    "hard_label_weight": _check_hard_label_weight,
    "ignore_index": lambda value: _check_int("ignore_index", value),
    "reduction": _check_reduction,
    "memory_budget": _check_memory_budget,
    "teacher_grad": _check_bool("teacher_grad"),
    "return_entropy": _check_bool("return_entropy"),
}
OPTION_NAMES = tuple(f.name for f in fields(DistillationConfig))

# The options as primitives for the compile path's op schema (process_group travels by its name).
PRIMITIVE_OPTION_TYPES = {"loss": "str", "beta": "float", "temperature": "float", "hard_label_weight": "float",
                          "ignore_index": "int", "reduction": "str", "memory_budget": "int?", "teacher_grad": "bool",
                          "return_entropy": "bool"}


def config_from_keywords(caller: str, options: dict[str, Any]) -> DistillationConfig:
    """``DistillationConfig(**options)`` with an unknown keyword reported against ``caller``."""
    for name in options:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InputTypeError(f"{caller}() got an unexpected option {name!r}{hint} Valid options: "
                            f"{', '.join(OPTION_NAMES)}")
    return DistillationConfig(**options)


def primitive_options(cfg: DistillationConfig) -> dict[str, Primitive]:
    return {name: getattr(cfg, name) for name in PRIMITIVE_OPTION_TYPES}


def config_from_primitives(options: dict[str, Any], process_group: Any = None) -> DistillationConfig:
    """The inverse of :func:`primitive_options` (``options`` may hold other keys)."""
    return DistillationConfig(**{name: options[name] for name in PRIMITIVE_OPTION_TYPES},
                              process_group=process_group)
