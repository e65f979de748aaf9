"""The compile path of a distillation call: custom ops ``flce::distill_forward`` / ``flce::distill_backward``.

As cross-entropy's (flce.engine.custom_ops): while ``torch.compile`` traces a call it runs as these ops, so
the compiler sees one opaque node per direction and the graph does not break. Their schema holds tensors
and primitives only (the backend's name, the process group's name, which inputs take gradients, the
options); inside, the op plans the call exactly as an eager call does and runs the same schedule. The
in-forward gradients are scaled out of place in backward (AOTAutograd donates their buffers to the
result); reduction "none" keeps the rows' statistics ([k, N]) and its backward op recomputes the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from flce.distillation.config import PRIMITIVE_OPTION_TYPES, DistillationConfig, config_from_primitives
from flce.distillation.config import primitive_options as distillation_primitives
from flce.distillation.inputs import FlatPair
from flce.distillation.semantics import stats_present
from flce.engine.call import GradTargets
from flce.engine.distillation import schedule
from flce.engine.distillation.call import DistillCall, PairGradTargets
from flce.engine.distillation.function import grads_in_forward, wanted_gradients
from flce.engine.plans import PlanRequest
from flce.inputs import _check_target_range
from flce.registry.selection import backend_named
from flce.semantics import statistics_dtype

_c10d = torch.ops._c10d_functional
_GRAD_FLAGS = ("grad_student_hidden", "grad_student_weight", "grad_student_bias", "grad_teacher_hidden",
               "grad_teacher_weight", "grad_teacher_bias")
_KEYWORDS = ("str backend, str? group_name, " + ", ".join(f"bool {flag}" for flag in _GRAD_FLAGS) + ", "
             + ", ".join(f"{kind} {name}" for name, kind in PRIMITIVE_OPTION_TYPES.items()))
_INPUTS = ("Tensor student_hidden, Tensor student_weight, Tensor? student_bias, Tensor teacher_hidden, "
           "Tensor teacher_weight, Tensor? teacher_bias, Tensor? target")
# Outputs: the loss ([] or [N]), the counted rows (the mean's divisor), six in-forward gradients (empty where
# not computed in forward), the rows' statistics [k, N] a deferred backward reads (empty otherwise), the student's
# entropy [N] (return_entropy; empty otherwise).
_FORWARD_SCHEMA = f"({_INPUTS}, *, {_KEYWORDS}) -> ({', '.join(['Tensor'] * 10)})"
_BACKWARD_SCHEMA = f"({_INPUTS}, Tensor count, Tensor stats, Tensor grad_loss, *, {_KEYWORDS}) -> " \
                   f"({', '.join(['Tensor'] * 6)})"
_GRADS = slice(2, 8)

# (pair, cfg with the process group, backend, training) -> the vocab-parallel DistillCall (flce.distributed).
ShardedDistillFn = Callable[[FlatPair, DistillationConfig, object, bool], DistillCall]
_sharded_call: ShardedDistillFn | None = None


def register_sharded_distillation(fn: ShardedDistillFn) -> None:
    """flce.distributed's hook: how an op rebuilds a vocab-parallel call from its group name."""
    global _sharded_call
    _sharded_call = fn


def _wanted(kw: dict, student_bias: Tensor | None, teacher_bias: Tensor | None) -> PairGradTargets:
    return PairGradTargets(
        student=GradTargets(kw["grad_student_hidden"], kw["grad_student_weight"],
                            kw["grad_student_bias"] and student_bias is not None),
        teacher=GradTargets(kw["grad_teacher_hidden"], kw["grad_teacher_weight"],
                            kw["grad_teacher_bias"] and teacher_bias is not None))


def _call(pair: FlatPair, kw: dict, training: bool) -> DistillCall:
    backend = backend_named(kw["backend"])
    if kw["group_name"] is None:
        return backend.plan_distillation(pair, config_from_primitives(kw), PlanRequest(training=training))
    if _sharded_call is None:
        raise RuntimeError("flce: a vocab-parallel distillation op ran before flce.distributed was imported")
    group = torch.distributed.distributed_c10d._resolve_process_group(kw["group_name"])
    return _sharded_call(pair, config_from_primitives(kw, group), backend, training)


def _flat(tensors: tuple) -> FlatPair:
    return FlatPair(*tensors, token_shape=tensors[0].shape[:1])


def _distill_forward(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None,
                     teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
                     target: Tensor | None, **kw: object) -> tuple[Tensor, ...]:
    pair = _flat((student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target))
    if kw["group_name"] is None and target is not None:
        # prepare_pair leaves this check to the op while torch.compile traces (it needs the values): CPU targets
        # here, accelerator targets in the schedule's count of them; a vocab-parallel call checks against the
        # global vocabulary instead.
        _check_target_range(target, student_weight.shape[0], kw["ignore_index"], sharded=False)
    wanted = _wanted(kw, student_bias, teacher_bias)
    call = _call(pair, kw, wanted.any)
    in_forward = grads_in_forward(call, wanted)
    state = schedule.forward(call, pair, wanted if in_forward else None, keep_stats=wanted.any and not in_forward)
    grads = (*state.grads[0], *state.grads[1]) if in_forward else (None,) * 6
    stats = state.stats
    if stats is None:  # nothing kept: no deferred backward follows, or there are no rows
        rows = len(stats_present(call.cfg)) if wanted.any and not in_forward else 0
        stats = student_hidden.new_empty((rows, 0) if rows else (0,), dtype=statistics_dtype(student_hidden.dtype))
    entropy = state.entropy if state.entropy is not None else student_hidden.new_empty(0)
    # A fresh empty tensor per absent output: op outputs may not alias one another.
    return (state.loss, state.count, *(student_hidden.new_empty(0) if g is None else g for g in grads), stats,
            entropy)

def _distill_forward_fake(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None,
                          teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
                          target: Tensor | None, **kw: object) -> tuple[Tensor, ...]:
    cfg = config_from_primitives(kw)
    n = student_hidden.shape[0]
    dtype = statistics_dtype(student_hidden.dtype)
    wanted = _wanted(kw, student_bias, teacher_bias)
    in_forward = wanted.any and cfg.reduction != "none"
    asked = (*_asked(wanted.student), *_asked(wanted.teacher))
    likes = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    grads = tuple(torch.empty_like(t) if in_forward and a else student_hidden.new_empty(0)
                  for t, a in zip(likes, asked, strict=True))
    deferred = wanted.any and not in_forward
    stats = student_hidden.new_empty((len(stats_present(cfg)), n) if deferred else (0,), dtype=dtype)
    loss = student_hidden.new_empty((n,) if cfg.reduction == "none" else (), dtype=dtype)
    entropy = student_hidden.new_empty((n,) if cfg.return_entropy else (0,), dtype=dtype)
    return (loss, student_hidden.new_empty((), dtype=dtype), *grads, stats, entropy)


def _asked(targets: GradTargets) -> tuple[bool, bool, bool]:
    return targets.hidden, targets.weight, targets.bias


def _distill_backward(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None,
                      teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
                      target: Tensor | None, count: Tensor, stats: Tensor, grad_loss: Tensor,
                      **kw: object) -> tuple[Tensor, ...]:
    tensors = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    pair = _flat((*tensors, target))
    wanted = _wanted(kw, student_bias, teacher_bias)
    call = _call(pair, kw, True)
    state = schedule.DistillState(loss=count, count=count, stats=stats)
    student, teacher = schedule.backward(call, pair, state, wanted, grad_loss)
    call.complete_grad_hidden_(student[0], teacher[0])
    return tuple(student_hidden.new_empty(0) if g is None else g for g in (*student, *teacher))


def _distill_backward_fake(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None,
                           teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
                           *_rest: Tensor | None, **kw: object) -> tuple[Tensor, ...]:
    wanted = _wanted(kw, student_bias, teacher_bias)
    likes = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    asked = (*_asked(wanted.student), *_asked(wanted.teacher))
    return tuple(torch.empty_like(t) if a else student_hidden.new_empty(0) for t, a in zip(likes, asked, strict=True))


distill_forward = torch.library.custom_op("flce::distill_forward", _distill_forward, mutates_args=(),
                                          schema=_FORWARD_SCHEMA)
distill_forward.register_fake(_distill_forward_fake)
distill_backward = torch.library.custom_op("flce::distill_backward", _distill_backward, mutates_args=(),
                                           schema=_BACKWARD_SCHEMA)
distill_backward.register_fake(_distill_backward_fake)


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    kw = keyword_only_inputs
    cfg = config_from_primitives(kw)
    ctx.kw = kw
    ctx.wanted = _wanted(kw, inputs[2], inputs[5])
    ctx.in_forward = ctx.wanted.any and cfg.reduction != "none"
    if ctx.in_forward:
        ctx.save_for_backward(*output[_GRADS])
    elif ctx.wanted.any:
        ctx.save_for_backward(*inputs, output[1], output[8])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *_unused):
    wanted = ctx.wanted
    asked = (*_asked(wanted.student), *_asked(wanted.teacher))
    if not wanted.any:
        return (None,) * 7
    if ctx.in_forward:
        saved = ctx.saved_tensors
        scale = (grad_loss if grad_loss is not None else torch.zeros((), device=saved[0].device)).reshape(())
        grads = [(g.to(scale.dtype) * scale).to(g.dtype) if a else None for g, a in zip(saved, asked, strict=True)]
        group_name = ctx.kw["group_name"]
        if group_name is not None:
            # Each rank's grad_hidden covers its vocabulary shard: a functional all-reduce completes it, so
            # that the compiled backward graph holds the collective.
            for position in (0, 3):
                if grads[position] is not None:
                    grads[position] = _c10d.wait_tensor(_c10d.all_reduce(grads[position], "sum", group_name))
    else:
        *tensors, count, stats = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros_like(count)
        results = torch.ops.flce.distill_backward(*tensors, count, stats, grad_loss, **ctx.kw)
        grads = [g if a else None for g, a in zip(results, asked, strict=True)]
    return (*grads, None)


distill_forward.register_autograd(_backward, setup_context=_setup_context)


def apply_op(backend: str, pair: FlatPair, cfg: DistillationConfig) -> Tensor | tuple[Tensor, Tensor]:
    """The call through the custom ops (what torch.compile sees): the loss (in the call's token shape where
    reduction is "none"), and with return_entropy each token's entropy in that shape."""
    wanted = wanted_gradients(pair, cfg.teacher_grad)
    flags = (*_asked(wanted.student), *_asked(wanted.teacher))
    outputs = torch.ops.flce.distill_forward(
        pair.student_hidden, pair.student_weight, pair.student_bias, pair.teacher_hidden, pair.teacher_weight,
        pair.teacher_bias, pair.target, backend=backend,
        group_name=None if cfg.process_group is None else cfg.process_group.group_name,
        **dict(zip(_GRAD_FLAGS, flags, strict=True)), **distillation_primitives(cfg))
    loss = outputs[0]
    loss = loss.reshape(pair.token_shape) if cfg.reduction == "none" else loss
    return (loss, outputs[9].reshape(pair.token_shape)) if cfg.return_entropy else loss
