"""Megatron-core's own vocab-parallel head and cross-entropy, as a peer for tools/distributed/vocab_parallel.py.

What Megatron runs for a ColumnParallelLinear head without sequence parallelism: the hidden states
through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of their gradient in
backward), this rank's ``[V/tp, H]`` logits in the compute dtype, ``vocab_parallel_cross_entropy``
(fp32 inside), and a loss mask for the ignored tokens (Megatron's cross-entropy has no ignore_index).
Megatron pads the vocabulary to a multiple of ``128 x tp`` so that every shard has the same size;
the peer does the same (its padded rows take part in the softmax, as they do in Megatron), so it is a
peer for time and memory, not for the loss value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by


def available() -> tuple[bool, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import __version__
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region  # noqa: F401
    except ImportError as exc:
        return False, f"megatron-core is not importable ({exc})"
    return True, f"megatron-core {__version__}"


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def step(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor, ignore_index: int,
         group: Any) -> Callable[[], None]:
    """One forward + backward of Megatron's head and mean loss over the non-ignored tokens (leaves'
    gradients set to None before each call)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy

    mask = (target != ignore_index).float()
    labels = torch.where(target == ignore_index, torch.zeros_like(target), target)
    count = mask.sum().clamp_min(1)
    x = hidden.detach().requires_grad_()
    w = weight_shard.detach().requires_grad_()

    def go() -> None:
        x.grad, w.grad = None, None
        logits = copy_to_tensor_model_parallel_region(x, group=group) @ w.t()
        loss = (vocab_parallel_cross_entropy(logits, labels, tp_group=group) * mask).sum() / count
        loss.backward()

    return go
