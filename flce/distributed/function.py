"""Vocab-parallel calls: the shared engine's schedules and autograd paths with a Sharding that
all-reduces row statistics, and one all-reduce of grad_hidden, beside the last weight-gradient product.

Every rank holds the full ``hidden`` and ``target`` and its own contiguous vocabulary shard of
``weight``/``bias``. Each rank scans only its shard; the combine step makes the row statistics
global before any loss term or gradient coefficient is formed, so loss, extras and the per-row
gradient coefficients are identical on every rank. Each rank's grad-logits then only touch its
shard: grad_weight/grad_bias are local, and grad_hidden is a partial sum over the shard that one
all-reduce completes, started as soon as the last rows of grad_hidden exist and waited for where the schedule
returns it (with gradients formed in forward, in forward).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from flce.config import LCEConfig
from flce.distributed import checks, collectives
from flce.distributed.shards import VocabShard, group_size, vocab_shard
from flce.engine.call import EngineCall, Sharding
from flce.engine.custom_ops import apply_op, register_sharded_call
from flce.engine.function import apply_eager, needs_autograd
from flce.engine.objective import needs_statistics_first
from flce.engine.plans import Plan, PlanRequest
from flce.engine.run import run_backend
from flce.engine.schedule import planned_call
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput
from flce.registry import Backend


def vocab_parallel_linear_cross_entropy(
    flat: FlatInputs, cfg: LCEConfig, backend: Backend, variant: str
) -> torch.Tensor | LCEOutput:
    """The loss (or LCEOutput) of a call whose ``cfg.process_group`` shards the vocabulary.

    ``flat.weight``/``flat.bias`` are this rank's contiguous shard (shards in group-rank order,
    sizes may differ); ``flat.target`` holds global ids; ``cfg.class_weight``, when given, is the
    global ``[V]`` vector, the same on every rank. ``backend`` is an engine backend
    (flce.registry.dispatch chose it); ``variant`` ("plain" or "full") only matters for a group
    of one rank, which runs exactly the unsharded path. Under torch.compile the call is the
    custom op, which carries the group by name and runs :func:`sharded_call` inside.
    """
    group = cfg.process_group
    if group_size(group) == 1:
        return _single_rank(flat, cfg, backend, variant)
    if torch.compiler.is_compiling():
        # The shard's scan is the "full" variant's: only it produces combinable statistics.
        return apply_op(backend.name, flat, cfg, "full")
    training = needs_autograd(flat)
    return apply_eager(flat, sharded_call(flat, cfg, backend, training, training and flat.hidden.requires_grad))


def sharded_call(flat: FlatInputs, cfg: LCEConfig, backend: Backend, training: bool,
                 needs_grad_hidden: bool) -> EngineCall:
    """The backend's kernels and a plan every rank shares, with the Sharding that combines row
    statistics and completes grad_hidden: for the eager Function and inside the custom op."""
    group = cfg.process_group
    if checks.debug_checks_enabled():
        # Before the layout exchange: its collective is skipped on ranks that have it cached.
        checks.check_ranks_agree(flat, cfg, needs_grad_hidden, group)
    shard = vocab_shard(group, flat.weight)
    checks.check_target_range(flat.target, shard.global_vocab, cfg.ignore_index)
    checks.check_class_weight(cfg, shard.global_vocab)
    request = PlanRequest(training=training, sharded=True, statistics_first=needs_statistics_first(flat))
    own = planned_call(backend, flat, cfg, "full", request)
    plan = _agreed_plan(backend, own.plan, flat, cfg, shard, request)
    # The shard-local scan is the "full" variant's: only it produces combinable statistics.
    return replace(own.with_plan(plan), plain=False, sharding=Sharding(
        vocab_offset=shard.offset,
        global_vocab=shard.global_vocab,
        combine=functools.partial(collectives.combine_row_stats, group=group),
        # Each rank's grad_hidden covers its shard; their sum is the full gradient: the call's one gradient
        # collective, started beside the last weight-gradient product (engine.call.Sharding).
        start_grad_hidden_reduce=functools.partial(collectives.start_all_reduce_, op=dist.ReduceOp.SUM, group=group),
    ))


def _agreed_plan(backend: Backend, own: Plan, flat: FlatInputs, cfg: LCEConfig, shard: VocabShard,
                 request: PlanRequest) -> Plan:
    """A plan every rank computes identically.

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
    return planned_call(backend, stand_in, cfg, "full", request).plan


def _single_rank(flat: FlatInputs, cfg: LCEConfig, backend: Backend, variant: str) -> torch.Tensor | LCEOutput:
    """A group of one rank holds the whole vocabulary: exactly the unsharded path."""
    cfg = cfg.replace(process_group=None)
    # prepare_inputs skipped the range check because a group was set; the shard is the vocabulary here.
    checks.check_target_range(flat.target, flat.weight.shape[0], cfg.ignore_index)
    return run_backend(backend, flat, cfg, variant)


# The compile path's ops rebuild a vocab-parallel call from its group name through this.
register_sharded_call(sharded_call)
