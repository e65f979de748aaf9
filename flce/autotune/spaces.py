"""What the tuner may try for each backend: its candidate knobs, registered by the backend.

A backend makes itself tunable with one call at import time (its ``__init__.py``)::

    from flce.autotune import TuningSpace, register_tuning_space
    register_tuning_space(TuningSpace("cuda", candidates=my_candidates, working_bytes=my_working_bytes))

``candidates(shape, quick)`` lists params mappings (the knobs its planner reads back through
:func:`flce.autotune.tuned_params`); ``working_bytes(shape, params)`` estimates the memory a
candidate uses beyond inputs and gradients, so ``--memory-budget`` skips candidates before running
them and CPU runs can report a peak. The reference backend's space is defined here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from flce.autotune.schema import Scalar

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


def _reference_candidates(shape: TuneShape, quick: bool) -> list[Params]:
    return [{"tokens_per_chunk": n} for n in chunk_candidates(shape.tokens, quick)]


def _reference_working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # The reference planner's own per-row figure (it depends on the device), fed tensors of the
    # right device, dtype and shape that allocate nothing: no rows, and a broadcast weight.
    from flce.backends.reference.ops import working_bytes_per_row
    from flce.inputs import FlatInputs

    flat = FlatInputs(
        hidden=torch.empty(0, shape.hidden, dtype=shape.dtype, device=shape.device),
        weight=torch.empty((), dtype=shape.dtype, device=shape.device).expand(shape.vocab, shape.hidden),
        target=torch.empty(0, dtype=torch.int64, device=shape.device), bias=None, token_shape=torch.Size([0]),
    )
    rows = min(int(params.get("tokens_per_chunk") or shape.tokens), shape.tokens)
    return rows * working_bytes_per_row(flat)


register_tuning_space(TuningSpace("reference", candidates=_reference_candidates,
                                  working_bytes=_reference_working_bytes))
