"""FSDP2 (``fully_shard``) parameters met outside their unit's forward, on a 1-D or N-D mesh.

FSDP2 keeps a parameter as a DTensor on its "SPMD mesh": the data-parallel dimensions first (HSDP's
replicate dimension, then the dimension FSDP2 shards over), then the dimensions the parameter
already had as a DTensor before ``fully_shard`` (tensor parallelism: torchtitan applies TP, then
FSDP2 over the ``dp`` mesh). A TP-sharded head weight on a ``(dp, tp)`` mesh is thus
``(_StridedShard(0), Shard(0))``.

flce gathers such a parameter over the data-parallel dimensions only, in the parameter dtype of
the unit's ``MixedPrecisionPolicy``; what remains is this rank's tensor-parallel shard (or the
whole weight without TP). Its gradient goes back as FSDP2's own post-backward sends it: cast to
the policy's reduce dtype, reduce-scattered with the mean over the data-parallel ranks (FSDP2's
default), and cast to the parameter's dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Fsdp2Layout:
    """How FSDP2 holds one parameter: which mesh dimensions are data-parallel, and the dtypes of
    its unit's mixed-precision policy (None: the parameter's own)."""

    data_parallel_dims: tuple[int, ...]
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


# id(param) -> (a weak reference to it, its layout or None when no FSDP2 module manages it). Keyed by
# id with a callback that drops the entry: a WeakKeyDictionary would compare tensors with ==, elementwise.
_layouts: dict[int, tuple[weakref.ref, Fsdp2Layout | None]] = {}


def fsdp2_layout(param: Any) -> Fsdp2Layout | None:
    """The layout of ``param`` if it is a parameter of a ``fully_shard`` module, else None.

    A vocab-sharded weight and an FSDP2-sharded one are both DTensors sharded on dim 0; they differ
    in what the other ranks hold (the same tokens, or other tokens), which only FSDP2's own
    bookkeeping tells: the modules it manages are found through torch's registry of composable
    states, and their parameters compared by identity.
    """
    key = id(param)
    known = _layouts.get(key)
    if known is not None and known[0]() is param:
        return known[1]
    layout = None
    for module in _fsdp2_modules():
        if any(param is p for p in module.parameters()):
            layout = Fsdp2Layout(_data_parallel_dims(param.placements), *_mixed_precision(module, param))
            break
    _layouts[key] = (weakref.ref(param, lambda _, key=key: _layouts.pop(key, None)), layout)
    return layout


def _fsdp2_modules() -> list[torch.nn.Module]:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    return [module for module in list(_module_state_mapping.keys()) if isinstance(module, FSDPModule)]


def _data_parallel_dims(placements: tuple[Any, ...]) -> tuple[int, ...]:
    """FSDP2's dimensions lead: HSDP's replicated ones, then the one it shards over (``Shard`` or,
    where tensor parallelism shards the same tensor dimension after it, ``_StridedShard``). A
    parameter with no sharded dimension (replicated data parallelism) is data-parallel on all."""
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():
            return tuple(range(dim + 1))
    return tuple(range(len(placements)))


def _mixed_precision(module: torch.nn.Module, param: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of the ``MixedPrecisionPolicy`` of the FSDP2 parameter group that
    holds ``param`` (None: the parameter's own dtype, and the compute dtype for the reduction, as
    FSDP2 reads them); (None, None) where FSDP2's per-module state cannot be read."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    # torch >= 2.12 may hold several parameter groups per module; earlier versions one.
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    for group in groups:
        if any(getattr(p, "sharded_param", None) is param for p in getattr(group, "fsdp_params", ())):
            policy = getattr(group, "mp_policy", None)
            return getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
    return None, None


class _GatherOverDataParallel(torch.autograd.Function):
    """Forward: cast to the policy's parameter dtype and all-gather over the data-parallel dimensions;
    the local result is this rank's model-parallel part. Backward: FSDP2's reduce-scatter (module
    docstring)."""

    @staticmethod
    def forward(ctx, param: Any, layout: Fsdp2Layout) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        mesh = param.device_mesh
        ctx.layout, ctx.spec = layout, (mesh, param.placements, param.dtype, param.shape, param.stride())
        compute = param if layout.param_dtype in (None, param.dtype) else param.to(layout.param_dtype)
        gathered = [Replicate() if d in layout.data_parallel_dims else p for d, p in enumerate(param.placements)]
        return _redistributed(compute, gathered, via=[Replicate()] * mesh.ndim).to_local()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh, placements, dtype, shape, stride = ctx.spec
        layout = ctx.layout
        partial = [Partial("avg") if d in layout.data_parallel_dims else p for d, p in enumerate(placements)]
        reduced = DTensor.from_local(grad.to(layout.reduce_dtype or grad.dtype), mesh, partial, shape=shape,
                                     stride=stride)
        averaged = [Replicate() if d in layout.data_parallel_dims else p for d, p in enumerate(placements)]
        return _redistributed(reduced, list(placements), via=averaged).to(dtype), None


def _redistributed(tensor: Any, placements: list[Any], via: list[Any]) -> Any:
    """``tensor`` redistributed to ``placements``; where this torch cannot do that in one go (FSDP2 x TP's
    ``_StridedShard`` has gained redistribution rules release by release), through ``via`` (Replicate on
    the dimensions involved, from which any placement is a local slice), at the cost of an all-gather or
    all-reduce in place of a reduce-scatter. A refusal depends on the placements alone, so every rank
    refuses at the same point and takes the same route."""
    mesh = tensor.device_mesh
    try:
        return tensor.redistribute(mesh, placements)
    except (NotImplementedError, AssertionError, ValueError):
        return tensor.redistribute(mesh, via).redistribute(mesh, placements)


def gather_over_data_parallel(param: Any, layout: Fsdp2Layout) -> torch.Tensor:
    """This rank's model-parallel part of an FSDP2 parameter, differentiable (module docstring)."""
    return _GatherOverDataParallel.apply(param, layout)
