"""The reference backend's tuning space: token-chunk sizes, registered with flce.autotune."""

from __future__ import annotations

from collections.abc import Mapping

from flce.autotune.schema import DISTILLATION_VARIANT, Scalar
from flce.autotune.spaces import Params, TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.backends.reference import distillation
from flce.backends.reference.plan import choose, working_bytes_per_row
from flce.config import LCEConfig
from flce.engine.choice import CallDescription, describe_device
from flce.engine.distillation.call import DistillDescription
from flce.engine.plans import PlanRequest


def _candidates(shape: TuneShape, quick: bool) -> list[Params]:
    return [{"tokens_per_chunk": n} for n in chunk_candidates(shape.tokens, quick)]


def _working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # The planner's own per-row figure (it depends on the device), the distillation planner's for its shapes.
    rows = min(int(params.get("tokens_per_chunk") or shape.tokens), shape.tokens)
    if shape.variant == DISTILLATION_VARIANT:
        return rows * distillation.working_bytes_per_row(shape.vocab, shape.dtype)
    return rows * working_bytes_per_row(shape.device.type, shape.vocab, shape.dtype, LCEConfig())


def _heuristic(shape: TuneShape) -> Params:
    # The chunk depends on the memory budget alone, not on the other options: default ones do.
    device = describe_device(shape.device)
    if shape.variant == DISTILLATION_VARIANT:
        desc = DistillDescription.tuned(shape.tokens, shape.hidden, shape.vocab, shape.dtype)
        return {"tokens_per_chunk": distillation.choose_distillation(device, desc).plan.tokens_per_chunk}
    call = CallDescription.of(shape.stand_in_inputs(), LCEConfig(), shape.variant, PlanRequest(training=True))
    return {"tokens_per_chunk": choose(device, call).plan.tokens_per_chunk}


register_tuning_space(TuningSpace("reference", candidates=_candidates, working_bytes=_working_bytes,
                                  heuristic=_heuristic))
