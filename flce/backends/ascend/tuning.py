"""The Ascend backend's tuning spaces (flce-autotune on an NPU): token-chunk sizes, the one knob its
planners read from the cache besides the logits-save limit; one space per loss."""

from __future__ import annotations

from collections.abc import Mapping

from flce.autotune.devices import device_name
from flce.autotune.schema import Scalar
from flce.autotune.spaces import DISTILLATION, Params, TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.backends.ascend.ops import AscendDeviceProperties, device_properties
from flce.backends.ascend.plan import choose
from flce.config import LCEConfig
from flce.engine.choice import CallDescription, DeviceDescription
from flce.engine.distillation.call import DistillDescription, pair_logits_bytes_per_row
from flce.engine.plans import PlanRequest


def _candidates(shape: TuneShape, quick: bool) -> list[Params]:
    return [{"tokens_per_chunk": n} for n in chunk_candidates(shape.tokens, quick)]


def _rows(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    return min(int(params.get("tokens_per_chunk") or shape.tokens), shape.tokens)


def _device(shape: TuneShape) -> tuple[DeviceDescription, AscendDeviceProperties]:
    props = device_properties(shape.device)
    return DeviceDescription(type=shape.device.type, name=device_name(shape.device),
                             total_memory=props.total_memory_bytes, multiprocessors=props.vector_cores), props


def _working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # The vector kernels overwrite each chunk's logits in place: a row costs its logits alone.
    return _rows(shape, params) * shape.vocab * shape.dtype.itemsize


def _heuristic(shape: TuneShape) -> Params:
    device, props = _device(shape)
    call = CallDescription.of(shape.stand_in_inputs(), LCEConfig(), shape.variant, PlanRequest(training=True))
    return {"tokens_per_chunk": choose(device, call, props=props).plan.tokens_per_chunk}


def _distillation_working_bytes(shape: TuneShape, params: Mapping[str, Scalar]) -> int:
    # Both heads' logits, overwritten in place as the cross-entropy's are.
    return _rows(shape, params) * pair_logits_bytes_per_row(shape.vocab, shape.dtype)


def _distillation_heuristic(shape: TuneShape) -> Params:
    from flce.backends.ascend.distill_ops import choose_distillation

    device, props = _device(shape)
    desc = DistillDescription.tuned(shape.tokens, shape.hidden, shape.vocab, shape.dtype)
    return {"tokens_per_chunk": choose_distillation(device, desc, props=props).plan.tokens_per_chunk}


register_tuning_space(TuningSpace("ascend", candidates=_candidates, working_bytes=_working_bytes,
                                  heuristic=_heuristic))
# Distillation's planner keeps no logits: no save limit to measure.
register_tuning_space(TuningSpace("ascend", kind=DISTILLATION, candidates=_candidates,
                                  working_bytes=_distillation_working_bytes, heuristic=_distillation_heuristic,
                                  tunes_logits_save_limit=False))
