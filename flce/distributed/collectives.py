"""The collectives of a vocab-parallel call, and a recorder that counts their bytes.

Per token chunk of n rows, forward combines the shards' partial row statistics
with two all-reduces (payload bytes, fp32 statistics):

1. MAX of the row maxima: ``4n`` bytes, or ``8n`` when the argmax is needed, because
   the row max and the first index attaining it then travel packed in one int64 key;
2. SUM of one fused buffer holding the rescaled sum-exp, the target logit and,
   when asked, the rescaled sum of ``exp(z - max) * (z - max)`` (entropy) and the weighted
   sum of z (label smoothing): ``4kn`` bytes with k in 2..4.

Backward all-reduces (SUM) the ``[N, H]`` grad of hidden once. Nothing here
depends on the vocabulary size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from flce.config import LCEConfig
from flce.semantics import (
    PartialRowStats,
    moved_to,
    needs_argmax,
    needs_logit_stats,
    needs_sum_exp_dz,
    needs_weighted_sum_z,
)

_TWO_POW_32 = 1 << 32
_INT32_MAGNITUDE = 0x7FFFFFFF


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this process issued: its kind, element count and payload bytes."""

    kind: str  # "all_reduce(MAX)", "all_reduce(SUM)", "all_reduce(MIN)", "all_gather"
    dtype: torch.dtype
    numel: int
    bytes: int


_recorders: list[list[CollectiveRecord]] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Collect a :class:`CollectiveRecord` for every collective flce issues inside the block.

    The payload is what this rank contributes; a ring all-reduce moves about
    ``2 (p - 1) / p`` times that over each rank's link.
    """
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def _record(kind: str, tensor: torch.Tensor) -> None:
    if _recorders:
        entry = CollectiveRecord(kind, tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size())
        for records in _recorders:
            records.append(entry)


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group: Any) -> torch.Tensor:
    """In-place all-reduce over ``group``, recorded; returns ``tensor``."""
    _record(f"all_reduce({_op_name(op)})", tensor)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def start_all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group: Any) -> Callable[[], None]:
    """all_reduce_ started asynchronously (recorded as all_reduce_); returns the wait that completes it. On NCCL
    the wait makes the current stream wait for the collective's, without blocking the host: work issued between
    the start and the wait runs beside the collective."""
    _record(f"all_reduce({_op_name(op)})", tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return work.wait


def all_gather_small(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in group-rank order: ``[world_size, *tensor.shape]``."""
    _record("all_gather", tensor)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def _op_name(op: dist.ReduceOp) -> str:
    for name in ("MAX", "MIN", "SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)


def combine_row_stats(partial: PartialRowStats, group: Any) -> PartialRowStats:
    """The global row statistics from every shard's partial ones (semantics.PartialRowStats).

    Every rank gets the same result: the global row max, sum-exp and sum-exp-dz
    relative to it, the target logit (held by one shard, 0 on the others), the
    weighted sum of z, the argmax as the first global index attaining the max, and (logit
    statistics) the row min and sum of z.
    """
    row_max = partial.row_max + 0.0  # -0.0 becomes +0.0, so equal maxima compare equal bitwise
    argmax = partial.argmax
    if argmax is not None and row_max.dtype == torch.float32:
        global_max, global_argmax = _max_and_first_argmax_packed(row_max, argmax, group)
    else:
        global_max = all_reduce_(row_max.clone(), dist.ReduceOp.MAX, group)
        global_argmax = None
        if argmax is not None:
            # Wider statistics (float64) do not fit a packed key: the shard holding the
            # lowest index among those attaining the global max wins, via MIN.
            candidate = torch.where(row_max == global_max, argmax, torch.iinfo(torch.int64).max)
            global_argmax = all_reduce_(candidate, dist.ReduceOp.MIN, group)

    sum_exp, sum_exp_dz = moved_to(replace(partial, row_max=row_max), global_max)
    parts = [sum_exp, partial.target_z.to(row_max.dtype)]
    if sum_exp_dz is not None:
        parts.append(sum_exp_dz)
    if partial.weighted_sum_z is not None:
        parts.append(partial.weighted_sum_z.to(row_max.dtype))
    if partial.sum_z is not None:
        parts.append(partial.sum_z.to(row_max.dtype))
    fused = all_reduce_(torch.stack(parts), dist.ReduceOp.SUM, group)
    row_min = None if partial.row_min is None else all_reduce_(partial.row_min.clone(), dist.ReduceOp.MIN, group)
    summed = iter(fused.unbind(0))
    sum_exp, target_z = next(summed), next(summed)
    return PartialRowStats(
        row_max=global_max,
        sum_exp=sum_exp,
        target_z=target_z,
        sum_exp_dz=next(summed) if partial.sum_exp_dz is not None else None,
        weighted_sum_z=next(summed) if partial.weighted_sum_z is not None else None,
        argmax=global_argmax,
        row_min=row_min,
        sum_z=next(summed) if partial.sum_z is not None else None,
    )


def order_preserving_key(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [-2**31, 2**31) with ``a < b`` iff ``key(a) < key(b)`` (no NaN)."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    # A negative float's int32 bits grow with its magnitude; flipping the 31 magnitude bits
    # makes them shrink instead, so the keys sort like the values.
    return torch.where(bits < 0, bits ^ _INT32_MAGNITUDE, bits)


def key_to_float(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`order_preserving_key`."""
    bits = torch.where(keys < 0, keys ^ _INT32_MAGNITUDE, keys)
    return bits.to(torch.int32).view(torch.float32)


def pack_max_argmax(row_max: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """One int64 per row whose maximum over ranks is the global max and, among the ranks
    attaining it, the smallest index: the value key in the high 32 bits, ``2**32 - 1 - index``
    in the low 32 bits (indices must be below 2**32)."""
    return order_preserving_key(row_max) * _TWO_POW_32 + (_TWO_POW_32 - 1 - argmax)


def unpack_max_argmax(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.div(packed, _TWO_POW_32, rounding_mode="floor")
    low = packed - keys * _TWO_POW_32
    return key_to_float(keys), (_TWO_POW_32 - 1) - low


def _max_and_first_argmax_packed(
    row_max: torch.Tensor, argmax: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    packed = all_reduce_(pack_max_argmax(row_max, argmax), dist.ReduceOp.MAX, group)
    return unpack_max_argmax(packed)



def payload_bytes_per_step(
    cfg: LCEConfig, tokens: int, hidden_size: int, grad_dtype: torch.dtype | None,
    stats_dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes this rank contributes to the all-reduces of one forward + backward (module docstring).

    With s the statistics' element size (4 for every input dtype but float64) and
    k = 2 + [entropy] + [label smoothing] + 2 [logit stats: the sum of z, and the min of z in an
    all-reduce of its own]: forward sends ``N*s`` (row max; ``8N`` instead when
    the argmax travels packed with it, ``N*s + 8N`` for float64 statistics) plus ``k*N*s``;
    backward sends ``N*H*e`` with e the element size of grad_hidden (``grad_dtype``; None when
    hidden needs no grad). The layout exchange of a first call (``16 * world_size`` bytes)
    is not included. No term depends on the vocabulary.
    """
    s = torch.empty((), dtype=stats_dtype).element_size()
    k = 2 + int(needs_sum_exp_dz(cfg)) + int(needs_weighted_sum_z(cfg)) + 2 * int(needs_logit_stats(cfg))
    if not needs_argmax(cfg):
        max_bytes = tokens * s
    elif stats_dtype == torch.float32:
        max_bytes = tokens * 8
    else:
        max_bytes = tokens * s + tokens * 8
    backward = 0 if grad_dtype is None else tokens * hidden_size * torch.empty((), dtype=grad_dtype).element_size()
    return max_bytes + k * tokens * s + backward
