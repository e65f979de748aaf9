"""The eager autograd path: a ``torch.autograd.Function`` around the schedules.

Why eager calls keep a Function (and do not go through the custom ops): a deferred TokenChunks plan
can keep forward's logits for backward (one GEMM fewer for the kept rows), and how many rows it keeps
is the plan's choice, made inside the call from the device and the autotune cache, where an op's
output shapes must be known to the compiler beforehand; and the Function scales the in-forward
gradients in place with the backend's ``scale_`` kernel, which skips the pass over V x H when
grad_output is exactly 1 (decided on the device). A backward that retains the graph
(retain_graph=True, create_graph=True, torch.autograd.gradcheck) scales them out of place instead and
keeps them unscaled for the next backward, as torch keeps any retained graph's buffers.
:mod:`flce.engine.custom_ops` says what the compiled path does instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets, grads_in_forward_allowed
from flce.engine.outputs import as_result, flat_outputs, logit_stats_output, shape_outputs
from flce.engine.schedule import run_backward, run_forward
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput


class LCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: EngineCall):
        flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
        wanted = GradTargets(
            hidden=ctx.needs_input_grad[0],
            weight=ctx.needs_input_grad[1],
            bias=bias is not None and ctx.needs_input_grad[2],
        )
        in_forward = wanted.any and grads_in_forward_allowed(call.cfg)
        state = run_forward(call, flat, grads_in_forward=wanted if in_forward else None, backward_follows=wanted.any)
        ctx.call, ctx.state, ctx.wanted, ctx.in_forward = call, state, wanted, in_forward
        if not in_forward and wanted.any:
            ctx.save_for_backward(hidden, weight, bias, target)
        outputs = shape_outputs(flat_outputs(state, call.cfg, hidden), call.cfg, call.token_shape)
        logit_stats = logit_stats_output(state, call.cfg, hidden, call.token_shape)
        ctx.mark_non_differentiable(outputs[1], outputs[2], outputs[3], logit_stats)
        return (*outputs, logit_stats)

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss, _grad_acc, _grad_pred, grad_logprobs, grad_entropy, _grad_stats):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grads = LCEFunction._gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
        return (*first_order_only(grads, create_graph), None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, grad_logprobs, grad_entropy):
        call, state = ctx.call, ctx.state
        if ctx.in_forward:
            grad_hidden, grad_weight, grad_bias = _scaled_in_forward_gradients(call, state, grad_loss.reshape(()))
        else:
            hidden, weight, bias, target = ctx.saved_tensors
            flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
            grad_hidden, grad_weight, grad_bias = run_backward(
                call, flat, state, ctx.wanted, grad_loss, grad_logprobs if call.cfg.return_logprobs else None,
                grad_entropy if call.cfg.return_entropy else None,
            )
        if call.sharding is not None and grad_hidden is not None and grad_hidden.numel():
            call.sharding.reduce_grad_hidden(grad_hidden)
        return grad_hidden, grad_weight, grad_bias


def graph_retained() -> bool:
    """Whether the running backward keeps the graph for another (retain_graph=True, or create_graph).
    torch >= 2.5 says so; on older torch this reads False, and a second backward is refused."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and keep_graph()


def _scaled_in_forward_gradients(call: EngineCall, state: ForwardState, scale: Tensor) -> Grads:
    """grad_output times the gradients forward computed. The usual backward (one, graph freed) scales
    them in place and hands them out; one that retains the graph multiplies out of place and leaves
    them unscaled for the next."""
    if state.grads is None:
        raise RuntimeError(
            "flce: trying to backward through this loss a second time, after a backward that did not "
            "retain its graph: its gradients, computed in forward, were handed out then. Pass "
            "retain_graph=True to the earlier backward (torch >= 2.5), or call the loss again."
        )
    if graph_retained():
        return tuple(None if g is None else torch.mul(g, scale) for g in state.grads)
    grads, state.grads = state.grads, None
    return tuple(None if g is None else call.kernels.scale_(g, scale) for g in grads)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes a gradient through, and refuses to be differentiated: what flce's backward returns
    under create_graph=True, so that differentiating a gradient fails with a message saying why."""

    @staticmethod
    def forward(ctx, grad, _anchor):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError(
            "flce: the gradients of linear cross-entropy are first-order only: flce computes them with "
            "its own kernels, which have no derivative themselves, so a double backward (differentiating "
            "a gradient taken with create_graph=True) is not supported"
        )


def first_order_only(grads: tuple[Tensor | None, ...], create_graph: bool) -> tuple[Tensor | None, ...]:
    """Under create_graph=True, each gradient as a tensor whose own backward raises; else unchanged.
    The anchor is a leaf that requires grad, so the wrapped gradients require grad even though
    nothing in flce's backward builds a graph."""
    if not create_graph:
        return grads
    anchor = torch.zeros((), requires_grad=True)
    return tuple(None if g is None else _FirstOrderOnly.apply(g, anchor) for g in grads)


def needs_autograd(flat: FlatInputs) -> bool:
    """Whether a backward can follow: grad mode on and an input that requires grad.
    (ctx.needs_input_grad does not see torch.no_grad(), so this is decided before apply.)"""
    tensors = (flat.hidden, flat.weight, flat.bias)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def apply_eager(flat: FlatInputs, call: EngineCall) -> Tensor | LCEOutput:
    """Run the Function and return the loss, or an LCEOutput when extras were asked."""
    if needs_autograd(flat):
        *outputs, logit_stats = LCEFunction.apply(flat.hidden, flat.weight, flat.bias, flat.target, call)
    else:
        # Inference (no_grad, evaluation, RL log-probs): the statistics alone, nothing kept.
        state = run_forward(call, flat, grads_in_forward=None, backward_follows=False)
        outputs = shape_outputs(flat_outputs(state, call.cfg, flat.hidden), call.cfg, call.token_shape)
        logit_stats = logit_stats_output(state, call.cfg, flat.hidden, call.token_shape)
    return as_result(tuple(outputs), call.cfg, logit_stats)
