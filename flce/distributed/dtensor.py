"""Weights that a parallelism framework holds in its own form, met at the entry of every call.

flce's kernels take plain tensors. A training framework may hand over something else:

* a **DTensor sharded on the vocabulary** (tensor parallelism through ``parallelize_module``, e.g.
  ``ColwiseParallel`` on the output layer): its local shard goes to the vocab-parallel path with
  the mesh's process group; the weight's gradient comes back as a DTensor with the same placements;
* a **replicated DTensor**: its local tensor is the whole weight;
* an **FSDP2-sharded parameter** (``fully_shard``) used outside its module's forward, where FSDP2
  has not gathered it: it is all-gathered for the call, and its gradient is reduce-scattered back
  to the parameter's placement with FSDP2's default reduction (the mean over the data-parallel
  ranks), so the parameter's ``.grad`` is what FSDP2 itself would have produced;
* a **partitioned parameter that is not a DTensor** (DeepSpeed ZeRO-3 outside the owner's forward,
  an FSDP1 flat parameter or a sharded view of one): refused before any compute, saying how to
  call flce instead.

``hidden`` may be a DTensor on the weight's mesh: replicated, or sharded over tokens (sequence
parallelism), which is all-gathered; its gradient comes back in its own placement (flce's
``grad_hidden`` is already complete on every rank, so the backward only keeps this rank's part).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from flce.config import LCEConfig

# (hidden, weight, target, bias, config) of one call.
CallInputs = tuple[Any, Any, Any, Any, LCEConfig]


def localize_inputs(hidden: Any, weight: Any, target: Any, bias: Any, cfg: LCEConfig) -> CallInputs:
    """Plain tensors (and the config, with the mesh's group when the weight is vocab-sharded) for one call.

    Arguments that are not tensors pass through unchanged: :func:`flce.inputs.prepare_inputs`
    names them in its error.
    """
    check_not_partitioned("weight", weight, expected_dim=2)
    check_not_partitioned("bias", bias, expected_dim=1)
    # No DTensor can exist before torch.distributed.tensor is imported; importing it here would
    # add its import time to every `import flce`.
    if "torch.distributed.tensor" not in sys.modules:
        return hidden, weight, target, bias, cfg
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in (hidden, weight, target, bias)):
        return hidden, weight, target, bias, cfg
    if not isinstance(weight, DTensor):
        names = [n for n, t in (("hidden", hidden), ("bias", bias)) if isinstance(t, DTensor)]
        if names:
            raise TypeError(
                f"{names[0]} is a DTensor (placements {_placements(hidden if names[0] == 'hidden' else bias)}) "
                "but weight is a plain tensor; expected both as DTensors on one mesh, or both plain"
            )
        return hidden, weight, _plain_target(target), bias, cfg
    if cfg.process_group is not None:
        raise ValueError(
            f"process_group={cfg.process_group!r}: weight is a DTensor (placements {_placements(weight)}), whose "
            "device mesh already names the group; pass process_group=None"
        )
    if is_fsdp2_sharded(weight):
        return _fsdp2_call(hidden, weight, target, bias, cfg)
    return _tensor_parallel_call(hidden, weight, target, bias, cfg)


# --------------------------------------------------------------------------- partitioned, not DTensors

def check_not_partitioned(name: str, tensor: Any, expected_dim: int) -> None:
    """Refuse a DeepSpeed ZeRO-3 parameter that is not gathered, and FSDP1 flat/sharded parameters."""
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return
    ds_shape = getattr(tensor, "ds_shape", None)
    if getattr(tensor, "ds_id", None) is not None and ds_shape is not None and tuple(tensor.shape) != tuple(ds_shape):
        status = getattr(tensor, "ds_status", None)
        status = getattr(status, "name", status)
        raise ValueError(
            f"{name}: a DeepSpeed ZeRO-3 partitioned parameter that is not gathered (ds_status={status}, "
            f"local shape {tuple(tensor.shape)}, ds_shape={tuple(ds_shape)}); call flce inside the forward of "
            "the module that owns it, where ZeRO-3 gathers it (from another module's forward, first "
            "deepspeed.zero.register_external_parameter(module, param))"
        )
    if getattr(tensor, "_is_flat_param", False):
        raise ValueError(
            f"{name}: an FSDP1 FlatParameter (shape {tuple(tensor.shape)}, the module's parameters flattened "
            "together); pass the original parameter (use_orig_params=True), inside the forward of the "
            "FullyShardedDataParallel module that owns it, where FSDP gathers it"
        )
    if getattr(tensor, "_fsdp_flattened", False) and (tensor.dim() != expected_dim or tensor.numel() == 0):
        raise ValueError(
            f"{name}: a parameter managed by FSDP1 (FullyShardedDataParallel) in its sharded state (shape "
            f"{tuple(tensor.shape)}); call flce inside the forward of the FSDP module that owns it, where FSDP "
            "gathers it and reduces its gradient"
        )


# --------------------------------------------------------------------------- FSDP2

# id(weight) -> (a weak reference to it, whether an FSDP2 module manages it). Keyed by id with a
# callback that drops the entry: a WeakKeyDictionary would compare tensors with ==, elementwise.
_fsdp2_answers: dict[int, tuple[weakref.ref, bool]] = {}


def is_fsdp2_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a parameter of a ``fully_shard`` module (FSDP2).

    A vocab-sharded weight and an FSDP2-sharded one are both DTensors sharded on dim 0; they
    differ in what the other ranks hold (the same tokens, or other tokens), which only FSDP2's own
    bookkeeping tells: the modules it manages are found through torch's registry of composable
    states, and their parameters compared by identity.
    """
    key = id(weight)
    known = _fsdp2_answers.get(key)
    if known is not None and known[0]() is weight:
        return known[1]
    answer = any(weight is p for module in _fsdp2_modules() for p in module.parameters())
    _fsdp2_answers[key] = (weakref.ref(weight, lambda _, key=key: _fsdp2_answers.pop(key, None)), answer)
    return answer


def _fsdp2_modules() -> list[torch.nn.Module]:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    return [module for module in list(_module_state_mapping.keys()) if isinstance(module, FSDPModule)]


def _fsdp2_call(hidden: Any, weight: Any, target: Any, bias: Any, cfg: LCEConfig) -> CallInputs:
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        raise TypeError(
            f"hidden is a DTensor (placements {_placements(hidden)}) but weight is an FSDP2-sharded parameter; "
            "expected hidden as a plain tensor of this rank's tokens"
        )
    return hidden, _fsdp2_unshard("weight", weight), _plain_target(target), _fsdp2_unshard("bias", bias), cfg


def _fsdp2_unshard(name: str, param: Any) -> Any:
    """All-gather an FSDP2 parameter; its gradient goes back reduce-scattered, averaged over the ranks.

    The mean is FSDP2's default gradient reduction: each rank's gradient is of its own tokens'
    loss, and the parameter's ``.grad`` then equals what FSDP2's post-backward would have stored.
    """
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(param, DTensor):
        return param
    shards = [p for p in param.placements if not p.is_replicate()]
    if len(shards) != 1 or not shards[0].is_shard():
        raise NotImplementedError(
            f"{name}: an FSDP2 parameter with placements {_placements(param)} on a {param.device_mesh.ndim}-D mesh "
            "(FSDP2 combined with tensor parallelism); call flce inside the forward of the fully_shard module "
            "that owns it, where FSDP2 gathers it over the data-parallel mesh"
        )
    return param.full_tensor(grad_placements=[Partial("avg")] * param.device_mesh.ndim)


# --------------------------------------------------------------------------- tensor parallelism

def _tensor_parallel_call(hidden: Any, weight: Any, target: Any, bias: Any, cfg: LCEConfig) -> CallInputs:
    from torch.distributed.tensor import DTensor

    mesh = weight.device_mesh
    placement = weight.placements[0] if mesh.ndim == 1 else None
    if placement is None or not (placement.is_replicate() or placement.is_shard(0)):
        raise ValueError(
            f"weight: a DTensor with placements {_placements(weight)} on a {mesh.ndim}-D mesh; expected Shard(0) "
            "(vocabulary-parallel) or Replicate() on a 1-D mesh"
        )
    if bias is not None:
        if not isinstance(bias, DTensor) or bias.device_mesh != mesh or tuple(bias.placements) != (placement,):
            got = f"placements {_placements(bias)}" if isinstance(bias, DTensor) else "a plain tensor"
            raise ValueError(f"bias: {got}; expected a DTensor on the weight's mesh with placements ({placement},)")
        bias = bias.to_local()
    hidden = _replicated_hidden(hidden, mesh)
    group = mesh.get_group() if placement.is_shard() else None
    if group is not None:
        cfg = cfg.replace(process_group=group)
    # to_local's backward wraps the local gradient in the weight's own placements.
    return hidden, weight.to_local(), _plain_target(target), bias, cfg


def _replicated_hidden(hidden: Any, mesh: Any) -> Any:
    """Every rank's full hidden states; a token-sharded DTensor (sequence parallelism) is all-gathered."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(hidden, DTensor):
        return hidden
    if hidden.device_mesh != mesh:
        raise ValueError(
            f"hidden: a DTensor on mesh {hidden.device_mesh} but weight is on mesh {mesh}; expected one mesh"
        )
    placement = hidden.placements[0]
    token_dims = hidden.dim() - 1
    if not (placement.is_replicate() or (placement.is_shard() and placement.dim < token_dims)):
        raise ValueError(
            f"hidden: a DTensor with placements {_placements(hidden)}; expected Replicate() or Shard(d) over a "
            f"token dimension d < {token_dims} (sequence parallelism)"
        )
    # flce's grad_hidden is complete on every rank (Replicate), so the gather's backward only keeps
    # this rank's part of it, with no further reduction.
    return hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Replicate()])


def _plain_target(target: Any) -> Any:
    """Targets carry no gradient: a DTensor of them is gathered whole."""
    from torch.distributed.tensor import DTensor

    return target.full_tensor() if isinstance(target, DTensor) else target


def _placements(tensor: Any) -> str:
    return "(" + ", ".join(str(p) for p in tensor.placements) + ")"
