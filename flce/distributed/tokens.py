"""Tokens sharded across ranks, the weight whole on each (context / sequence parallelism of the loss).

Each rank runs flce on its own tokens with ``reduction="sum"``; the mean over all ranks' tokens then
needs the global divisor, which no rank has: the count of non-ignored tokens (with class weights,
the sum of their targets' weights). :func:`token_sharded_mean` all-reduces it, divides, and returns
the global mean on every rank, with a gradient that flows into this rank's tokens only. Averaging
each rank's own mean instead would weigh a rank's tokens by how many of its tokens are ignored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flce.distributed import collectives
from flce.errors import InputError
from flce.inputs import check_targets

GRADIENT_REDUCTIONS = ("mean", "sum")


def token_sharded_mean(loss_sum: torch.Tensor, target: torch.Tensor, group: Any, *, ignore_index: int = -100,
                       class_weight: torch.Tensor | None = None, z_loss_sum: torch.Tensor | None = None,
                       gradient_reduction: str = "mean") -> torch.Tensor:
    """The mean over every rank's tokens of ``group``, from this rank's ``reduction="sum"`` loss.

    ``loss_sum``: this rank's scalar sum (flce with ``reduction="sum"``), ``target`` its targets.
    ``class_weight`` (the ``[V]`` vector of the call) makes it a weighted mean, as torch's
    ``cross_entropy`` does: the divisor is the sum of the non-ignored targets' weights. flce's mean
    divides a z-loss by the token count instead, which a summed scalar cannot split off: with
    ``class_weight``, pass the call's ``z_loss_sum`` (``return_z_loss=True``), which must be 0 (no
    ``lse_square_scale``); it is checked on the device. Weights whose sum over the non-ignored targets is
    negative, zero or NaN divide as torch's weighted mean does (a negative mean, inf or NaN); a target outside
    ``[0, V)`` that is not ``ignore_index`` raises (a device-side assertion on an accelerator). No non-ignored
    token on any rank: 0, with zero gradients (flce's ``mean``).

    The value is the same on every rank. Its gradient is this rank's part of the global mean's:
    the weight's gradients of the ranks add up to the global one. ``gradient_reduction="mean"``
    (DDP, FSDP2 over these ranks) multiplies the gradient by the group's size, so that the average
    those frameworks take is that sum; ``"sum"`` leaves it for a caller who sums the gradients itself.
    Two all-reduces: the divisor and the value (one number each).
    """
    if gradient_reduction not in GRADIENT_REDUCTIONS:
        raise InputError(f"gradient_reduction={gradient_reduction!r}: expected one of {GRADIENT_REDUCTIONS}")
    if loss_sum.dim() != 0:
        raise InputError(f"loss_sum: expected the scalar of a reduction='sum' call, got shape {tuple(loss_sum.shape)}")
    dtype = torch.float64 if loss_sum.dtype == torch.float64 else torch.float32
    flat = target.reshape(-1)
    valid = flat != ignore_index
    count = valid.sum().to(dtype)
    if class_weight is None:
        weight_sum = count
    else:
        if z_loss_sum is None:
            raise InputError("z_loss_sum=None with class_weight: pass the z_loss of the same call made with "
                             "return_z_loss=True (a z-loss cannot be divided by the token count from a sum)")
        torch._assert_async(z_loss_sum == 0, "token_sharded_mean: class_weight together with a z-loss "
                            "(lse_square_scale > 0) is not supported; the z-loss's divisor is the token count")
        check_targets(flat, class_weight.shape[0], ignore_index)
        # A select, not a product with the mask: an ignored token's weight (NaN, say) must not reach the sum.
        weights = class_weight.to(dtype)[torch.where(valid, flat, 0).long()]
        weight_sum = torch.where(valid, weights, torch.zeros_like(weights)).sum()
    # One all-reduce for both: whether any rank counted a token (flce's mean: 0 where none did) and the divisor
    # (the weights' sum as torch's weighted mean takes it: negative, zero or NaN included).
    count, weight_sum = collectives.all_reduce_(torch.stack([count, weight_sum]), dist.ReduceOp.SUM, group)
    counted = count > 0
    divisor = torch.where(counted, weight_sum, torch.ones_like(weight_sum))
    partial = torch.where(counted, loss_sum.to(dtype) / divisor, torch.zeros((), dtype=dtype, device=divisor.device))
    value = collectives.all_reduce_(partial.detach().clone(), dist.ReduceOp.SUM, group)
    scale = dist.get_world_size(group=group) if gradient_reduction == "mean" else 1
    # Forward: the global mean; backward: scale x this rank's part.
    return value + scale * (partial - partial.detach())
