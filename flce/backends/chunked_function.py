"""The autograd wrappers around :mod:`flce.backends.chunk_driver`, shared by every backend.

Two wrappers drive the same chunk loop:

* :class:`ChunkedLCEFunction`, a ``torch.autograd.Function``, serves eager calls. A backend's
  ``function.py`` binds its kernels and plan to :func:`apply_chunked`.
* The custom ops ``flce::chunked_forward`` / ``flce::chunked_backward`` serve calls that
  ``torch.compile`` traces (:func:`run_backend` routes them). Their schema holds only tensors and
  primitives (backend name, variant, the option values), so the compiler sees one opaque node per
  direction and never breaks the graph; inside, the op rebuilds the config and asks the named
  backend for its kernels and plan, exactly as an eager call does.

Why eager calls keep the Function: the deferred schedule can keep forward's logits for backward
(one GEMM fewer for the kept rows), and how many rows it keeps is the plan's choice, made inside
the op from the device and the autotune cache, where an op's output shapes must be known to the
compiler beforehand (dynamic token counts included), so under the op backward recomputes them; and
the Function scales the in-forward gradients in place with the backend's ``scale_`` kernel, which
skips the pass over V x H when grad_output is exactly 1 (decided on the device). Under
torch.compile AOTAutograd donates the saved gradients to the backward graph and Inductor writes the
scaled result over their buffers: no V x H allocation (other compiler backends, e.g. aot_eager,
allocate one), but one read and write of it whatever grad_output is. An in-place op would not save
that pass: AOTAutograd functionalizes the mutation of a saved tensor (auto_functionalized), and
Inductor's reinplacing leaves a backward-graph input mutated in place only when the graph copies
the result back into it, which it never does for saved tensors; so it clones the buffer first
(torch 2.13: a copy of the buffer over itself, then the op).

Vocab-parallel calls carry their process group into the ops by name (``group_name``, as torch's
functional collectives do); inside, the op rebuilds the sharded call
(flce.distributed.function.sharded_call), so a compiled tensor-parallel step is one graph too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from flce.backends.chunk_driver import (
    ChunkKernels,
    ChunkPlan,
    ForwardState,
    GradTargets,
    Sharding,
    chunk_bounds,
    grads_in_forward_allowed,
    run_backward,
    run_forward,
)
from flce.config import LCEConfig, config_from_primitives, primitive_options
from flce.inputs import FlatInputs, _check_target_range
from flce.outputs import LCEOutput
from flce.registry import Backend, registered_backends
from flce.semantics import RowStats, denominators, needs_expected_z, statistics_dtype

# torch's functional collectives (all_reduce, wait_tensor): ops that name their group by string.
_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class ChunkedCall:
    """Everything about a call that is not a tensor autograd must track."""

    kernels: ChunkKernels
    cfg: LCEConfig
    plan: ChunkPlan
    plain: bool
    token_shape: torch.Size
    sharding: Sharding | None = None


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
            grads_in_forward=wanted if eager else None, sharding=call.sharding, backward_follows=wanted.any,
        )
        ctx.call, ctx.state, ctx.wanted, ctx.eager = call, state, wanted, eager
        if not eager and wanted.any:
            ctx.save_for_backward(hidden, weight, bias, target)
        outputs = _shape_outputs(_flat_outputs(state, call.cfg, hidden), call.cfg, call.token_shape)
        ctx.mark_non_differentiable(outputs[1], outputs[2], outputs[3])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss, _grad_acc, _grad_pred, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN205
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grads = ChunkedLCEFunction._gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
        return (*first_order_only(grads, create_graph), None, None)

    @staticmethod
    def _gradients(ctx, grad_loss, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN205
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
            grad_hidden, grad_weight, grad_bias = (None if g is None else call.kernels.scale_(g, scale) for g in grads)
        else:
            hidden, weight, bias, target = ctx.saved_tensors
            flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
            grad_hidden, grad_weight, grad_bias = run_backward(
                call.kernels, flat, call.cfg, call.plan, call.plain, state, wanted,
                grad_loss, grad_logprobs if call.cfg.return_logprobs else None,
                grad_entropy if call.cfg.return_entropy else None, sharding=call.sharding,
            )
        if call.sharding is not None and grad_hidden is not None and grad_hidden.numel():
            call.sharding.reduce_grad_hidden(grad_hidden)
        return grad_hidden, grad_weight, grad_bias


class _FirstOrderOnly(torch.autograd.Function):
    """Passes a gradient through, and refuses to be differentiated: what flce's backward returns
    under create_graph=True, so that differentiating a gradient fails with a message saying why."""

    @staticmethod
    def forward(ctx, grad, _anchor):  # noqa: ANN001, ANN205
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _grad):  # noqa: ANN001, ANN205
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


def _flat_outputs(state: ForwardState, cfg: LCEConfig, hidden: Tensor) -> tuple[Tensor, ...]:
    """(loss, z_loss, token_accuracy, predicted_tokens, logprobs, entropy): per-token ones flat [N],
    each one its own tensor (a fresh empty one where not asked: op outputs may not alias)."""
    out_dtype = statistics_dtype(hidden.dtype)

    def empty(dtype: torch.dtype = out_dtype) -> Tensor:
        return hidden.new_empty(0, dtype=dtype)

    def in_out_dtype(t: Tensor) -> Tensor:
        return t.to(out_dtype) if t.is_floating_point() else t

    ex = state.extras
    return (
        in_out_dtype(state.loss),
        in_out_dtype(state.z_loss) if cfg.return_z_loss else empty(),
        in_out_dtype(ex["token_accuracy"]) if cfg.return_token_accuracy else empty(),
        ex["predicted_tokens"] if cfg.return_predicted_tokens else empty(torch.int64),
        in_out_dtype(ex["logprobs"]) if cfg.return_logprobs else empty(),
        in_out_dtype(ex["entropy"]) if cfg.return_entropy else empty(),
    )


def _shape_outputs(outputs: tuple[Tensor, ...], cfg: LCEConfig, token_shape: torch.Size) -> tuple[Tensor, ...]:
    """Per-token outputs (and the reduction="none" loss, z_loss, accuracy) take the target's shape."""
    loss, z_loss, acc, pred, logprobs, entropy = outputs
    per_row = cfg.reduction == "none"

    def shaped(t: Tensor, asked: bool, per_token: bool) -> Tensor:
        return t.reshape(token_shape) if asked and per_token else t

    return (
        shaped(loss, True, per_row),
        shaped(z_loss, cfg.return_z_loss, per_row),
        shaped(acc, cfg.return_token_accuracy, per_row),
        shaped(pred, cfg.return_predicted_tokens, True),
        shaped(logprobs, cfg.return_logprobs, True),
        shaped(entropy, cfg.return_entropy, True),
    )


def _as_result(outputs: tuple[Tensor, ...], cfg: LCEConfig) -> Tensor | LCEOutput:
    """The loss, or an LCEOutput when extras were asked."""
    loss, z_loss, acc, pred, logprobs, entropy = outputs
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


def needs_autograd(flat: FlatInputs) -> bool:
    """Whether a backward can follow: grad mode on and an input that requires grad.
    (ctx.needs_input_grad does not see torch.no_grad(), so this is decided before apply.)"""
    tensors = (flat.hidden, flat.weight, flat.bias)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def apply_chunked(flat: FlatInputs, call: ChunkedCall) -> Tensor | LCEOutput:
    """Run the Function and return the loss, or an LCEOutput when extras were asked."""
    if needs_autograd(flat):
        outputs = ChunkedLCEFunction.apply(flat.hidden, flat.weight, flat.bias, flat.target, call)
    else:
        # Inference (no_grad, evaluation, RL log-probs): the scan alone, no gradient work, nothing kept.
        state = run_forward(call.kernels, flat, call.cfg, call.plan, call.plain, grads_in_forward=None,
                            sharding=call.sharding, backward_follows=False)
        outputs = _shape_outputs(_flat_outputs(state, call.cfg, flat.hidden), call.cfg, call.token_shape)
    return _as_result(outputs, call.cfg)


def run_backend(backend: Backend, flat: FlatInputs, cfg: LCEConfig, variant: str) -> Tensor | LCEOutput:
    """Compute a call on ``backend``: through the custom op while torch.compile traces (so the
    graph does not break), else through the backend's own entry point."""
    if torch.compiler.is_compiling() and backend.chunked is not None:
        return apply_chunked_op(backend.name, flat, cfg, variant)
    return backend.run(flat, cfg, variant)


# ---------------------------------------------------------------------------------------------
# Custom ops. Options travel as keyword-only primitives: flce.config.primitive_options and
# config_from_primitives are the two directions of that encoding.

def _chunk_loop_backend(backend: str) -> Backend:
    by_name = {b.name: b for b in registered_backends()}
    if backend not in by_name or by_name[backend].chunked is None:
        chunked = sorted(name for name, b in by_name.items() if b.chunked is not None)
        raise ValueError(f"backend={backend!r}: expected a registered chunk-loop backend, one of {chunked}")
    return by_name[backend]


def _backend_call(backend: str, flat: FlatInputs, cfg: LCEConfig, variant: str, group_name: str | None,
                  wanted: GradTargets, training: bool) -> ChunkedCall:
    """The named backend's kernels and plan for this call, rebuilt inside the op; with a group
    name, the vocab-parallel call over that group (its plan and Sharding)."""
    chosen = _chunk_loop_backend(backend)
    if group_name is None:
        # Inside the op grad mode is off: the plan must be told that gradients follow.
        return chosen.chunked(flat, cfg, variant, training=training)
    # Imported here, not at the top: flce.distributed builds on this module.
    from flce.distributed.function import sharded_call

    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    return sharded_call(flat, cfg.replace(process_group=group), chosen, training, wanted.hidden)


def _wanted(grad_hidden: bool, grad_weight: bool, grad_bias: bool, bias: Tensor | None) -> GradTargets:
    return GradTargets(hidden=grad_hidden, weight=grad_weight, bias=grad_bias and bias is not None)


@torch.library.custom_op("flce::chunked_forward", mutates_args=())
def chunked_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
    *,
    backend: str,
    variant: str,
    group_name: str | None,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    temperature: float,
    token_scaling: bool,
    fp32_accumulation: bool,
    memory_budget: int | None,
    return_z_loss: bool,
    return_token_accuracy: bool,
    return_predicted_tokens: bool,
    return_logprobs: bool,
    return_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of one call on flat inputs (hidden [N, H], weight [V, H], target [N] int64).

    Returns the six user outputs (flat, empty where not asked), then the unscaled gradients
    of hidden, weight, bias (in-forward schedule, empty otherwise), then the row statistics
    lse, target_z, expected_z [N] that the deferred schedule's backward needs (empty otherwise).
    """
    cfg = config_from_primitives(locals(), class_weight)
    flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=target.shape)
    if group_name is None:
        # prepare_inputs leaves this check to the op while torch.compile traces (it needs the values);
        # a vocab-parallel call checks against the global vocabulary instead.
        _check_target_range(target, weight.shape[0], cfg.ignore_index, sharded=False)
    wanted = _wanted(grad_hidden, grad_weight, grad_bias, bias)
    call = _backend_call(backend, flat, cfg, variant, group_name, wanted, training=wanted.any)
    cfg = call.cfg
    in_forward = wanted.any and grads_in_forward_allowed(cfg)
    plan = replace(call.plan, saved_rows=0)
    state = run_forward(call.kernels, flat, cfg, plan, call.plain, grads_in_forward=wanted if in_forward else None,
                        sharding=call.sharding, backward_follows=wanted.any)

    def empty() -> Tensor:
        return hidden.new_empty(0)

    grads = state.grads if in_forward else (None, None, None)
    grad_outputs = tuple(empty() if g is None else g for g in grads)
    stat_dtype = statistics_dtype(hidden.dtype)

    def stat(name: str) -> Tensor:
        parts = [getattr(s, name) for s in state.stats]
        if not parts or parts[0] is None:
            return hidden.new_empty(0, dtype=stat_dtype)
        return torch.cat(parts).to(stat_dtype)

    keep_stats = wanted.any and not in_forward
    stats = tuple(stat(name) if keep_stats else hidden.new_empty(0, dtype=stat_dtype)
                  for name in ("lse", "target_z", "expected_z"))
    return (*_flat_outputs(state, cfg, hidden), *grad_outputs, *stats)


@chunked_forward.register_fake
def _chunked_forward_fake(hidden, weight, bias, target, class_weight, **kw):  # noqa: ANN001, ANN003, ANN202
    cfg = config_from_primitives(kw)
    n = target.shape[0]
    out_dtype = statistics_dtype(hidden.dtype)

    def per_row(asked: bool, dtype: torch.dtype = out_dtype, rows: bool = True) -> Tensor:
        if not asked:
            return hidden.new_empty(0, dtype=dtype)
        return hidden.new_empty(n if rows else (), dtype=dtype)

    row_reduced = cfg.reduction == "none"
    wanted = _wanted(kw["grad_hidden"], kw["grad_weight"], kw["grad_bias"], bias)
    in_forward = wanted.any and grads_in_forward_allowed(cfg)
    grads = (
        torch.empty_like(hidden) if in_forward and wanted.hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if in_forward and wanted.weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if in_forward and wanted.bias else hidden.new_empty(0),
    )
    keep_stats = wanted.any and not in_forward
    stat_dtype = statistics_dtype(hidden.dtype)
    stats = (
        per_row(keep_stats, stat_dtype),
        per_row(keep_stats, stat_dtype),
        per_row(keep_stats and not kw["variant"] == "plain" and needs_expected_z(cfg), stat_dtype),
    )
    return (
        per_row(True, rows=row_reduced),
        per_row(cfg.return_z_loss, rows=row_reduced),
        per_row(cfg.return_token_accuracy, rows=row_reduced),
        per_row(cfg.return_predicted_tokens, torch.int64),
        per_row(cfg.return_logprobs),
        per_row(cfg.return_entropy),
        *grads,
        *stats,
    )


@torch.library.custom_op("flce::chunked_backward", mutates_args=())
def chunked_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
    lse: Tensor,
    target_z: Tensor,
    expected_z: Tensor,
    grad_loss: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    backend: str,
    variant: str,
    group_name: str | None,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    temperature: float,
    token_scaling: bool,
    fp32_accumulation: bool,
    memory_budget: int | None,
    return_z_loss: bool,
    return_token_accuracy: bool,
    return_predicted_tokens: bool,
    return_logprobs: bool,
    return_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Deferred-schedule backward: gradients of hidden, weight, bias (empty where not wanted)
    from forward's row statistics and the upstream gradients, recomputing each chunk's logits."""
    cfg = config_from_primitives(locals(), class_weight)
    flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=target.shape)
    wanted = _wanted(grad_hidden, grad_weight, grad_bias, bias)
    call = _backend_call(backend, flat, cfg, variant, group_name, wanted, training=True)
    cfg = call.cfg
    with_expected_z = not call.plain and needs_expected_z(cfg)
    stats = [
        RowStats(lse=lse[rows], target_z=target_z[rows], expected_z=expected_z[rows] if with_expected_z else None)
        for rows in chunk_bounds(target.shape[0], call.plan.tokens_per_chunk)
    ]
    empty = hidden.new_empty(0)
    denoms = denominators(target, cfg, statistics_dtype(weight.dtype))
    state = ForwardState(loss=empty, z_loss=empty, extras={}, denoms=denoms, stats=stats)
    grads = run_backward(
        call.kernels, flat, cfg, call.plan, call.plain, state, wanted, grad_loss,
        grad_logprobs if cfg.return_logprobs else None, grad_entropy if cfg.return_entropy else None,
        sharding=call.sharding,
    )
    if call.sharding is not None and grads[0] is not None and grads[0].numel():
        call.sharding.reduce_grad_hidden(grads[0])
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@chunked_backward.register_fake
def _chunked_backward_fake(hidden, weight, bias, target, class_weight, *_tensors, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
    wanted = _wanted(kw["grad_hidden"], kw["grad_weight"], kw["grad_bias"], bias)
    return (
        torch.empty_like(hidden) if wanted.hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if wanted.weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if wanted.bias else hidden.new_empty(0),
    )


# Output positions of flce::chunked_forward.
_USER_OUTPUTS = slice(0, 6)
_GRADS = slice(6, 9)
_STATS = slice(9, 12)


def _forward_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:  # noqa: ANN001
    hidden, weight, bias, target, class_weight = inputs
    kw = keyword_only_inputs
    cfg = config_from_primitives(kw)
    wanted = _wanted(kw["grad_hidden"], kw["grad_weight"], kw["grad_bias"], bias)
    ctx.kw = kw
    ctx.wanted = wanted
    ctx.in_forward = wanted.any and grads_in_forward_allowed(cfg)
    ctx.has_bias = bias is not None
    if ctx.in_forward:
        ctx.save_for_backward(*output[_GRADS])
    elif wanted.any:
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, *output[_STATS])
    z_loss, acc, pred = output[1:4]
    ctx.mark_non_differentiable(z_loss, acc, pred, *output[_GRADS], *output[_STATS])


def _forward_backward(ctx, grad_loss, _z, _acc, _pred, grad_logprobs, grad_entropy, *_unused):  # noqa: ANN001, ANN002, ANN202
    # Eager calls of the op only: AOTAutograd traces this formula and refuses double backward itself.
    create_graph = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if create_graph:
        with torch.no_grad():
            grads = _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
        return (*first_order_only(grads[:3], create_graph=True), None, None)
    return _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy)


def _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy):  # noqa: ANN001, ANN202
    wanted = ctx.wanted
    asked = (wanted.hidden, wanted.weight, wanted.bias)
    if not wanted.any:
        return None, None, None, None, None
    if ctx.in_forward:
        # Out of place: an in-place scale of these saved outputs is functionalized and Inductor
        # would clone them before it (module docstring). Inductor donates them to the backward
        # graph and writes the product over their buffers, in one pass that multiplies in the
        # scale's fp32 (grad_output is not rounded to bf16 first).
        saved = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros((), device=saved[0].device)
        scale = grad_loss.reshape(())
        grads = tuple((g.to(scale.dtype) * scale).to(g.dtype) if a else None
                      for g, a in zip(saved, asked, strict=True))
        group_name = ctx.kw["group_name"]
        if group_name is not None and grads[0] is not None:
            # Each rank's grad_hidden covers its vocabulary shard: their sum is the gradient. A
            # functional collective, so that the compiled backward graph holds it.
            grads = (_c10d.wait_tensor(_c10d.all_reduce(grads[0], "sum", group_name)), *grads[1:])
    else:
        hidden, weight, bias, target, class_weight, lse, target_z, expected_z = ctx.saved_tensors
        results = torch.ops.flce.chunked_backward(
            hidden, weight, bias, target, class_weight, lse, target_z, expected_z,
            grad_loss, grad_logprobs, grad_entropy, **ctx.kw,
        )
        grads = tuple(g if a else None for g, a in zip(results, asked, strict=True))
    return grads[0], grads[1], grads[2], None, None


chunked_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


def apply_chunked_op(backend: str, flat: FlatInputs, cfg: LCEConfig, variant: str) -> Tensor | LCEOutput:
    """The call through the custom ops (what torch.compile sees): same results as apply_chunked.
    A process group travels by name, as torch's functional collectives carry theirs."""
    grad_mode = torch.is_grad_enabled()
    outputs = torch.ops.flce.chunked_forward(
        flat.hidden, flat.weight, flat.bias, flat.target, cfg.class_weight,
        backend=backend,
        variant=variant,
        group_name=None if cfg.process_group is None else cfg.process_group.group_name,
        grad_hidden=grad_mode and flat.hidden.requires_grad,
        grad_weight=grad_mode and flat.weight.requires_grad,
        grad_bias=grad_mode and flat.bias is not None and flat.bias.requires_grad,
        **primitive_options(cfg),
    )
    return _as_result(_shape_outputs(tuple(outputs[_USER_OUTPUTS]), cfg, flat.token_shape), cfg)
