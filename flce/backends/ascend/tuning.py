"""The Ascend backend's tuning space (flce-autotune on an NPU): token-chunk sizes, the one knob its
planner reads from the cache besides the logits-save limit."""

from __future__ import annotations

from collections.abc import Mapping

from flce.autotune.devices import device_name
from flce.autotune.schema import DISTILLATION_VARIANT, Scalar
from flce.autotune.spaces import Params, TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.backends.ascend.ops import device_properties
from flce.backends.ascend.plan import choose
from flce.config import LCEConfig
from flce.engine.choice import CallDescription, DeviceDescription
from flce.engine.distillation.call import DistillDescription, pair_logits_bytes_per_row
from flce.engine.plans import PlanRequest


def _candidates(shape: TuneShape, quick: bool) -> list[Params]:
    return [{"tokens_per_chunk": n} for n in chunk_candidates(shape.tokens, quick)]


def _working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # The vector kernels overwrite each chunk's logits in place: a row costs its logits alone (distillation's:
    # both heads').
    rows = min(int(params.get("tokens_per_chunk") or shape.tokens), shape.tokens)
    if shape.variant == DISTILLATION_VARIANT:
        return rows * pair_logits_bytes_per_row(shape.vocab, shape.dtype)
    return rows * shape.vocab * shape.dtype.itemsize


def _heuristic(shape: TuneShape) -> Params:
    props = device_properties(shape.device)
    device = DeviceDescription(type=shape.device.type, name=device_name(shape.device),
                               total_memory=props.total_memory_bytes, multiprocessors=props.vector_cores)
    if shape.variant == DISTILLATION_VARIANT:
        from flce.backends.ascend.distill_ops import choose_distillation

        desc = DistillDescription.tuned(shape.tokens, shape.hidden, shape.vocab, shape.dtype)
        return {"tokens_per_chunk": choose_distillation(device, desc, props=props).plan.tokens_per_chunk}
    call = CallDescription.of(shape.stand_in_inputs(), LCEConfig(), shape.variant, PlanRequest(training=True))
    return {"tokens_per_chunk": choose(device, call, props=props).plan.tokens_per_chunk}


register_tuning_space(TuningSpace("ascend", candidates=_candidates, working_bytes=_working_bytes,
                                  heuristic=_heuristic))
