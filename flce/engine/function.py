"""The eager autograd path: a ``torch.autograd.Function`` around the schedules.

Why eager calls keep a Function (and do not go through the custom ops): a deferred TokenChunks plan
can keep forward's logits for backward (one GEMM fewer for the kept rows), and how many rows it keeps
is the plan's choice, made inside the call from the device and the autotune cache, where an op's
output shapes must be known to the compiler beforehand; and the Function scales the in-forward
gradients in place with the backend's ``scale_`` kernel, which skips the pass over V x H when
grad_output is exactly 1 (decided on the device). A backward that retains the graph
(retain_graph=True, create_graph=True, torch.autograd.gradcheck) scales them out of place instead and
keeps them unscaled for the next backward, as torch keeps any retained graph's buffers; a batched or
transformed backward (is_grads_batched, torch.func) takes :mod:`flce.engine.transformed`'s out-of-place
path. :mod:`flce.engine.custom_ops` says what the compiled path does instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets, grads_in_forward_allowed
from flce.engine.outputs import as_result, flat_outputs, logit_stats_output, shape_outputs
from flce.engine.schedule import run_backward, run_forward
from flce.engine.transformed import backward as transformed_backward
from flce.engine.transformed import check_first_order, check_unsharded, is_transformed, scaled
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.policy.tokens import PolicyTokens


class _Handoff:
    """Forward's state on its way to setup_context: a plain object, which torch.func passes through
    as it is (a list or dict would be rebuilt as a pytree)."""

    state: ForwardState
    in_forward: bool
    anchors: tuple[Tensor, ...]


class LCEFunction(torch.autograd.Function):
    """Forward runs a schedule; ``setup_context`` keeps what backward needs. (The split form, so that
    torch.func transforms can run it: jacrev, vmap over the backward.) ``wanted`` says which inputs
    get gradients (decided before apply, from requires_grad: forward has no ctx to ask), and
    ``handoff`` carries forward's state to setup_context."""

    @staticmethod
    def forward(hidden, weight, bias, target, token_weight, policy: PolicyTokens | None, call: EngineCall,
                wanted: GradTargets, handoff: _Handoff):
        flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape,
                          token_weight=token_weight, policy=policy)
        in_forward = wanted.any and grads_in_forward_allowed(call.cfg)
        state = run_forward(call, flat, grads_in_forward=wanted if in_forward else None, backward_follows=wanted.any)
        handoff.state, handoff.in_forward = state, in_forward
        outputs = shape_outputs(flat_outputs(state, call.cfg, hidden), call.cfg, call.token_shape)
        return (*outputs, logit_stats_output(state, call.cfg, hidden, call.token_shape))

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, bias, target, token_weight, _policy, call, wanted, handoff = inputs
        ctx.state, ctx.in_forward = handoff.state.for_backward(), handoff.in_forward
        ctx.call, ctx.wanted, ctx.anchors = call, wanted, handoff.anchors
        if not ctx.in_forward and wanted.any:
            ctx.save_for_backward(hidden, weight, bias, target, token_weight)
        # One call: each call of mark_non_differentiable replaces the last one's outputs.
        detached = (output[4], output[5]) if call.cfg.detach_extras else ()
        ctx.mark_non_differentiable(output[1], output[2], output[3], output[6], *detached)
        # Outputs that took no part in what is differentiated reach backward as None instead of zeros
        # autograd would make (six tensors a training call, a good part of its backward's host time).
        ctx.set_materialize_grads(False)
        ctx.loss_like = (output[0].shape, output[0].dtype, output[0].device)

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss, _grad_acc, _grad_pred, grad_logprobs, grad_entropy, _grad_stats):
        create_graph = torch.is_grad_enabled()
        if grad_loss is None:  # only the log-probs or the entropy are differentiated
            shape, dtype, device = ctx.loss_like
            grad_loss = torch.zeros(shape, dtype=dtype, device=device)
        with torch.no_grad():
            grads = _gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
        return (*first_order_only(grads, create_graph, ctx.anchors), None, None, None, None, None, None)


def graph_retained() -> bool:
    """Whether the running backward keeps the graph for another (retain_graph=True, or create_graph).
    torch >= 2.5 says so; on older torch this reads False, and a second backward is refused."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and keep_graph()


def _gradients(ctx, grad_loss, grad_logprobs, grad_entropy):
    call, state = ctx.call, ctx.state
    transformed = any(is_transformed(g) for g in (grad_loss, grad_logprobs, grad_entropy))
    if transformed:
        check_unsharded(call)
    if ctx.in_forward:
        grad_hidden, grad_weight, grad_bias = _scaled_in_forward_gradients(call, state, grad_loss.reshape(()),
                                                                           transformed)
    else:
        hidden, weight, bias, target, token_weight = ctx.saved_tensors
        flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape,
                          token_weight=token_weight)
        deferred_backward = transformed_backward if transformed else run_backward
        grad_hidden, grad_weight, grad_bias = deferred_backward(
            call, flat, state, ctx.wanted, grad_loss, grad_logprobs if call.cfg.return_logprobs else None,
            grad_entropy if call.cfg.return_entropy else None,
        )
    # A sharded call's schedule reduced grad_hidden across the ranks already (engine.call.Sharding).
    return grad_hidden, grad_weight, grad_bias


def _scaled_in_forward_gradients(call: EngineCall, state: ForwardState, scale: Tensor,
                                 transformed: bool) -> Grads:
    """grad_output times the gradients forward computed. The usual backward (one, graph freed) scales
    them in place and hands them out; one that retains the graph, or a batched / transformed one,
    multiplies out of place and leaves them unscaled for the next backward."""
    if state.grads is None:
        raise RuntimeError(
            "flce: trying to backward through this loss a second time, after a backward that did not "
            "retain its graph: its gradients, computed in forward, were handed out then. Pass "
            "retain_graph=True to the earlier backward (torch >= 2.5), or call the loss again."
        )
    retained = graph_retained()
    if retained or transformed:
        grads = scaled(state.grads, scale)
        if not retained:
            state.grads = None
        return grads
    grads, state.grads = state.grads, None
    return tuple(None if g is None else call.kernels.scale_(g, scale) for g in grads)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes a gradient through, and refuses to be differentiated: what flce's backward returns
    under create_graph=True, so that differentiating a gradient fails with a message saying why."""

    generate_vmap_rule = True  # a batched gradient passes through too

    @staticmethod
    def forward(grad, *_anchors):
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError(
            "flce: its gradients (linear cross-entropy's, the policy loss's, distillation's) are first-order only: "
            "flce computes them with its own kernels, which have no derivative themselves, so a double backward "
            "(differentiating a gradient taken with create_graph=True) is not supported"
        )


def first_order_only(grads: tuple[Tensor | None, ...], create_graph: bool,
                     anchors: tuple[Tensor, ...] = ()) -> tuple[Tensor | None, ...]:
    """Under create_graph=True, each gradient as a tensor whose own backward raises; else unchanged.
    The gradients hang on ``anchors`` (:func:`first_order_anchors`), so that differentiating one with
    respect to an input reaches that backward; with none, on a fresh leaf, so that they still require grad
    although nothing in flce's backward builds a graph."""
    if not create_graph:
        return grads
    anchors = anchors or (torch.zeros((), requires_grad=True),)
    return tuple(None if g is None else _FirstOrderOnly.apply(g, *anchors) for g in grads)


def first_order_anchors(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """For each input that requires grad, an empty tensor whose autograd history leads to it and holds none
    of its memory (a narrow to no elements, copied: the nodes keep sizes only). Without a path from a
    gradient back to the inputs, autograd finds nothing to differentiate: hessian, hvp and
    torch.autograd.grad(..., allow_unused=True) returned zeros or None without reaching _FirstOrderOnly.
    Inputs wrapped by a torch.func transform get none: check_first_order refuses nested transforms."""
    return tuple(t.narrow(-1, 0, 0).clone() for t in tensors
                 if t is not None and t.requires_grad and not is_transformed(t))


def needs_autograd(flat: FlatInputs) -> bool:
    """Whether a backward can follow: grad mode on and an input that requires grad.
    (ctx.needs_input_grad does not see torch.no_grad(), so this is decided before apply.)"""
    tensors = (flat.hidden, flat.weight, flat.bias)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def apply_eager(flat: FlatInputs, call: EngineCall) -> Tensor | LCEOutput:
    """Run the Function and return the loss, or an LCEOutput when extras were asked."""
    if needs_autograd(flat):
        check_first_order((flat.hidden, flat.weight, flat.bias))
        bias = flat.bias
        wanted = GradTargets(hidden=flat.hidden.requires_grad, weight=flat.weight.requires_grad,
                             bias=bias is not None and bias.requires_grad)
        handoff = _Handoff()
        handoff.anchors = first_order_anchors((flat.hidden, flat.weight, bias))
        *outputs, logit_stats = LCEFunction.apply(flat.hidden, flat.weight, bias, flat.target, flat.token_weight,
                                                  flat.policy, call, wanted, handoff)
    else:
        # Inference (no_grad, evaluation, RL log-probs): the statistics alone, nothing kept.
        state = run_forward(call, flat, grads_in_forward=None, backward_follows=False)
        outputs = shape_outputs(flat_outputs(state, call.cfg, flat.hidden), call.cfg, call.token_shape)
        logit_stats = logit_stats_output(state, call.cfg, flat.hidden, call.token_shape)
    return as_result(tuple(outputs), call.cfg, logit_stats)
