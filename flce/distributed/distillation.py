"""Vocab-parallel linear distillation: both heads sharded alike over ``process_group``.

Every rank holds the full student and teacher hidden rows and target, and the same contiguous vocabulary
shard of both heads' weights (and biases). Each rank scans its shard; per token chunk one all-reduce makes
the partial statistics of both softmaxes global, all of them in one tensor: each rank writes its
statistics into its own slot of a zeroed ``[ranks, k, n]`` buffer and the SUM all-reduce leaves every
rank's on every rank (adding zeros is exact), which each rank then merges in rank order, so all ranks hold
bitwise-equal statistics. JSD's second pass needs the global lse first, so its two sums take a second
all-reduce (SUM) per chunk. The gradients of the logits then touch this rank's shard only: grad_weight
and grad_bias are local, grad_hidden (student's, and teacher's where asked) one all-reduce in backward.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import FlatPair, check_vocabulary
from flce.distillation.semantics import PartialPairStats, merge_pair_stats
from flce.distributed import checks, collectives
from flce.distributed.shards import group_size, vocab_shard
from flce.engine.distillation.call import DistillCall, PairSharding
from flce.engine.distillation.custom_ops import apply_op, register_sharded_distillation
from flce.engine.distillation.function import apply_eager, wanted_gradients
from flce.engine.distillation.run import run_distillation
from flce.engine.plans import PlanRequest
from flce.errors import InputError
from flce.registry import Backend


def vocab_parallel_distillation(pair: FlatPair, cfg: DistillationConfig, backend: Backend) -> torch.Tensor:
    """The loss of a call whose ``cfg.process_group`` shards both heads' vocabulary alike (module docstring)."""
    group = cfg.process_group
    if group_size(group) == 1:
        # One rank holds the whole vocabulary: exactly the unsharded call, with its checks.
        check_vocabulary(pair.student_weight.shape[0])
        if pair.target is not None:
            checks.check_target_range(pair.target, pair.student_weight.shape[0], cfg.ignore_index)
        return run_distillation(backend, pair, cfg.replace(process_group=None))
    if torch.compiler.is_compiling():
        return apply_op(backend.name, pair, cfg)
    training = wanted_gradients(pair, cfg.teacher_grad).any
    return apply_eager(pair, sharded_distillation(pair, cfg, backend, training))


def sharded_distillation(pair: FlatPair, cfg: DistillationConfig, backend: Backend, training: bool) -> DistillCall:
    """The backend's kernels and a plan every rank shares, with the PairSharding that combines statistics
    and completes grad_hidden: for the eager Function and inside the custom op."""
    group = cfg.process_group
    shard = vocab_shard(group, pair.student_weight)
    teacher_shard = vocab_shard(group, pair.teacher_weight)  # checks the teacher's hidden size across ranks
    if teacher_shard.sizes != shard.sizes:
        raise InputError(f"teacher_weight: its vocabulary shards {list(teacher_shard.sizes)} differ from the student's "
                         f"{list(shard.sizes)}; expected both heads sharded alike")
    if pair.target is not None:
        checks.check_target_range(pair.target, shard.global_vocab, cfg.ignore_index)
    request = PlanRequest(training=training, sharded=True)
    own = backend.plan_distillation(pair, cfg, request)
    largest = max(shard.sizes)
    plan = own.plan
    if largest != shard.size:
        # Each chunk issues collectives, so every rank cuts the tokens alike: all plan for the largest shard
        # (memory-safe for the smaller ones), from weight views of that size that read no memory.
        stand_in = replace(pair, student_weight=pair.student_weight[:1].expand(largest, -1),
                           teacher_weight=pair.teacher_weight[:1].expand(largest, -1), student_bias=None,
                           teacher_bias=None)
        plan = backend.plan_distillation(stand_in, cfg, request).plan
    return replace(own, plan=plan, sharding=PairSharding(
        vocab_offset=shard.offset,
        combine=functools.partial(combine_pair_stats, cfg=cfg, group=group),
        sum_rows=functools.partial(collectives.all_reduce_, op=dist.ReduceOp.SUM, group=group),
        reduce_grad_hidden=functools.partial(collectives.all_reduce_, op=dist.ReduceOp.SUM, group=group)))


def combine_pair_stats(partial: PartialPairStats, cfg: DistillationConfig, group: object) -> PartialPairStats:
    """Global statistics from every rank's partial ones: one SUM all-reduce of a [ranks, k, n] buffer in which
    each rank fills its own slot, then the merge in rank order (module docstring)."""
    rank, ranks = dist.get_rank(group=group), dist.get_world_size(group=group)
    mine = partial.present()
    # -0.0 becomes +0.0: zeros added to it keep it bitwise (a -0.0 max would come back +0.0 on other ranks).
    slots = torch.zeros(ranks, len(mine), mine[0].shape[0], dtype=mine[0].dtype, device=mine[0].device)
    slots[rank] = torch.stack(mine) + 0.0
    collectives.all_reduce_(slots, dist.ReduceOp.SUM, group)
    merged = partial.like(list(slots[0].unbind(0)))
    for other in range(1, ranks):
        merged = merge_pair_stats(merged, partial.like(list(slots[other].unbind(0))), cfg)
    return merged


# The compile path's ops rebuild a vocab-parallel call from its group name through this.
register_sharded_distillation(sharded_distillation)
