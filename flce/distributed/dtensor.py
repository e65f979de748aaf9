"""Weights that a parallelism framework holds in its own form, met at the entry of every call.

flce's kernels take plain tensors. A training framework may hand over something else:

* a **DTensor sharded on the vocabulary** (tensor parallelism through ``parallelize_module``, e.g.
  ``ColwiseParallel`` on the output layer): its local shard goes to the vocab-parallel path with
  the mesh's process group; the weight's gradient comes back as a DTensor with the same placements;
* a **replicated DTensor**: its local tensor is the whole weight;
* an **FSDP2-sharded parameter** (``fully_shard``) used outside its module's forward, where FSDP2
  has not gathered it, FSDP2 alone or over a tensor-parallel weight (a 2-D ``(dp, tp)`` mesh): it is
  all-gathered over the data-parallel dimensions in its unit's mixed-precision parameter dtype, and
  its gradient is reduce-scattered back to the parameter's placement as FSDP2 does it (reduce dtype,
  mean over the data-parallel ranks), so the parameter's ``.grad`` is what FSDP2 itself would have
  produced (:mod:`flce.distributed.fsdp2`); a tensor-parallel ``Shard(0)`` left after that gather
  goes to the vocab-parallel path with that mesh dimension's group;
* a **partitioned parameter that is not a DTensor** (DeepSpeed ZeRO-3 outside the owner's forward,
  an FSDP1 flat parameter or a sharded view of one): refused before any compute, saying how to
  call flce instead.

``hidden`` may be a DTensor on the weight's (tensor-parallel) mesh: replicated, or sharded over
tokens (sequence parallelism), which is all-gathered; its gradient comes back in its own placement (flce's
``grad_hidden`` is already complete on every rank, so the backward only keeps this rank's part).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from flce.config import LCEConfig
from flce.distributed.fsdp2 import Fsdp2Layout, fsdp2_layout, gather_over_data_parallel
from flce.errors import InputError, InputTypeError

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
            raise InputTypeError(
                f"{names[0]} is a DTensor (placements {_placements(hidden if names[0] == 'hidden' else bias)}) "
                "but weight is a plain tensor; expected both as DTensors on one mesh, or both plain"
            )
        return hidden, weight, _plain_target(target), bias, cfg
    if cfg.process_group is not None:
        raise InputError(
            f"process_group={cfg.process_group!r}: weight is a DTensor (placements {_placements(weight)}), whose "
            "device mesh already names the group; pass process_group=None"
        )
    layout = fsdp2_layout(weight)
    if layout is not None:
        return _fsdp2_call(hidden, weight, target, bias, cfg, layout)
    return _tensor_parallel_call(hidden, weight, target, bias, cfg)


def localize_pair(student: tuple[Any, Any, Any], teacher: tuple[Any, Any, Any], target: Any,
                  cfg: Any) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any], Any, Any]:
    """A distillation call's two heads, each (hidden, weight, bias), as plain tensors: :func:`localize_inputs` for
    each head, the target with the student's. Vocabulary-sharded weights (tensor parallelism, alone or under
    FSDP2) must be sharded alike, over the same ranks: the call's config then carries their group."""
    hidden, weight, bias = student
    hidden, weight, target, bias, student_cfg = _localized_head("student", hidden, weight, target, bias, cfg)
    teacher_hidden, teacher_weight, teacher_bias = teacher
    teacher_hidden, teacher_weight, _, teacher_bias, teacher_cfg = _localized_head(
        "teacher", teacher_hidden, teacher_weight, None, teacher_bias, cfg)
    groups = (student_cfg.process_group, teacher_cfg.process_group)
    if groups[0] is not groups[1] and (None in groups or _ranks(groups[0]) != _ranks(groups[1])):
        sharded = ", ".join(f"{head}: {'ranks ' + str(_ranks(g)) if g is not None else 'not vocabulary-sharded'}"
                            for head, g in zip(("student_weight", "teacher_weight"), groups, strict=True))
        raise InputError(f"the heads' weights are sharded differently ({sharded}); expected both heads' weights "
                         "vocabulary-sharded alike over the same ranks (Shard(0) DTensors on one mesh), or neither")
    return (hidden, weight, bias), (teacher_hidden, teacher_weight, teacher_bias), target, student_cfg


def _localized_head(head: str, hidden: Any, weight: Any, target: Any, bias: Any, cfg: Any) -> CallInputs:
    """localize_inputs for one head of a distillation call, its errors naming the head's arguments."""
    try:
        return localize_inputs(hidden, weight, target, bias, cfg)
    except (InputError, InputTypeError) as exc:
        raise type(exc)(f"the {head}'s head ({head}_hidden, {head}_weight, {head}_bias): {exc}") from None


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


# --------------------------------------------------------------------------- partitioned, not DTensors

def check_not_partitioned(name: str, tensor: Any, expected_dim: int) -> None:
    """Refuse a DeepSpeed ZeRO-3 parameter that is not gathered, and FSDP1 flat/sharded parameters."""
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return
    ds_shape = getattr(tensor, "ds_shape", None)
    if getattr(tensor, "ds_id", None) is not None and ds_shape is not None and tuple(tensor.shape) != tuple(ds_shape):
        status = getattr(tensor, "ds_status", None)
        status = getattr(status, "name", status)
        raise InputError(
            f"{name}: a DeepSpeed ZeRO-3 partitioned parameter that is not gathered (ds_status={status}, "
            f"local shape {tuple(tensor.shape)}, ds_shape={tuple(ds_shape)}); call flce inside the forward of "
            "the module that owns it, where ZeRO-3 gathers it (from another module's forward, first "
            "deepspeed.zero.register_external_parameter(module, param))"
        )
    if getattr(tensor, "_is_flat_param", False):
        raise InputError(
            f"{name}: an FSDP1 FlatParameter (shape {tuple(tensor.shape)}, the module's parameters flattened "
            "together); pass the original parameter (use_orig_params=True), inside the forward of the "
            "FullyShardedDataParallel module that owns it, where FSDP gathers it"
        )
    if getattr(tensor, "_fsdp_flattened", False) and (tensor.dim() != expected_dim or tensor.numel() == 0):
        raise InputError(
            f"{name}: a parameter managed by FSDP1 (FullyShardedDataParallel) in its sharded state (shape "
            f"{tuple(tensor.shape)}); call flce inside the forward of the FSDP module that owns it, where FSDP "
            "gathers it and reduces its gradient"
        )


# --------------------------------------------------------------------------- FSDP2

def _fsdp2_call(hidden: Any, weight: Any, target: Any, bias: Any, cfg: LCEConfig, layout: Fsdp2Layout) -> CallInputs:
    """Gather over the data-parallel mesh dimensions (flce.distributed.fsdp2); what remains is the
    whole weight, or (FSDP2 x TP) this rank's vocabulary shard of the tensor-parallel dimension."""
    mesh = weight.device_mesh
    model_parallel = [d for d in range(mesh.ndim) if d not in layout.data_parallel_dims]
    sharded = [d for d in model_parallel if not weight.placements[d].is_replicate()]
    if len(sharded) > 1 or (sharded and not weight.placements[sharded[0]].is_shard(0)):
        raise InputError(
            f"weight: an FSDP2 parameter with placements {_placements(weight)} on a {mesh.ndim}-D mesh; expected "
            "FSDP2 over a tensor-parallel weight that is Shard(0) (vocabulary-parallel) or Replicate() on one "
            "mesh dimension"
        )
    group = mesh.get_group(sharded[0]) if sharded else None
    if bias is not None:
        bias_layout = fsdp2_layout(bias) if _is_dtensor(bias) else None
        if bias_layout is not None:
            bias = gather_over_data_parallel(bias, bias_layout)
        elif group is not None:
            raise InputError(
                f"bias: not an FSDP2 parameter; expected the bias of the weight's fully_shard unit, sharded like "
                f"the weight ({_placements(weight)})"
            )
    weight = gather_over_data_parallel(weight, layout)
    if group is None:
        if _is_dtensor(hidden):
            raise InputTypeError(
                f"hidden is a DTensor (placements {_placements(hidden)}) but weight is an FSDP2-sharded parameter "
                "without tensor parallelism; expected hidden as a plain tensor of this rank's tokens"
            )
        return hidden, weight, _plain_target(target), bias, cfg
    # FSDP2 x TP: the tensor-parallel ranks hold the same tokens; a sequence-sharded hidden lives on
    # the tensor-parallel sub-mesh.
    return (_replicated_hidden(hidden, group), weight, _plain_target(target), bias,
            cfg.replace(process_group=group))


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


# --------------------------------------------------------------------------- tensor parallelism

def _tensor_parallel_call(hidden: Any, weight: Any, target: Any, bias: Any, cfg: LCEConfig) -> CallInputs:
    from torch.distributed.tensor import DTensor

    mesh = weight.device_mesh
    placement = weight.placements[0] if mesh.ndim == 1 else None
    if placement is None or not (placement.is_replicate() or placement.is_shard(0)):
        raise InputError(
            f"weight: a DTensor with placements {_placements(weight)} on a {mesh.ndim}-D mesh; expected Shard(0) "
            "(vocabulary-parallel) or Replicate() on a 1-D mesh"
        )
    if bias is not None:
        if not isinstance(bias, DTensor) or bias.device_mesh != mesh or tuple(bias.placements) != (placement,):
            got = f"placements {_placements(bias)}" if isinstance(bias, DTensor) else "a plain tensor"
            raise InputError(f"bias: {got}; expected a DTensor on the weight's mesh with placements ({placement},)")
        bias = bias.to_local()
    group = mesh.get_group() if placement.is_shard() else None
    hidden = _replicated_hidden(hidden, mesh.get_group())
    if group is not None:
        cfg = cfg.replace(process_group=group)
    # to_local's backward wraps the local gradient in the weight's own placements.
    return hidden, weight.to_local(), _plain_target(target), bias, cfg


def _replicated_hidden(hidden: Any, group: Any) -> Any:
    """Every rank's full hidden states; a token-sharded DTensor (sequence parallelism) is all-gathered.
    A DTensor hidden must live on the mesh (or sub-mesh) of ``group``, the weight's tensor-parallel ranks."""
    from torch.distributed.tensor import Replicate

    if not _is_dtensor(hidden):
        return hidden
    mesh = hidden.device_mesh
    expected = dist.get_process_group_ranks(group)
    if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != expected:
        raise InputError(
            f"hidden: a DTensor on mesh {mesh} but the weight's tensor-parallel ranks are {expected}; expected "
            "hidden on the weight's (tensor-parallel) mesh"
        )
    placement = hidden.placements[0]
    token_dims = hidden.dim() - 1
    if not (placement.is_replicate() or (placement.is_shard() and placement.dim < token_dims)):
        raise InputError(
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
