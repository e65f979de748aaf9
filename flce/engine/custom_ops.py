"""The compile path: custom ops ``flce::chunked_forward`` / ``flce::chunked_backward``.

While ``torch.compile`` traces a call, it runs as these ops (:func:`flce.engine.run.run_backend` routes
it), so the compiler sees one opaque node per direction and never breaks the graph. Their schema holds
only tensors and primitives (backend name, variant, the option values; generated from the one option
list, flce.config.PRIMITIVE_OPTION_TYPES); inside, the op rebuilds the config, asks the named backend's
planner for its kernels and plan exactly as an eager call does, and runs the same schedules.

What differs from the eager Function (same results, different work): the deferred schedule recomputes
all logits in backward (how many rows a plan keeps is decided inside the op, where output shapes must
be known to the compiler beforehand, dynamic token counts included); and the in-forward gradients are
scaled out of place. AOTAutograd donates the saved gradients to the backward graph and Inductor writes
the scaled result over their buffers: no V x H allocation (other compiler backends, e.g. aot_eager,
allocate one), but one read and write of it whatever grad_output is. An in-place op would not save
that pass: AOTAutograd functionalizes the mutation of a saved tensor (auto_functionalized), and
Inductor's reinplacing leaves a backward-graph input mutated in place only when the graph copies the
result back into it, which it never does for saved tensors; so it clones the buffer first (torch 2.13:
a copy of the buffer over itself, then the op).

Vocab-parallel calls carry their process group into the ops by name (``group_name``, as torch's
functional collectives do); inside, the op rebuilds the sharded call through the hook that
flce.distributed registers (:func:`register_sharded_call`), so a compiled tensor-parallel step is one
graph too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from flce.config import PRIMITIVE_OPTION_TYPES, LCEConfig, config_from_primitives, primitive_options
from flce.engine.call import EngineCall, ForwardState, GradTargets, grads_in_forward_allowed
from flce.engine.function import first_order_only
from flce.engine.objective import needs_statistics_first
from flce.engine.outputs import as_result, flat_outputs, shape_outputs
from flce.engine.plans import PlanRequest, recomputing
from flce.engine.schedule import planned_call, run_backward, run_forward
from flce.errors import InputError
from flce.inputs import FlatInputs, _check_target_range
from flce.outputs import LCEOutput
from flce.policy.options import POLICY_SCHEMA_KEYWORDS, options_from_primitives, policy_primitives
from flce.policy.tokens import TENSOR_FIELDS, PolicyTokens
from flce.registry import Backend, registered_backends
from flce.semantics import RowStats, denominators, needs_sum_exp_dz, statistics_dtype

# (flat, cfg with the process group, backend, training, needs grad_hidden) -> the sharded EngineCall.
ShardedCallFn = Callable[[FlatInputs, LCEConfig, Backend, bool, bool], EngineCall]
_sharded_call: ShardedCallFn | None = None


def register_sharded_call(fn: ShardedCallFn) -> None:
    """flce.distributed's hook: how an op rebuilds a vocab-parallel call from its group name."""
    global _sharded_call
    _sharded_call = fn


# Keyword-only arguments of both ops: the call's routing, which gradients to produce, the options.
_KEYWORDS = ("str backend, str variant, str? group_name, bool grad_hidden, bool grad_weight, bool grad_bias, "
             + ", ".join(f"{kind} {name}" for name, kind in PRIMITIVE_OPTION_TYPES.items()))
_INPUTS = "Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, Tensor? token_weight"
# A policy loss's per-token tensors (flce.policy.tokens, by field; all None for a cross-entropy call) and its
# options: forward only, since a policy loss computes its gradients in forward (its scalar loss is its only
# differentiable output) and never reaches the deferred backward op.
_POLICY_INPUTS = ", ".join(f"Tensor? policy_{name}=None" for name in TENSOR_FIELDS)
_POLICY_KEYWORDS = ", ".join(["int? policy_sequence_length=None", *POLICY_SCHEMA_KEYWORDS])
_FORWARD_SCHEMA = (f"({_INPUTS}, {_POLICY_INPUTS}, *, {_KEYWORDS}, {_POLICY_KEYWORDS}) -> "
                   f"({', '.join(['Tensor'] * 12)})")
_BACKWARD_SCHEMA = (f"({_INPUTS}, Tensor lse, Tensor target_z, Tensor lse_minus_mean_z, Tensor? grad_loss, "
                    f"Tensor? grad_logprobs, Tensor? grad_entropy, *, {_KEYWORDS}) -> (Tensor, Tensor, Tensor)")
# Output positions of flce::chunked_forward: the six user outputs (flat, empty where not asked), the
# unscaled gradients of hidden, weight, bias (in-forward schedules, empty otherwise), and the row
# statistics lse, target_z, lse_minus_mean_z [N] that a deferred backward needs (empty otherwise).
_USER_OUTPUTS = slice(0, 6)
_GRADS = slice(6, 9)
_STATS = slice(9, 12)


def _backend(name: str) -> Backend:
    by_name = {b.name: b for b in registered_backends()}
    if name not in by_name or by_name[name].plan_call is None:
        engine_backends = sorted(n for n, b in by_name.items() if b.plan_call is not None)
        raise InputError(f"backend={name!r}: expected a registered engine backend, one of {engine_backends}")
    return by_name[name]


def _engine_call(backend: str, flat: FlatInputs, cfg: LCEConfig, variant: str, group_name: str | None,
                 wanted: GradTargets) -> EngineCall:
    """The named backend's kernels and plan for this call, rebuilt inside the op (grad mode is off
    there: the planner is told whether gradients follow); with a group name, the vocab-parallel call."""
    chosen = _backend(backend)
    if group_name is None:
        return planned_call(chosen, flat, cfg, variant,
                            PlanRequest(training=wanted.any, statistics_first=needs_statistics_first(flat)))
    if _sharded_call is None:
        raise RuntimeError("flce: a vocab-parallel op ran before flce.distributed was imported")
    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    return _sharded_call(flat, cfg.replace(process_group=group), chosen, wanted.any, wanted.hidden)


def _wanted(kw: dict, bias: Tensor | None) -> GradTargets:
    return GradTargets(hidden=kw["grad_hidden"], weight=kw["grad_weight"], bias=kw["grad_bias"] and bias is not None)


def _policy_tokens(tensors: tuple[Tensor | None, ...], kw: dict) -> PolicyTokens | None:
    """The policy loss's per-token inputs the op was given, or None (a cross-entropy call)."""
    if not tensors or tensors[0] is None:  # a caller may omit the policy's arguments (they default to None)
        return None
    tensors = (*tensors, *(None for _ in TENSOR_FIELDS[len(tensors):]))  # trailing Nones may be left out too
    return PolicyTokens.from_tensors(options_from_primitives(kw), dict(zip(TENSOR_FIELDS, tensors, strict=True)),
                                     kw.get("policy_sequence_length"))


def _chunked_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                     class_weight: Tensor | None, token_weight: Tensor | None, *policy: Tensor | None,
                     **kw: object) -> tuple[Tensor, ...]:
    """Forward of one call on flat inputs (hidden [N, H], weight [V, H], target [N] int64, token_weight [N], the
    policy loss's per-token tensors [N])."""
    cfg = config_from_primitives(kw, class_weight)
    flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=target.shape,
                      token_weight=token_weight, policy=_policy_tokens(policy, kw))
    if kw["group_name"] is None:
        # prepare_inputs leaves this check to the op while torch.compile traces (it needs the values): CPU targets
        # here, accelerator targets in run_forward's first pass; a vocab-parallel call checks against the global
        # vocabulary instead.
        _check_target_range(target, weight.shape[0], cfg.ignore_index, sharded=False)
    wanted = _wanted(kw, bias)
    call = _engine_call(kw["backend"], flat, cfg, kw["variant"], kw["group_name"], wanted)
    call = call.with_plan(recomputing(call.plan))
    in_forward = wanted.any and grads_in_forward_allowed(call.cfg)
    state = run_forward(call, flat, grads_in_forward=wanted if in_forward else None, backward_follows=wanted.any)

    def empty(dtype: torch.dtype = hidden.dtype) -> Tensor:
        return hidden.new_empty(0, dtype=dtype)

    grads = state.grads if in_forward else (None, None, None)
    stat_dtype = statistics_dtype(hidden.dtype)

    def stat(name: str) -> Tensor:
        value = None if state.stats is None else getattr(state.stats, name)
        return empty(stat_dtype) if value is None else value.to(stat_dtype)

    return (*flat_outputs(state, call.cfg, hidden), *(empty() if g is None else g for g in grads),
            *(stat(name) for name in ("lse", "target_z", "lse_minus_mean_z")))


def _chunked_forward_fake(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                          class_weight: Tensor | None, token_weight: Tensor | None, *_policy: Tensor | None,
                          **kw: object) -> tuple[Tensor, ...]:
    cfg = config_from_primitives(kw)
    n = target.shape[0]
    out_dtype = statistics_dtype(hidden.dtype)

    def per_row(asked: bool, dtype: torch.dtype = out_dtype, rows: bool = True) -> Tensor:
        if not asked:
            return hidden.new_empty(0, dtype=dtype)
        return hidden.new_empty(n if rows else (), dtype=dtype)

    row_reduced = cfg.reduction == "none"
    wanted = _wanted(kw, bias)
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
        per_row(keep_stats and kw["variant"] != "plain" and needs_sum_exp_dz(cfg), stat_dtype),
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


def _chunked_backward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                      class_weight: Tensor | None, token_weight: Tensor | None, lse: Tensor, target_z: Tensor,
                      lse_minus_mean_z: Tensor,
                      grad_loss: Tensor | None, grad_logprobs: Tensor | None, grad_entropy: Tensor | None,
                      **kw: object) -> tuple[Tensor, Tensor, Tensor]:
    """Deferred backward: gradients of hidden, weight, bias (empty where not wanted) from forward's
    row statistics and the upstream gradients, recomputing the logits."""
    cfg = config_from_primitives(kw, class_weight)
    flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=target.shape,
                      token_weight=token_weight)
    wanted = _wanted(kw, bias)
    call = _engine_call(kw["backend"], flat, cfg, kw["variant"], kw["group_name"], wanted)
    call = call.with_plan(recomputing(call.plan))
    with_mean_z = not call.plain and needs_sum_exp_dz(call.cfg)
    empty = hidden.new_empty(0)
    dtype = statistics_dtype(weight.dtype)
    # The counts again (forward's stay inside its op), by the backend's kernel; forward checked the range.
    counts = call.kernels.count_tokens(target, call.cfg.ignore_index, dtype, None)
    state = ForwardState(loss=empty, z_loss=empty, extras={},
                         denoms=denominators(target, call.cfg, dtype, counts),
                         stats=RowStats(lse=lse, target_z=target_z,
                                        lse_minus_mean_z=lse_minus_mean_z if with_mean_z else None))
    grads = run_backward(call, flat, state, wanted, grad_loss,
                         grad_logprobs if call.cfg.return_logprobs else None,
                         grad_entropy if call.cfg.return_entropy else None)
    # A sharded call's schedule reduced grad_hidden across the ranks already (engine.call.Sharding).
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


def _chunked_backward_fake(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                           class_weight: Tensor | None, *_tensors: Tensor | None,
                           **kw: object) -> tuple[Tensor, Tensor, Tensor]:
    wanted = _wanted(kw, bias)
    return (
        torch.empty_like(hidden) if wanted.hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if wanted.weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if wanted.bias else hidden.new_empty(0),
    )


chunked_forward = torch.library.custom_op("flce::chunked_forward", _chunked_forward, mutates_args=(),
                                          schema=_FORWARD_SCHEMA)
chunked_forward.register_fake(_chunked_forward_fake)
chunked_backward = torch.library.custom_op("flce::chunked_backward", _chunked_backward, mutates_args=(),
                                           schema=_BACKWARD_SCHEMA)
chunked_backward.register_fake(_chunked_backward_fake)


def _forward_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    hidden, weight, bias, target, class_weight, token_weight, *_policy = inputs
    kw = keyword_only_inputs
    wanted = _wanted(kw, bias)
    # The deferred backward op's keywords: the policy's are forward's alone (a policy call never defers).
    ctx.kw = {name: value for name, value in kw.items() if not name.startswith("policy_")}
    ctx.wanted = wanted
    cfg = config_from_primitives(kw)
    ctx.in_forward = wanted.any and grads_in_forward_allowed(cfg)
    if ctx.in_forward:
        # Called eagerly (not traced), the op also keeps its inputs: a create_graph backward hangs its
        # first-order guard on them (see _forward_backward). Traced, AOTAutograd owns double backward and
        # the inputs would only hold memory.
        anchors = () if torch.compiler.is_compiling() else (hidden, weight, bias)
        ctx.save_for_backward(*output[_GRADS], *anchors)
    elif wanted.any:
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, token_weight, *output[_STATS])
    z_loss, acc, pred, logprobs, entropy = output[1:6]
    detached = (logprobs, entropy) if cfg.detach_extras else ()
    ctx.mark_non_differentiable(z_loss, acc, pred, *detached, *output[_GRADS], *output[_STATS])


def _forward_backward(ctx, grad_loss, _z, _acc, _pred, grad_logprobs, grad_entropy, *_unused):
    # Eager calls of the op only: AOTAutograd traces this formula and refuses double backward itself.
    create_graph = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if create_graph:
        with torch.no_grad():
            grads = _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
        saved_inputs = ctx.saved_tensors[3:6] if ctx.in_forward else ctx.saved_tensors[:3]
        anchors = tuple(t for t in saved_inputs if t is not None and t.requires_grad)
        grads = (*first_order_only(grads[:3], create_graph=True, anchors=anchors), None, None, None)
    else:
        grads = _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy)
    return (*grads, *(None for _ in TENSOR_FIELDS))  # the policy's tensors are constants


def _op_gradients(ctx, grad_loss, grad_logprobs, grad_entropy):
    wanted = ctx.wanted
    asked = (wanted.hidden, wanted.weight, wanted.bias)
    if not wanted.any:
        return None, None, None, None, None, None
    if ctx.in_forward:
        # Out of place: an in-place scale of these saved outputs is functionalized and Inductor
        # would clone them before it (module docstring). Inductor donates them to the backward
        # graph and writes the product over their buffers, in one pass that multiplies in the
        # scale's fp32 (grad_output is not rounded to bf16 first).
        saved = ctx.saved_tensors[:3]  # the gradients forward computed (then, eagerly, the inputs)
        if grad_loss is None:
            grad_loss = torch.zeros((), device=saved[0].device)
        scale = grad_loss.reshape(())
        # A sharded call's forward reduced grad_hidden across the ranks already (engine.call.Sharding).
        grads = tuple((g.to(scale.dtype) * scale).to(g.dtype) if a else None
                      for g, a in zip(saved, asked, strict=True))
    else:
        hidden, weight, bias, target, class_weight, token_weight, lse, target_z, lse_minus_mean_z = ctx.saved_tensors
        results = torch.ops.flce.chunked_backward(
            hidden, weight, bias, target, class_weight, token_weight, lse, target_z, lse_minus_mean_z,
            grad_loss, grad_logprobs, grad_entropy, **ctx.kw,
        )
        grads = tuple(g if a else None for g, a in zip(results, asked, strict=True))
    return grads[0], grads[1], grads[2], None, None, None


chunked_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


def apply_op(backend: str, flat: FlatInputs, cfg: LCEConfig, variant: str) -> Tensor | LCEOutput:
    """The call through the custom ops (what torch.compile sees): the same results as the eager path.
    A process group travels by name, as torch's functional collectives carry theirs."""
    if cfg.return_logit_stats:
        # The op's outputs are the six user outputs and the gradients: no slot for the statistics yet.
        raise InputError("return_logit_stats=True is not supported under torch.compile (the custom op does not "
                         "return the logit statistics); call flce outside the compiled region for them")
    grad_mode = torch.is_grad_enabled()
    policy = flat.policy
    outputs = torch.ops.flce.chunked_forward(
        flat.hidden, flat.weight, flat.bias, flat.target, cfg.class_weight, flat.token_weight,
        *(policy.tensors().values() if policy is not None else (None for _ in TENSOR_FIELDS)),
        backend=backend,
        variant=variant,
        group_name=None if cfg.process_group is None else cfg.process_group.group_name,
        grad_hidden=grad_mode and flat.hidden.requires_grad,
        grad_weight=grad_mode and flat.weight.requires_grad,
        grad_bias=grad_mode and flat.bias is not None and flat.bias.requires_grad,
        **primitive_options(cfg),
        policy_sequence_length=None if policy is None else policy.sequence_length,
        **policy_primitives(None if policy is None else policy.options),
    )
    return as_result(shape_outputs(tuple(outputs[_USER_OUTPUTS]), cfg, flat.token_shape), cfg)
