"""verl drop-in: ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` through flce.

    from flce.integrations.verl import linear_cross_entropy
    log_probs, entropy = linear_cross_entropy(hidden_states, lm_head.weight, labels, temperature, "none")

verl (0.9.1) computes the PPO actor's per-token log-probabilities and entropy with a Triton
kernel that needs CUDA, contiguous inputs and a hidden size that is a multiple of 128; its
Hugging Face models call it from ``forward_with_triton_backend`` and its Megatron models from
``model_forward_fused``. This function has the same signature and returns the same tensors,
computed by flce's registry (so on the CPU, CUDA, Ascend, any hidden size, any strides):

- ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (or this rank's vocabulary shard), ``labels``
  ``[...]`` with one global token id per position of ``hidden``.
- Returns ``(logprobs, entropy)``, both 1-D ``[N]`` with ``N`` the number of tokens (hidden's
  leading dimensions flattened, as verl's kernel returns them), float32 (float64 for float64
  inputs, which verl's kernel does not take). ``logprobs[i] = log softmax(z_i)[labels[i]]`` and
  ``entropy[i] = -sum_v p_iv log p_iv`` with ``z = hidden @ weight.T / temperature``.
- ``reduction``: ``"none"`` gives per-token log-probs; ``"sum"`` / ``"mean"`` give their sum /
  mean over the ``N`` tokens as a 0-d tensor, as verl's kernel does; ``entropy`` stays per token.
  Case-insensitive, as verl's.
- Gradients flow from both outputs, with any upstream gradient, into ``hidden`` and ``weight``
  (in their dtypes).
- ``dist_process_group`` (tensor parallelism): ``weight`` is this rank's contiguous vocabulary
  shard, shards in rank order; ``labels`` hold global ids. ``logprobs`` and ``entropy`` are the
  full-vocabulary values on every rank, and ``weight``'s gradient is this rank's rows of the full
  gradient. ``hidden``'s gradient differs per rank from verl's but sums to the same: verl's
  kernel returns this rank's partial gradient (its shard's contribution) and leaves the sum over
  the group to the caller (``gather_from_sequence_parallel_region`` before the call, whose
  backward reduce-scatters); flce completes the gradient itself (one all-reduce of ``N x H``),
  so this function hands every rank ``1 / world_size`` of it and the caller's sum is the full
  gradient, as with verl's kernel.
- Labels: verl's kernel leaves a label outside ``[0, V)`` undefined (its callers roll
  ``input_ids``, so every label is a token). Here ``-100`` gives log-prob 0, entropy 0 and no
  gradient; any other out-of-range label raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import flce
from flce.errors import InputError

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy``: ``(logprobs, entropy)`` of ``hidden @ weight.T / temperature``."""
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise InputError(f"reduction={reduction!r}: expected one of {_REDUCTIONS} (any case)")
    world_size = 1 if dist_process_group is None else dist.get_world_size(dist_process_group)
    if world_size > 1:
        hidden = _ShareGrad.apply(hidden, world_size)
    out = flce.linear_cross_entropy(
        hidden, weight, labels, reduction="none", temperature=temperature, process_group=dist_process_group,
        return_logprobs=True, return_entropy=True,
    )
    logprobs, entropy = out.logprobs.reshape(-1), out.entropy.reshape(-1)
    if reduction.lower() == "sum":
        logprobs = logprobs.sum()
    elif reduction.lower() == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``world_size``: flce's grad_hidden is
    complete on every rank, and verl's callers sum it over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.world_size, None
