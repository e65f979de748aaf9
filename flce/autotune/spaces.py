"""What the tuner may try for each backend: its candidate knobs, registered by the backend.

A backend makes itself tunable with one call at import time (its ``__init__.py``)::

    from flce.autotune import TuningSpace, register_tuning_space
    register_tuning_space(TuningSpace("cuda", candidates=my_candidates, working_bytes=my_working_bytes))

``candidates(shape, quick)`` lists params mappings (the knobs its planner reads back through
:func:`flce.autotune.tuned_params`), and ``budget_candidates(shape, budget)`` those sized to an
explicit memory budget; ``working_bytes(shape, params)`` estimates the memory a
candidate uses beyond inputs and gradients, so ``--memory-budget`` skips candidates before running
them and CPU runs can report a peak; ``heuristic(shape)`` says which knob values the planner picks
with nothing cached, so an entry where the heuristic measured best still states the configuration
that ran (and keeps it when a later flce changes the heuristic).

Nothing here imports a backend: each backend's package registers its own space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from flce.autotune.schema import DISTILLATION_VARIANT, Scalar
from flce.inputs import FlatInputs

Params = dict[str, Scalar]


@dataclass(frozen=True)
class TuneShape:
    """One shape the tuner measures."""

    device: torch.device
    dtype: torch.dtype
    hidden: int
    vocab: int
    tokens: int
    variant: str

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
    backend: str
    candidates: Callable[[TuneShape, bool], list[Params]]
    working_bytes: Callable[[TuneShape, Mapping[str, Scalar]], int] | None = None
    # False for a backend whose planner ignores logits_save_limit_bytes: the tuner skips measuring it.
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

    def tunes_limit_of(self, shape: TuneShape) -> bool:
        """Whether the tuner measures the shape's logits-save limit: distillation's planners keep no logits."""
        return self.tunes_logits_save_limit and shape.variant != DISTILLATION_VARIANT

    def overlays_of(self, shape: TuneShape) -> tuple[Params, ...]:
        """The shape's forward-only overlays: the cross-entropy's (its statistics GEMMs), none for distillation."""
        return () if shape.variant == DISTILLATION_VARIANT else self.inference_overlays


_spaces: dict[str, TuningSpace] = {}


def register_tuning_space(space: TuningSpace, *, replace: bool = False) -> None:
    """Make a backend tunable; re-registering a backend's space needs replace=True."""
    if space.backend in _spaces and not replace:
        raise ValueError(f"a tuning space for backend {space.backend!r} is already registered; "
                         "pass replace=True to override it")
    _spaces[space.backend] = space


def tuning_space(backend: str) -> TuningSpace | None:
    return _spaces.get(backend)


def tunable_backends() -> list[str]:
    return sorted(_spaces)


def chunk_candidates(tokens: int, quick: bool, smallest: int = 64) -> list[int]:
    """Token-chunk sizes: powers of two from ``smallest`` below ``tokens``, and ``tokens`` itself
    (one chunk). ``quick`` keeps about three of them, spread over the range."""
    sizes = [1 << k for k in range(max(smallest, 1).bit_length() - 1, 40) if (1 << k) < tokens]
    sizes.append(max(tokens, 1))
    if quick and len(sizes) > 3:
        step = (len(sizes) - 1) / 2
        sizes = sorted({sizes[round(i * step)] for i in range(3)})
    return sizes

