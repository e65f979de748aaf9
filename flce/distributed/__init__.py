"""Vocab-parallel (tensor-parallel) linear cross-entropy over torch.distributed.

Pass ``process_group=`` to any flce loss: ``weight``/``bias`` are then this rank's contiguous
vocabulary shard and the loss equals the unsharded one on every rank. docs/distributed.md
describes the collectives and how to call it from a Megatron-style ColumnParallelLinear head.
Tokens sharded across ranks with the whole weight on each (context parallelism):
:func:`token_sharded_mean` turns each rank's summed loss into the global mean.
"""

from flce.distributed import distillation  # noqa: F401  (registers the compile path's sharded distillation)
from flce.distributed.checks import DISTRIBUTED_CHECKS_ENV
from flce.distributed.collectives import CollectiveRecord, payload_bytes_per_step, record_collectives
from flce.distributed.function import vocab_parallel_linear_cross_entropy
from flce.distributed.shards import VocabShard, clear_cache, vocab_shard
from flce.distributed.tokens import token_sharded_mean

__all__ = [
    "DISTRIBUTED_CHECKS_ENV",
    "CollectiveRecord",
    "VocabShard",
    "clear_cache",
    "payload_bytes_per_step",
    "record_collectives",
    "token_sharded_mean",
    "vocab_parallel_linear_cross_entropy",
    "vocab_shard",
]
