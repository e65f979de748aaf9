"""The eager autograd path of a distillation call: a ``torch.autograd.Function`` around its schedule.

Gradients computed in forward (reduction "mean" / "sum") are scaled by grad_output in backward, in place
by the backend's ``scale_`` (which skips the pass where grad_output is exactly 1), or out of place where
the backward retains the graph; reduction "none" runs the deferred backward. A batched or transformed backward
(is_grads_batched, torch.func) takes flce.engine.distillation.transformed's out-of-place path. Second derivatives
are refused, as cross-entropy's are (flce.engine.function.first_order_only, and
flce.engine.transformed.check_first_order for nested torch.func transforms).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from flce.distillation.inputs import FlatPair
from flce.engine.call import GradTargets
from flce.engine.distillation import schedule
from flce.engine.distillation import transformed as transformed_path
from flce.engine.distillation.call import DistillCall, PairGradTargets
from flce.engine.function import first_order_anchors, first_order_only, graph_retained
from flce.engine.transformed import check_first_order, check_unsharded, is_transformed


class _Handoff:
    """Forward's state on its way to setup_context (a plain object, passed through as it is)."""

    state: schedule.DistillState
    in_forward: bool
    anchors: tuple[Tensor, ...]


def grads_in_forward(call: DistillCall, wanted: PairGradTargets) -> bool:
    """A scalar loss as the only output: the gradients are formed in forward."""
    return wanted.any and call.cfg.reduction != "none"


def _pair(tensors: tuple, call: DistillCall) -> FlatPair:
    student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target = tensors
    return FlatPair(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                    target, call.token_shape)


def shaped_loss(loss: Tensor, call: DistillCall) -> Tensor:
    return loss.reshape(call.token_shape) if call.cfg.reduction == "none" else loss


def call_outputs(loss: Tensor, entropy: Tensor | None, call: DistillCall) -> Tensor | tuple[Tensor, Tensor]:
    """What a call returns: its loss, and with return_entropy each token's entropy in the tokens' shape."""
    if not call.cfg.return_entropy:
        return shaped_loss(loss, call)
    return shaped_loss(loss, call), entropy.reshape(call.token_shape)


class DistillFunction(torch.autograd.Function):
    """Forward runs the schedule; ``wanted`` says which inputs get gradients (decided before apply, from
    requires_grad and teacher_grad), ``handoff`` carries forward's state to setup_context."""

    @staticmethod
    def forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
                call: DistillCall, wanted: PairGradTargets, handoff: _Handoff):
        tensors = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target)
        in_forward = grads_in_forward(call, wanted)
        state = schedule.forward(call, _pair(tensors, call), wanted if in_forward else None,
                                 keep_stats=wanted.any and not in_forward)
        handoff.state, handoff.in_forward = state, in_forward
        return call_outputs(state.loss, state.entropy, call)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, call, wanted, handoff = inputs
        ctx.call, ctx.wanted, ctx.anchors = call, wanted, handoff.anchors
        # The state without the returned loss itself: ctx -> state -> output -> ctx would be a reference cycle,
        # which keeps the graph (its saved gradients, the leaves' AccumulateGrad nodes on forward's stream) alive
        # until Python's collector runs; CUDA-graph capture fails on such a node from an earlier step.
        ctx.in_forward, ctx.state = handoff.in_forward, dataclasses.replace(handoff.state, entropy=None,
                                                                            loss=handoff.state.loss.detach())
        if not ctx.in_forward and wanted.any:
            ctx.save_for_backward(*tensors)
        if call.cfg.return_entropy:
            ctx.mark_non_differentiable(output[1])  # a metric: no gradient
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_loss, *_no_entropy_gradient):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grads = _gradients(ctx, grad_loss)
        return (*first_order_only(grads, create_graph, ctx.anchors), None, None, None, None)


def _gradients(ctx, grad_loss: Tensor | None) -> tuple[Tensor | None, ...]:
    call, state = ctx.call, ctx.state
    if grad_loss is None:
        grad_loss = torch.zeros_like(state.loss)
    transformed = is_transformed(grad_loss)
    if transformed:
        check_unsharded(call)
    if ctx.in_forward:
        student, teacher = _scaled(call, state, grad_loss.reshape(()), transformed)
    else:
        pair = _pair(ctx.saved_tensors, call)
        deferred_backward = transformed_path.backward if transformed else schedule.backward
        student, teacher = deferred_backward(call, pair, state, ctx.wanted, grad_loss)
    call.complete_grad_hidden_(student[0], teacher[0])
    return (*student, *teacher, None)


def _scaled(call: DistillCall, state: schedule.DistillState, scale: Tensor, transformed: bool):
    """grad_output times the gradients forward computed: in place, or out of place where this backward retains
    the graph (kept unscaled for the next backward) or is batched / transformed."""
    if state.grads is None:
        raise RuntimeError(
            "flce: trying to backward through this distillation loss a second time, after a backward that did "
            "not retain its graph: its gradients, computed in forward, were handed out then. Pass "
            "retain_graph=True to the earlier backward, or call the loss again.")
    retained = graph_retained()
    if retained or transformed:
        grads = transformed_path.scaled_grads(state.grads, scale)
        if not retained:
            state.grads = None
        return grads
    grads, state.grads = state.grads, None
    return tuple(tuple(None if g is None else call.kernels.scale_(g, scale) for g in part) for part in grads)


def wanted_gradients(pair: FlatPair, teacher_grad: bool) -> PairGradTargets:
    """Which inputs get gradients: those that require grad, the teacher's only where teacher_grad asks; none
    outside grad mode."""
    enabled = torch.is_grad_enabled()

    def asks(t: Tensor | None, teacher: bool = False) -> bool:
        return enabled and t is not None and t.requires_grad and (teacher_grad or not teacher)

    return PairGradTargets(
        student=GradTargets(asks(pair.student_hidden), asks(pair.student_weight), asks(pair.student_bias)),
        teacher=GradTargets(asks(pair.teacher_hidden, True), asks(pair.teacher_weight, True),
                            asks(pair.teacher_bias, True)))


def apply_eager(pair: FlatPair, call: DistillCall) -> Tensor | tuple[Tensor, Tensor]:
    """Run the Function (or, where no gradient follows, the forward alone) and return call_outputs'."""
    wanted = wanted_gradients(pair, call.cfg.teacher_grad)
    tensors = (pair.student_hidden, pair.student_weight, pair.student_bias, pair.teacher_hidden, pair.teacher_weight,
               pair.teacher_bias, pair.target)
    if not wanted.any:
        state = schedule.forward(call, pair, None, keep_stats=False)
        return call_outputs(state.loss, state.entropy, call)
    handoff = _Handoff()
    differentiated = tensors[:3] + (tensors[3:6] if call.cfg.teacher_grad else (None, None, None))
    check_first_order(differentiated)
    handoff.anchors = first_order_anchors(differentiated)
    # The teacher's tensors enter detached unless teacher_grad: autograd then gives them no gradient.
    if not call.cfg.teacher_grad:
        tensors = tensors[:3] + tuple(None if t is None else t.detach() for t in tensors[3:6]) + tensors[6:]
    return DistillFunction.apply(*tensors, call, wanted, handoff)
