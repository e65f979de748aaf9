"""Where this rank's vocabulary shard sits in the global vocabulary.

Shards are contiguous and in group-rank order; their sizes may differ. The
sizes are exchanged once per (group, shard size, hidden size) with one small
all_gather and cached, so steady-state calls cost no collective and no host
synchronisation for the layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flce.distributed import collectives
from flce.errors import InputError, InputTypeError


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[offset, offset + size)`` of a ``global_vocab``-wide vocabulary."""

    rank: int  # rank within the group
    world_size: int
    sizes: tuple[int, ...]  # shard size of every group rank, in rank order
    hidden_size: int

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def global_vocab(self) -> int:
        return sum(self.sizes)


# group -> {(shard size, hidden size): VocabShard}. Weak keys: a destroyed group's entries go with it.
_cache: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], VocabShard]] = weakref.WeakKeyDictionary()


def group_size(group: Any) -> int:
    """World size of ``group``, with an error that names the option when it is not a usable group."""
    if dist.is_available() and not isinstance(group, dist.ProcessGroup):
        raise InputTypeError(
            f"process_group={group!r}: expected a torch.distributed ProcessGroup (e.g. from "
            f"torch.distributed.new_group) or None, got {type(group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"process_group={group!r}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (or pass process_group=None)"
        )
    try:
        return dist.get_world_size(group=group)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InputError(f"process_group={group!r}: not a usable torch.distributed group ({exc})") from None


def vocab_shard(group: Any, weight: torch.Tensor) -> VocabShard:
    """The layout of the vocabulary over ``group``; ``weight`` is this rank's ``[V_shard, H]`` shard.

    The first call for a (group, shard size, hidden size) exchanges every rank's
    (shard size, hidden size) and checks that the hidden sizes agree, so a
    mismatch is caught without a collective on later calls.
    """
    local_vocab, hidden_size = int(weight.shape[0]), int(weight.shape[1])
    per_group = _cache.get(group)
    if per_group is None:
        per_group = {}
        _cache[group] = per_group
    key = (local_vocab, hidden_size)
    shard = per_group.get(key)
    if shard is None:
        shard = _exchange_layout(group, local_vocab, hidden_size, weight.device)
        per_group[key] = shard
    return shard


def _exchange_layout(group: Any, local_vocab: int, hidden_size: int, device: torch.device) -> VocabShard:
    rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    mine = torch.tensor([local_vocab, hidden_size], dtype=torch.int64, device=device)
    gathered = collectives.all_gather_small(mine, group)
    sizes = tuple(int(v) for v in gathered[:, 0].tolist())
    hidden_sizes = [int(v) for v in gathered[:, 1].tolist()]
    if len(set(hidden_sizes)) != 1:
        listing = ", ".join(f"rank {r}: H={h}" for r, h in enumerate(hidden_sizes))
        raise InputError(
            f"weight: hidden sizes differ across the ranks of process_group ({listing}); expected every "
            "rank's weight shard to be [V_shard, H] with the same H"
        )
    empty = [r for r, size in enumerate(sizes) if size == 0]
    if empty:
        raise InputError(
            f"weight: ranks {empty} of process_group hold an empty vocabulary shard (sizes {list(sizes)}); "
            "expected every rank to hold at least one vocabulary row"
        )
    return VocabShard(rank=rank, world_size=world_size, sizes=sizes, hidden_size=hidden_size)


def clear_cache() -> None:
    """Forget every cached layout (tests; or after re-sharding a model in place)."""
    _cache.clear()
