"""The options of one linear cross-entropy call, validated once.

Every backend receives an :class:`LCEConfig`; the option table in docs/design.md is
the source of truth for names, defaults and meaning.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, fields
from typing import Any

import torch

from flce.errors import InputError, InputTypeError

REDUCTIONS = ("mean", "sum", "none")
# fast: logits rounded to the (16-bit) compute dtype before the fp32 softmax, as the GEMM writes them;
# accurate: the statistics and the gradient from fp32 logits, 16-bit only as GEMM operands.
PRECISIONS = ("fast", "accurate")

# Options whose non-default value needs the full-feature variant, with the
# test that says "this value is not the default".
_FULL_FEATURE_OPTIONS = {
    "label_smoothing": lambda v: v != 0.0,
    "lse_square_scale": lambda v: v != 0.0,
    "softcap": lambda v: v is not None,
    "class_weight": lambda v: v is not None,
    "temperature": lambda v: v != 1.0,
    "token_scaling": lambda v: bool(v),
    "entropy_weight": lambda v: v != 0.0,
    "return_z_loss": lambda v: bool(v),
    "return_token_accuracy": lambda v: bool(v),
    "return_predicted_tokens": lambda v: bool(v),
    "return_logprobs": lambda v: bool(v),
    "return_entropy": lambda v: bool(v),
    "return_logit_stats": lambda v: bool(v),
    "batch_invariant": lambda v: bool(v),
}


@dataclass(frozen=True)
class LCEConfig:
    """Validated options; see docs/design.md's option table."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    class_weight: torch.Tensor | None = None
    temperature: float = 1.0
    token_scaling: bool = False
    entropy_weight: float = 0.0
    accum_dtype: torch.dtype | None = None
    memory_budget: int | None = None
    process_group: Any = None
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False
    return_logprobs: bool = False
    return_entropy: bool = False
    return_logit_stats: bool = False
    batch_invariant: bool = False
    detach_extras: bool = False
    precision: str = "fast"

    def __post_init__(self) -> None:
        validate_options(self, _OPTION_NAMES)

    def full_feature_options(self) -> list[str]:
        """Names of the options set here that the plain variant cannot serve."""
        return [name for name, is_set in _FULL_FEATURE_OPTIONS.items() if is_set(getattr(self, name))]

    @property
    def needs_full(self) -> bool:
        return bool(self.full_feature_options())

    @property
    def returns_extras(self) -> bool:
        """True when the call returns an LCEOutput instead of the bare loss."""
        return (self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens
                or self.return_logprobs or self.return_entropy or self.return_logit_stats)

    def replace(self, **changes: Any) -> LCEConfig:
        """A copy with ``changes``, of which only the changed options are checked: the others were when
        this config was made (a call's options are validated once, however often flce derives from them)."""
        unknown = set(changes) - set(_OPTION_NAMES)
        if unknown:
            raise InputTypeError(f"LCEConfig.replace() got unknown options {sorted(unknown)}")
        values = {name: getattr(self, name) for name in _OPTION_NAMES}
        values.update(changes)
        derived = _unchecked(values)
        validate_options(derived, tuple(changes))
        return derived



VARIANTS = ("plain", "full")
# Sizes on the command lines (explain's --memory and --memory_budget, flce-autotune's --memory-budget): binary
# units for KiB, MiB, GiB, TiB, decimal (SI) ones for KB, MB, GB, TB; what flce prints is always binary (MiB, GiB).
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(name: str, text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes (binary units for KiB/MiB/GiB, decimal for KB/MB/GB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise InputError(f"{name}={text!r}: expected a size such as 512MiB, 2GiB or a byte count")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise InputError(f"{name}={text!r}: expected a positive size")
    return value


def check_variant(variant: str) -> None:
    if variant not in ("auto", *VARIANTS):
        raise InputError(f"variant={variant!r}: expected 'auto', 'plain' or 'full'")


def resolve_variant(variant: str, cfg: LCEConfig, per_token_inputs: tuple[str, ...] = (), sharded: bool = False
                    ) -> str:
    """The variant a call runs, by the one rule the module, dispatch and explain share: the full variant serves
    every call; the plain one only calls without a full-feature option (LCEConfig.full_feature_options) and
    without per-token inputs (``per_token_inputs``: the names of those given, token_weights or selected_ids);
    "auto" picks plain where it can. A vocabulary shard (``sharded``) scans with the full variant's kernels, which
    produce combinable statistics. Raises ValueError for an unknown variant and for "plain" where it cannot."""
    check_variant(variant)
    needs_full = [*cfg.full_feature_options(), *per_token_inputs]
    if variant == "plain" and needs_full:
        raise InputError(f"variant='plain' cannot serve {', '.join(needs_full)}; use variant='full' or 'auto'")
    if sharded or (variant == "auto" and needs_full):
        return "full"
    return "plain" if variant == "auto" else variant


def _unchecked(values: dict[str, Any]) -> LCEConfig:
    """An LCEConfig of values that were already checked (a frozen dataclass built without __post_init__)."""
    cfg = object.__new__(LCEConfig)
    for name, value in values.items():
        object.__setattr__(cfg, name, value)
    return cfg


def validate_options(cfg: LCEConfig, names: tuple[str, ...]) -> None:
    """Check the options ``names`` of ``cfg``; raises naming the option, its value and what was expected."""
    for name in names:
        check = _CHECKS.get(name)
        if check is not None:
            check(getattr(cfg, name))


def _check_reduction(value: Any) -> None:
    if value not in REDUCTIONS:
        raise InputError(f"reduction={value!r}: expected one of {REDUCTIONS}")


def _check_label_smoothing(value: Any) -> None:
    check_finite_real("label_smoothing", value)
    if not 0.0 <= value <= 1.0:
        raise InputError(f"label_smoothing={value}: expected a value in [0, 1]")


def _check_lse_square_scale(value: Any) -> None:
    check_finite_real("lse_square_scale", value)
    if value < 0.0:
        raise InputError(f"lse_square_scale={value}: expected a value >= 0")


def _check_softcap(value: Any) -> None:
    if value is not None:
        check_finite_real("softcap", value)
        if not value > 0.0:
            raise InputError(f"softcap={value}: expected None or a value > 0")


def _check_temperature(value: Any) -> None:
    check_finite_real("temperature", value)
    if not value > 0.0:
        raise InputError(f"temperature={value}: expected a value > 0")


def _check_class_weight(w: Any) -> None:
    if w is None:
        return
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point():
        raise InputError(f"class_weight: expected a 1-D floating-point tensor of shape [V], got {_describe(w)}")
    if w.requires_grad:
        # As torch's cross_entropy(weight=...) refuses: no gradient flows to class weights.
        raise InputError(
            "class_weight requires grad, but class weights are constants (no gradient flows to them, "
            "as for torch's cross_entropy weight=); pass class_weight.detach()"
        )


def _check_precision(value: Any) -> None:
    if value not in PRECISIONS:
        raise InputError(f"precision={value!r}: expected one of {PRECISIONS}")


def _check_accum_dtype(value: Any) -> None:
    if value not in (None, torch.float32):
        raise InputError(f"accum_dtype={value}: expected None or torch.float32")


def _check_memory_budget(value: Any) -> None:
    if value is not None:
        _check_int("memory_budget", value)
        if value <= 0:
            raise InputError(f"memory_budget={value}: expected a positive byte count")


def _check_bool(name: str) -> Any:
    def check(value: Any) -> None:
        if not isinstance(value, bool):
            raise InputTypeError(f"{name}={value!r}: expected a bool")

    return check


# One check per option (process_group: any object, checked where it is used).
_CHECKS: dict[str, Any] = {
    "ignore_index": lambda value: _check_int("ignore_index", value),
    "reduction": _check_reduction,
    "label_smoothing": _check_label_smoothing,
    "lse_square_scale": _check_lse_square_scale,
    "softcap": _check_softcap,
    "temperature": _check_temperature,
    "entropy_weight": lambda value: check_finite_real("entropy_weight", value),
    "class_weight": _check_class_weight,
    "precision": _check_precision,
    "accum_dtype": _check_accum_dtype,
    "memory_budget": _check_memory_budget,
    **{name: _check_bool(name) for name in ("token_scaling", "return_z_loss", "return_token_accuracy",
                                            "return_predicted_tokens", "return_logprobs", "return_entropy",
                                            "return_logit_stats", "batch_invariant", "detach_extras")},
}


# Computed once: dataclasses.fields cannot be traced by torch.compile, and the functional form
# checks its keywords against these names inside the trace.
_OPTION_NAMES = tuple(f.name for f in fields(LCEConfig))


def option_names() -> tuple[str, ...]:
    return _OPTION_NAMES


# The custom ops that run flce under torch.compile take integer options as int64 (SymInt): a value
# outside that range is refused here, so that eager and compiled calls fail alike, before any work.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name}={value!r}: expected an int")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise InputError(f"{name}={value}: expected a value that fits in int64, [-2**63, 2**63 - 1]")


def check_finite_real(name: str, value: Any) -> None:
    """``value`` of the option or argument ``name`` is a finite real number (an int or float, not a bool): else
    InputTypeError naming it, its value and what was expected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputTypeError(f"{name}={value!r}: expected a finite real number")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def config_from_keywords(caller: str, options: dict[str, Any]) -> LCEConfig:
    """``LCEConfig(**options)`` for a public entry point named ``caller``: an unknown keyword is
    reported against that function, with the closest option name, instead of as an error of
    LCEConfig's constructor, which users never call."""
    valid = option_names()
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InputTypeError(f"{caller}() got an unexpected option {name!r}{hint} Valid options: "
                                 f"{', '.join(valid)}")
    return LCEConfig(**options)


# The options as primitives (bool, int, float, str, None), for schemas and cache keys that cannot
# hold tensors or objects: class_weight travels as a tensor argument, process_group by its name,
# accum_dtype as the flag fp32_accumulation. Derived from LCEConfig's fields, so a new option needs
# no other list: the custom ops' signatures (flce.engine.custom_ops) are generated from this one.
_TRAVEL_SEPARATELY = ("class_weight", "process_group")
_SCHEMA_TYPE_OF_ANNOTATION = {"int": "int", "float": "float", "bool": "bool", "str": "str",
                              "float | None": "float?", "int | None": "int?"}
Primitive = bool | int | float | str | None


def _primitive_option_types() -> dict[str, str]:
    types = {}
    for f in fields(LCEConfig):
        if f.name in _TRAVEL_SEPARATELY:
            continue
        if f.name == "accum_dtype":
            types["fp32_accumulation"] = "bool"
        else:
            types[f.name] = _SCHEMA_TYPE_OF_ANNOTATION[f.type]
    return types


# name -> type in a torch.library schema ("float?" may be None).
PRIMITIVE_OPTION_TYPES: dict[str, str] = _primitive_option_types()
PRIMITIVE_OPTION_NAMES = tuple(PRIMITIVE_OPTION_TYPES)
_CASTS = {"int": int, "float": float, "bool": bool, "str": str}


def primitive_options(cfg: LCEConfig) -> dict[str, Primitive]:
    values: dict[str, Primitive] = {}
    for name, kind in PRIMITIVE_OPTION_TYPES.items():
        if name == "fp32_accumulation":
            values[name] = cfg.accum_dtype == torch.float32
        else:
            value = getattr(cfg, name)
            values[name] = None if value is None else _CASTS[kind.rstrip("?")](value)
    return values


def config_from_primitives(options: dict[str, Any], class_weight: torch.Tensor | None = None,
                           process_group: Any = None) -> LCEConfig:
    """The inverse of :func:`primitive_options`; ``options`` may hold other keys, which are ignored.
    Not checked again: the values are :func:`primitive_options`' of a config checked when it was made (the
    compile path's ops and dispatch carry a call's options this way)."""
    values = {name: options[name] for name in PRIMITIVE_OPTION_NAMES}
    fp32 = values.pop("fp32_accumulation")
    return _unchecked({**values, "class_weight": class_weight, "process_group": process_group,
                       "accum_dtype": torch.float32 if fp32 else None})
