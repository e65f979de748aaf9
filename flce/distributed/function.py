"""The vocab-parallel autograd.Function: the shared chunk loop with a Sharding that all-reduces
row statistics, and one all-reduce of grad_hidden in backward.

Every rank holds the full ``hidden`` and ``target`` and its own contiguous vocabulary shard of
``weight``/``bias``. Each rank scans only its shard; the combine step makes the row statistics
global before any loss term or gradient coefficient is formed, so loss, extras and the per-row
gradient coefficients are identical on every rank. Each rank's grad-logits then only touch its
shard: grad_weight/grad_bias are local, and grad_hidden is a partial sum over the shard that one
all-reduce completes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flce.backends.chunk_driver import (
    ChunkKernels,
    ChunkPlan,
    ForwardState,
    GradTargets,
    Sharding,
    run_backward,
    run_forward,
)
from flce.backends.chunked_function import needs_autograd, run_backend
from flce.config import LCEConfig
from flce.distributed import checks, collectives
from flce.distributed.shards import VocabShard, group_size, vocab_shard
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry import Backend, Candidates, choose_for_call


@dataclass(frozen=True)
class ShardedCall:
    """Everything about a vocab-parallel call that is not a tensor autograd must track."""

    kernels: ChunkKernels
    cfg: LCEConfig
    plan: ChunkPlan
    token_shape: torch.Size
    sharding: Sharding
    group: Any


def grads_in_forward(cfg: LCEConfig) -> bool:
    """The in-forward gradient schedule needs a scalar loss as the only differentiable output."""
    return cfg.reduction != "none" and not (cfg.return_logprobs or cfg.return_entropy)


class VocabParallelLCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: ShardedCall):  # noqa: ANN001, ANN205
        flat = FlatInputs(hidden=hidden, weight=weight, target=target, bias=bias, token_shape=call.token_shape)
        wanted = GradTargets(
            hidden=ctx.needs_input_grad[0],
            weight=ctx.needs_input_grad[1],
            bias=bias is not None and ctx.needs_input_grad[2],
        )
        eager = wanted.any and grads_in_forward(call.cfg)
        # The shard-local scan is the "full" variant's: only it produces combinable statistics.
        state = run_forward(
            call.kernels, flat, call.cfg, call.plan, plain=False,
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
                call.kernels, flat, call.cfg, call.plan, False, state, wanted,
                grad_loss, grad_logprobs if call.cfg.return_logprobs else None,
                grad_entropy if call.cfg.return_entropy else None, sharding=call.sharding,
            )
        if grad_hidden is not None and grad_hidden.numel():
            # Each rank's grad_hidden covers its vocabulary shard only; the sum over shards is the
            # full gradient. This is the call's only backward collective.
            collectives.all_reduce_(grad_hidden, dist.ReduceOp.SUM, call.group)
        return grad_hidden, grad_weight, grad_bias, None, None


def _shape_outputs(state: ForwardState, call: ShardedCall, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Six tensors, empty where not asked; per-token outputs take the target's shape."""
    cfg = call.cfg
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    empty = hidden.new_empty(0, dtype=out_dtype)

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(call.token_shape)

    def shaped(t: torch.Tensor) -> torch.Tensor:
        t = t.to(out_dtype) if t.is_floating_point() else t
        return per_token(t) if cfg.reduction == "none" else t

    ex = state.extras
    return (
        shaped(state.loss),
        shaped(state.z_loss) if cfg.return_z_loss else empty,
        shaped(ex["token_accuracy"]) if cfg.return_token_accuracy else empty,
        per_token(ex["predicted_tokens"]) if cfg.return_predicted_tokens else empty.long(),
        per_token(ex["logprobs"].to(out_dtype)) if cfg.return_logprobs else empty,
        per_token(ex["entropy"].to(out_dtype)) if cfg.return_entropy else empty,
    )


def _chunked_candidates(candidates: Candidates) -> Candidates:
    """Only backends built on the shared chunk loop can scan one vocabulary shard."""
    usable = tuple(b for b in candidates.backends if b.chunked is not None)
    skipped = tuple((b.name, "does not expose a chunked call, so it cannot scan a vocabulary shard")
                    for b in candidates.backends if b.chunked is None)
    if candidates.explicit and skipped:
        name = skipped[0][0]
        raise ValueError(f"backend {name!r} cannot serve process_group: it does not expose a chunked call")
    return Candidates(usable, candidates.explicit, candidates.passed_over + skipped)


def vocab_parallel_linear_cross_entropy(
    flat: FlatInputs, cfg: LCEConfig, candidates: Candidates, variant: str = "auto"
) -> torch.Tensor | LCEOutput:
    """The loss (or LCEOutput) of a call whose ``cfg.process_group`` shards the vocabulary.

    ``flat.weight``/``flat.bias`` are this rank's contiguous shard (shards in group-rank order,
    sizes may differ); ``flat.target`` holds global ids; ``cfg.class_weight``, when given, is the
    global ``[V]`` vector, the same on every rank. ``variant`` only matters for a group of one
    rank, which runs exactly the unsharded path.
    """
    group = cfg.process_group
    if group_size(group) == 1:
        return _single_rank(flat, cfg, candidates, variant)
    if checks.debug_checks_enabled():
        # Before the layout exchange: its collective is skipped on ranks that have it cached.
        needs_grad_hidden = torch.is_grad_enabled() and flat.hidden.requires_grad
        checks.check_ranks_agree(flat, cfg, needs_grad_hidden, group)
    shard = vocab_shard(group, flat.weight)
    checks.check_target_range(flat.target, shard.global_vocab, cfg.ignore_index)
    checks.check_class_weight(cfg, shard.global_vocab)
    backend: Backend = choose_for_call(_chunked_candidates(candidates), cfg, flat)
    chunked = backend.chunked(flat, cfg, "full")
    plan = _agreed_plan(backend, chunked.plan, flat, cfg, shard)
    call = ShardedCall(
        kernels=chunked.kernels,
        cfg=cfg,
        plan=plan,
        token_shape=flat.token_shape,
        sharding=Sharding(
            vocab_offset=shard.offset,
            global_vocab=shard.global_vocab,
            combine=functools.partial(collectives.combine_row_stats, group=group),
        ),
        group=group,
    )
    if needs_autograd(flat):
        outputs = VocabParallelLCEFunction.apply(flat.hidden, flat.weight, flat.bias, flat.target, call)
    else:
        # Inference (no_grad, frozen inputs): the scan and its collectives only, nothing kept.
        state = run_forward(call.kernels, flat, cfg, call.plan, plain=False, grads_in_forward=None,
                            sharding=call.sharding, backward_follows=False)
        outputs = _shape_outputs(state, call, flat.hidden)
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


def _agreed_plan(backend: Backend, own: ChunkPlan, flat: FlatInputs, cfg: LCEConfig, shard: VocabShard) -> ChunkPlan:
    """A chunk plan every rank computes identically.

    Each chunk issues the combine collectives, so all ranks must cut the tokens the same way;
    a plan made from this rank's shard size would differ between uneven shards. Every rank
    therefore plans for the largest shard (memory-safe for the smaller ones), from a weight
    view of that size that reads no memory.
    """
    largest = max(shard.sizes)
    if largest == shard.size:
        return own
    hidden_size = flat.weight.shape[1]
    stand_in = FlatInputs(
        hidden=flat.hidden,
        weight=flat.weight[:1].expand(largest, hidden_size),
        target=flat.target,
        bias=None if flat.bias is None else flat.bias[:1].expand(largest),
        token_shape=flat.token_shape,
    )
    return backend.chunked(stand_in, cfg, "full").plan


def _single_rank(flat: FlatInputs, cfg: LCEConfig, candidates: Candidates, variant: str) -> torch.Tensor | LCEOutput:
    """A group of one rank holds the whole vocabulary: exactly the unsharded path."""
    cfg = cfg.replace(process_group=None)
    # prepare_inputs skipped the range check because a group was set; the shard is the vocabulary here.
    checks.check_target_range(flat.target, flat.weight.shape[0], cfg.ignore_index)
    if variant == "auto":
        variant = "full" if cfg.needs_full else "plain"
    return run_backend(choose_for_call(candidates, cfg, flat), flat, cfg, variant)
