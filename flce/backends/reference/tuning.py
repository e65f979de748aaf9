"""The reference backend's tuning spaces: token-chunk sizes, one space per loss, registered with flce.autotune."""

from __future__ import annotations

from collections.abc import Mapping

from flce.autotune.schema import Scalar
from flce.autotune.spaces import DISTILLATION, Params, TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.backends.reference import distillation
from flce.backends.reference.plan import choose, working_bytes_per_row
from flce.config import LCEConfig
from flce.engine.choice import CallDescription, describe_device
from flce.engine.distillation.call import DistillDescription
from flce.engine.plans import PlanRequest


def _candidates(shape: TuneShape, quick: bool) -> list[Params]:
    return [{"tokens_per_chunk": n} for n in chunk_candidates(shape.tokens, quick)]


def _rows(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    return min(int(params.get("tokens_per_chunk") or shape.tokens), shape.tokens)


def _working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # The planner's own per-row figure (it depends on the device).
    return _rows(shape, params) * working_bytes_per_row(shape.device.type, shape.vocab, shape.dtype, LCEConfig())


def _heuristic(shape: TuneShape) -> Params:
    # The chunk depends on the memory budget alone, not on the other options: default ones do.
    call = CallDescription.of(shape.stand_in_inputs(), LCEConfig(), shape.variant, PlanRequest(training=True))
    return {"tokens_per_chunk": choose(describe_device(shape.device), call).plan.tokens_per_chunk}


def _distillation_working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    return _rows(shape, params) * distillation.working_bytes_per_row(shape.vocab, shape.dtype)


def _distillation_heuristic(shape: TuneShape) -> Params:
    desc = DistillDescription.tuned(shape.tokens, shape.hidden, shape.vocab, shape.dtype)
    chosen = distillation.choose_distillation(describe_device(shape.device), desc)
    return {"tokens_per_chunk": chosen.plan.tokens_per_chunk}


register_tuning_space(TuningSpace("reference", candidates=_candidates, working_bytes=_working_bytes,
                                  heuristic=_heuristic))
# Distillation's planner keeps no logits: no save limit to measure.
register_tuning_space(TuningSpace("reference", kind=DISTILLATION, candidates=_candidates,
                                  working_bytes=_distillation_working_bytes, heuristic=_distillation_heuristic,
                                  tunes_logits_save_limit=False))
