"""What the tuner may try for each backend and loss: its candidate knobs, registered by the backend.

A backend makes itself tunable with one call per loss it tunes, at import time (its ``__init__.py``)::

    from flce.autotune import TuningSpace, register_tuning_space
    register_tuning_space(TuningSpace("cuda", candidates=my_candidates, working_bytes=my_working_bytes))
    register_tuning_space(TuningSpace("cuda", kind="distillation", candidates=my_distillation_candidates))

A space serves one loss kind (:data:`LOSS_KINDS`): the cross-entropy's variants (plain, full) share one, linear
distillation's entries (variant "distillation") have their own, since their knobs, planners and memory differ.
The tuner looks the space up once per shape, by (backend, :func:`loss_kind` of the shape's variant).

``candidates(shape, quick)`` lists params mappings (the knobs its planner reads back through
:func:`flce.autotune.tuned_params`), and ``budget_candidates(shape, budget)`` those sized to an
explicit memory budget; ``working_bytes(shape, params)`` estimates the memory a
candidate uses beyond inputs and gradients, so ``--memory-budget`` skips candidates before running
them and CPU runs can report a peak; ``heuristic(shape)`` says which knob values the planner picks
with nothing cached, so an entry where the heuristic measured best still states the configuration
that ran (and keeps it when a later flce changes the heuristic).

Nothing here imports a backend: each backend's package registers its own spaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from flce.autotune.schema import CROSS_ENTROPY_VARIANTS, DISTILLATION_VARIANT, VARIANT_NAMES, Scalar
from flce.inputs import FlatInputs

Params = dict[str, Scalar]

# The losses a backend tunes apart, each in its own space, and the kind of each cache variant.
CROSS_ENTROPY = "cross_entropy"
DISTILLATION = "distillation"
LOSS_KINDS = (CROSS_ENTROPY, DISTILLATION)
_KIND_OF_VARIANT = {**dict.fromkeys(CROSS_ENTROPY_VARIANTS, CROSS_ENTROPY), DISTILLATION_VARIANT: DISTILLATION}


def loss_kind(variant: str) -> str:
    """The loss a cache variant tunes: cross-entropy for plain and full, distillation for distillation."""
    if variant not in _KIND_OF_VARIANT:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANT_NAMES}")
    return _KIND_OF_VARIANT[variant]


@dataclass(frozen=True)
class TuneShape:
    """One shape the tuner measures."""

    device: torch.device
    dtype: torch.dtype
    hidden: int
    vocab: int
    tokens: int
    variant: str

    @property
    def kind(self) -> str:
        """The loss the shape's variant tunes (:func:`loss_kind`)."""
        return loss_kind(self.variant)

    def stand_in_inputs(self) -> FlatInputs:
        """Inputs of this shape, device and dtype that allocate nothing (broadcast views of one
        element), for planners asked what they would do at this shape."""
        def view(*size: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.empty((), dtype=dtype, device=self.device).expand(*size)

        return FlatInputs(hidden=view(self.tokens, self.hidden), weight=view(self.vocab, self.hidden),
                          target=view(self.tokens, dtype=torch.int64), bias=None,
                          token_shape=torch.Size([self.tokens]))


@dataclass(frozen=True)
class TuningSpace:
    """What the tuner may try for one backend and one loss kind, and what it knows of the planner's choice."""

    backend: str
    candidates: Callable[[TuneShape, bool], list[Params]]
    # The loss the space tunes (LOSS_KINDS): the shapes of its variants, and no others, reach its callbacks.
    kind: str = field(default=CROSS_ENTROPY, kw_only=True)
    working_bytes: Callable[[TuneShape, Mapping[str, Scalar]], int] | None = None
    # False for a planner that ignores logits_save_limit_bytes: the tuner skips measuring it.
    tunes_logits_save_limit: bool = True
    # Knob overlays that only forward-only calls (no gradient: evaluation, RL log-probs) exercise,
    # each timed on such a call with the chosen params; the fastest is stored. The first is the
    # baseline, kept unless another beats it by the noise margin.
    inference_overlays: tuple[Params, ...] = ()
    # The knobs the planner picks with nothing cached (the tuner calls it under
    # override_params(None)); None: the entry of a winning heuristic holds empty params.
    heuristic: Callable[[TuneShape], Params] | None = None
    # Candidates sized to an explicit --memory-budget (bytes): schedules that only a small budget
    # makes worth timing, e.g. the largest blocks or chunks that fit it. Called only with a budget.
    budget_candidates: Callable[[TuneShape, int], list[Params]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {LOSS_KINDS}")
        # Distillation's planners keep no logits and its calls have no forward-only path to choose: a space that
        # asked for either would time knobs no distillation call reads.
        if self.kind == DISTILLATION and (self.tunes_logits_save_limit or self.inference_overlays):
            raise ValueError(f"backend={self.backend!r}, kind={self.kind!r}: tunes_logits_save_limit="
                             f"{self.tunes_logits_save_limit!r} and inference_overlays={self.inference_overlays!r}: "
                             "expected False and () (distillation's planners keep no logits)")


_spaces: dict[tuple[str, str], TuningSpace] = {}


def register_tuning_space(space: TuningSpace, *, replace: bool = False) -> None:
    """Make a backend tunable for the space's loss; re-registering a (backend, kind)'s space needs replace=True."""
    if (space.backend, space.kind) in _spaces and not replace:
        raise ValueError(f"a {space.kind} tuning space for backend {space.backend!r} is already registered; "
                         "pass replace=True to override it")
    _spaces[space.backend, space.kind] = space


def tuning_space(backend: str, kind: str = CROSS_ENTROPY) -> TuningSpace | None:
    """The backend's space for the loss ``kind`` (LOSS_KINDS), or None where it registered none."""
    return _spaces.get((backend, kind))


def tuning_spaces(backend: str, variants: Iterable[str]) -> dict[str, TuningSpace]:
    """The backend's space for each loss the variants tune, keyed by kind; a ValueError naming the variant
    whose loss the backend registered no space for."""
    spaces: dict[str, TuningSpace] = {}
    for variant in variants:
        kind = loss_kind(variant)
        space = tuning_space(backend, kind)
        if space is None:
            tuned = sorted(k for b, k in _spaces if b == backend)
            raise ValueError(f"variant={variant!r}: backend {backend!r} has no {kind} tuning space registered "
                             f"(it tunes: {tuned})")
        spaces[kind] = space
    return spaces


def tunable_backends() -> list[str]:
    return sorted({backend for backend, _ in _spaces})


def chunk_candidates(tokens: int, quick: bool, smallest: int = 64) -> list[int]:
    """Token-chunk sizes: powers of two from ``smallest`` below ``tokens``, and ``tokens`` itself
    (one chunk). ``quick`` keeps about three of them, spread over the range."""
    sizes = [1 << k for k in range(max(smallest, 1).bit_length() - 1, 40) if (1 << k) < tokens]
    sizes.append(max(tokens, 1))
    if quick and len(sizes) > 3:
        step = (len(sizes) - 1) / 2
        sizes = sorted({sizes[round(i * step)] for i in range(3)})
    return sizes

