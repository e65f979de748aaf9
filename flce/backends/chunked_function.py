"""The autograd.Function around :mod:`flce.backends.chunk_driver`, shared by every backend.

A backend's ``function.py`` binds its kernels and plan to :func:`apply_chunked`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.backends.chunk_driver import (
    ChunkKernels,
    ChunkPlan,
    ForwardState,
    GradTargets,
    Sharding,
    run_backward,
    run_forward,
)
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput


@dataclass(frozen=True)
class ChunkedCall:
    """Everything about a call that is not a tensor autograd must track."""

    kernels: ChunkKernels
    cfg: LCEConfig
    plan: ChunkPlan
    plain: bool
    token_shape: torch.Size
    sharding: Sharding | None = None


def grads_in_forward_allowed(cfg: LCEConfig) -> bool:
    """The in-forward schedule needs a scalar loss as the only differentiable output."""
    return cfg.reduction != "none" and not (cfg.return_logprobs or cfg.return_entropy)


class ChunkedLCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: ChunkedCall):  # noqa: ANN001, ANN205
        flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
        wanted = GradTargets(
            hidden=ctx.needs_input_grad[0],
            weight=ctx.needs_input_grad[1],
            bias=bias is not None and ctx.needs_input_grad[2],
        )
        eager = wanted.any and grads_in_forward_allowed(call.cfg)
        state = run_forward(
            call.kernels, flat, call.cfg, call.plan, call.plain,
            grads_in_forward=wanted if eager else None, sharding=call.sharding,
        )
        ctx.call, ctx.state, ctx.wanted, ctx.eager = call, state, wanted, eager
        if not eager and wanted.any:
            ctx.save_for_backward(hidden, weight, bias, target)
        outputs = _shape_outputs(state, call, hidden)
        ctx.mark_non_differentiable(outputs[1], outputs[2], outputs[3])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss, _grad_acc, _grad_pred, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN205
        call, state, wanted = ctx.call, ctx.state, ctx.wanted
        if ctx.eager:
            if state.grads is None:
                raise RuntimeError(
                    "flce: backward through this loss a second time is not supported: its gradients were "
                    "computed in forward and handed out by the first backward. Call the loss again instead "
                    "of using retain_graph=True."
                )
            grads, state.grads = state.grads, None
            scale = grad_loss.reshape(())
            grad_hidden, grad_weight, grad_bias = (None if g is None else g.mul_(scale.to(g.dtype)) for g in grads)
        else:
            hidden, weight, bias, target = ctx.saved_tensors
            flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
            grad_hidden, grad_weight, grad_bias = run_backward(
                call.kernels, flat, call.cfg, call.plan, call.plain, state, wanted,
                grad_loss, grad_logprobs if call.cfg.return_logprobs else None,
                grad_entropy if call.cfg.return_entropy else None, sharding=call.sharding,
            )
        return grad_hidden, grad_weight, grad_bias, None, None


def _shape_outputs(state: ForwardState, call: ChunkedCall, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Six tensors, empty where not asked; per-token outputs take the target's shape."""
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    empty = hidden.new_empty(0, dtype=out_dtype)

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(call.token_shape)

    def shaped(t: torch.Tensor) -> torch.Tensor:
        t = t.to(out_dtype) if t.is_floating_point() else t
        return per_token(t) if call.cfg.reduction == "none" else t

    ex = state.extras
    cfg = call.cfg
    return (
        shaped(state.loss),
        shaped(state.z_loss) if cfg.return_z_loss else empty,
        shaped(ex["token_accuracy"]) if cfg.return_token_accuracy else empty,
        per_token(ex["predicted_tokens"]) if cfg.return_predicted_tokens else empty.long(),
        per_token(ex["logprobs"].to(out_dtype)) if cfg.return_logprobs else empty,
        per_token(ex["entropy"].to(out_dtype)) if cfg.return_entropy else empty,
    )


def apply_chunked(flat: FlatInputs, call: ChunkedCall) -> torch.Tensor | LCEOutput:
    """Run the function and return the loss, or an LCEOutput when extras were asked."""
    loss, z_loss, acc, pred, logprobs, entropy = ChunkedLCEFunction.apply(
        flat.hidden, flat.weight, flat.bias, flat.target, call
    )
    cfg = call.cfg
    if not cfg.returns_extras:
        return loss
    return LCEOutput(
        loss=loss,
        z_loss=z_loss if cfg.return_z_loss else None,
        token_accuracy=acc if cfg.return_token_accuracy else None,
        predicted_tokens=pred if cfg.return_predicted_tokens else None,
        logprobs=logprobs if cfg.return_logprobs else None,
        entropy=entropy if cfg.return_entropy else None,
    )
