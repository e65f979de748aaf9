"""The checks on a policy loss's per-token tensors, and their flattening to the call's rows: done before any
kernel runs, errors naming the argument, its value and what was expected.

Two layouts: padded (``target`` [B, T], every sequence a row of T tokens; ``advantages`` [B] or [B, T]) and
packed (``target`` [N] with ``sequence_ids`` [N], as verl's remove-padding path; ``advantages`` [N], one per
token: pass ``advantages[sequence_ids]`` for one per sequence).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flce.policy.semantics import SequenceLayout


class FlatPolicyTensors(NamedTuple):
    """A call's per-token policy tensors flattened to [N] in the statistics dtype (None where not given)."""

    mask: torch.Tensor  # the tokens' weights, 0 where a token does not count (masked, or its target ignored)
    advantage: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    rollout: torch.Tensor | None
    layout: SequenceLayout
    per_sequence_advantages: bool  # one advantage per sequence (TRL reports its clip ratios over sequences)


def flatten_policy_tensors(
    target: torch.Tensor, advantages: object, mask: object, *, old_logprobs: object, ref_logprobs: object,
    rollout_is_ratio: object, sequence_ids: object, ignore_index: int, dtype: torch.dtype,
) -> FlatPolicyTensors:
    """The checked, flattened tensors of a call whose ``target`` passed flce.inputs' checks (its shape pairs with
    hidden's); ``dtype``: the statistics dtype."""
    packed = sequence_ids is not None
    if packed:
        _check_tensor("sequence_ids", sequence_ids, target, integer=True)
        if target.dim() != 1:
            raise ValueError(f"target: has shape {tuple(target.shape)} with sequence_ids (the packed form); expected "
                             "[N], one row per token, with hidden [N, H]")
        ids = sequence_ids.reshape(-1).long()
        _check_ids(ids)
        layout = SequenceLayout(ids, None)
    else:
        if target.dim() != 2:
            raise ValueError(f"target: has shape {tuple(target.shape)}; expected [B, T] with hidden [B, T, H] (the "
                             "padded form), or [N] with hidden [N, H] and sequence_ids [N] (the packed form)")
        layout = SequenceLayout(None, target.shape[1])
    _check_tensor("mask", mask, target, integer=None)
    if mask.is_complex():
        raise TypeError(f"mask: expected a bool, integer or floating tensor, got dtype {mask.dtype}")
    counted = (target != ignore_index) & (mask != 0)
    flat_mask = torch.where(counted, mask.to(dtype), 0.0).reshape(-1)
    per_sequence = not packed and isinstance(advantages, torch.Tensor) and advantages.dim() == 1
    if per_sequence:
        _check_constant("advantages", advantages)
        if advantages.shape[0] != target.shape[0] or not advantages.is_floating_point():
            raise ValueError(f"advantages: has shape {tuple(advantages.shape)}, dtype {advantages.dtype}; expected "
                             f"floating [B={target.shape[0]}] (one per sequence) or [B, T] = {tuple(target.shape)}")
        _check_device("advantages", advantages, target)
        advantage = advantages.to(dtype)[:, None].expand(target.shape).reshape(-1)
    else:
        advantage = _flat("advantages", advantages, target, dtype)
    return FlatPolicyTensors(
        mask=flat_mask, advantage=advantage,
        old=None if old_logprobs is None else _flat("old_logprobs", old_logprobs, target, dtype),
        ref=None if ref_logprobs is None else _flat("ref_logprobs", ref_logprobs, target, dtype),
        rollout=None if rollout_is_ratio is None else _flat("rollout_is_ratio", rollout_is_ratio, target, dtype),
        layout=layout, per_sequence_advantages=per_sequence)


def _flat(name: str, value: object, target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _check_tensor(name, value, target, integer=False)
    _check_constant(name, value)
    return value.reshape(-1).to(dtype)


def _check_tensor(name: str, value: object, target: torch.Tensor, integer: bool | None) -> None:
    """A tensor of target's shape, on its device; integer: its dtype's kind (None: any real)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.shape != target.shape:
        raise ValueError(f"{name}: has shape {tuple(value.shape)}; expected the target's shape {tuple(target.shape)}")
    if integer is True and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
    if integer is False and not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")
    _check_device(name, value, target)


def _check_device(name: str, value: torch.Tensor, target: torch.Tensor) -> None:
    if value.device != target.device:
        raise ValueError(f"{name} is on {value.device} but target is on {target.device}; expected all tensors on "
                         "one device")


def _check_constant(name: str, value: torch.Tensor) -> None:
    if value.requires_grad:
        raise ValueError(f"{name} requires grad, but the policy loss takes it as a constant (no gradient flows to "
                         f"it); pass {name}.detach()")


def _check_ids(ids: torch.Tensor) -> None:
    """Sequence ids index a buffer of one slot per row: each in [0, N). Checked on the host for CPU tensors, by a
    device-side assertion elsewhere (no host synchronisation)."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= ids.shape[0])
    message = f"sequence_ids: expected values in [0, N={ids.shape[0]}), one index per sequence"
    if ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise ValueError(f"{message}; got {int(ids[bad][0])}")
    else:
        torch._assert_async(~bad.any(), message)
