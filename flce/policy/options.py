"""The scalar options of a policy loss: which per-token term, at which importance-sampling level, its bounds and
the KL penalty. One frozen record, validated once, that travels with the call (and, as primitives, through the
compile path's custom ops); :mod:`flce.policy.semantics` gives it meaning.

The front-ends build it from their own vocabularies: ``flce.linear_policy_loss`` from TRL's GRPOTrainer arguments
(``loss_type``, ``epsilon_low``, ...), the verl and AReaL adapters from those trainers' configurations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# The per-token term of the loss as a function of the importance ratio r (semantics.py states each):
# "clip": PPO's clipped surrogate -min(min(r, delta) A, clamp(r, ratio_low, ratio_high) A);
# "cispo": -sg(clamp(r, ratio_low, ratio_high)) A logp (a bound may be None);
# "sapo": -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_tau_pos where A > 0, else sapo_tau_neg;
# "pg": the plain policy gradient -A logp, no ratio (verl's gpg).
TERMS = ("clip", "cispo", "sapo", "pg")
# Where the ratio's log comes from: each token's log-prob difference; its sequence's masked mean, differentiated
# through the mean (TRL's and Liger's "sequence", GSPO); or that mean as the value with each token's own log-prob
# as the gradient's path (verl's GSPO: log r = logp - sg(logp) + sg(sequence mean)).
LEVELS = ("token", "sequence", "sequence_token")
# The KL estimators of log pi_ref / pi at the token, as J. Schulman's note names them: k1 = logp - ref,
# k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1 (TRL, Liger), low_var_kl = k3 with its argument
# clamped to [-20, 20] and its value to [-10, 10] (verl's "low_var_kl" / "k3"), abs = |logp - ref|.
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")


@dataclass(frozen=True)
class PolicyOptions:
    """A policy loss's scalar options (module docstring); ``None`` bounds are absent."""

    term: str = "clip"
    level: str = "token"
    ratio_low: float | None = 0.8  # clip: 1 - epsilon_low; cispo: the weight's lower bound
    ratio_high: float | None = 1.2  # clip: 1 + epsilon_high; cispo: the weight's cap
    delta: float | None = None  # clip: the upper bound of the unclipped branch (TRL's delta, the dual clip)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    log_ratio_min: float | None = None  # clamp of the log ratio before exp (verl: -20 / 20, its GSPO: max 10)
    log_ratio_max: float | None = None
    beta: float = 0.0  # the KL penalty's coefficient
    kl: str = "k3"
    kl_straight_through: bool = False  # the KL's value from ``kl``, its gradient from k2 (verl's "k3+")

    def __post_init__(self) -> None:
        _check_choice("term", self.term, TERMS)
        _check_choice("level", self.level, LEVELS)
        _check_choice("kl", self.kl, KL_ESTIMATORS)
        for name in ("ratio_low", "ratio_high", "delta", "log_ratio_min", "log_ratio_max"):
            value = getattr(self, name)
            if value is not None:
                _check_real(name, value)
        for name in ("sapo_tau_pos", "sapo_tau_neg", "beta"):
            _check_real(name, getattr(self, name))
        if not isinstance(self.kl_straight_through, bool):
            raise TypeError(f"kl_straight_through={self.kl_straight_through!r}: expected a bool")
        if self.term == "clip" and (self.ratio_low is None or self.ratio_high is None):
            raise ValueError(f"ratio_low={self.ratio_low}, ratio_high={self.ratio_high}: the clipped term needs both "
                             "bounds")
        if self.term == "cispo" and self.ratio_high is None:
            raise ValueError("ratio_high=None: the cispo term needs its cap")
        if self.ratio_low is not None and self.ratio_high is not None and self.ratio_low > self.ratio_high:
            raise ValueError(f"ratio_low={self.ratio_low} > ratio_high={self.ratio_high}: expected low <= high")
        if self.term == "sapo" and not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"sapo_tau_pos={self.sapo_tau_pos}, sapo_tau_neg={self.sapo_tau_neg}: expected both > 0")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta}: expected a value >= 0")

    @property
    def ratio_per_sequence(self) -> bool:
        """Whether the importance ratio is each sequence's (the sequence levels): a token's loss and gradient then
        need every log-prob of its sequence."""
        return self.level != "token"


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {allowed}")


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name}={value!r}: expected a real number")


# The record as primitives for the compile path's custom op schema (flce.engine.custom_ops), by field. The
# names are computed once: torch.compile traces the functions below, and cannot trace dataclasses.fields.
_SCHEMA_TYPES = {"str": "str", "float": "float", "float | None": "float?", "bool": "bool"}
POLICY_OPTION_TYPES: dict[str, str] = {f"policy_{f.name}": _SCHEMA_TYPES[f.type] for f in fields(PolicyOptions)}
_NAMES = tuple(f.name for f in fields(PolicyOptions))
_DEFAULTS = PolicyOptions()


def _schema_literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


# The schema's keyword declarations, each defaulting to PolicyOptions' default (a cross-entropy call omits them).
POLICY_SCHEMA_KEYWORDS = tuple(f"{kind} {name}={_schema_literal(getattr(_DEFAULTS, name.removeprefix('policy_')))}"
                               for name, kind in POLICY_OPTION_TYPES.items())


def policy_primitives(options: PolicyOptions | None) -> dict[str, Any]:
    """The custom ops' keywords for ``options``; a call without one passes the defaults (its op ignores them)."""
    options = options or _DEFAULTS
    return {f"policy_{name}": getattr(options, name) for name in _NAMES}


def options_from_primitives(primitives: dict[str, Any]) -> PolicyOptions:
    """The inverse of :func:`policy_primitives` (other keys ignored; a value left out is its default, as a traced
    call of the op omits the keywords that equal their schema defaults); checked when the original was made."""
    options = object.__new__(PolicyOptions)
    for name in _NAMES:
        object.__setattr__(options, name, primitives.get(f"policy_{name}", getattr(_DEFAULTS, name)))
    return options
