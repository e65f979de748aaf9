"""Checks on the tensors of one call, done before any kernel runs.

Errors name the argument, the value and what was expected. Target range is
checked here, on the host, for CPU tensors; on an accelerator the engine asserts it on the device in
its first pass over the targets, so no accelerator call ever waits for a host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.config import LCEConfig
from flce.errors import InputError, InputTypeError
from flce.policy.tokens import PolicyTokens


@dataclass(frozen=True)
class FlatInputs:
    """The call's tensors flattened to 2-D/1-D, in the dtype the kernels compute in."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    target: torch.Tensor  # [N] int64
    bias: torch.Tensor | None  # [V]
    token_shape: torch.Size  # target's shape, for reduction="none" outputs
    token_weight: torch.Tensor | None = None  # [N] in the statistics dtype: the call's token_weights
    policy: PolicyTokens | None = None  # a policy loss's per-token inputs (flce.linear_policy_loss), else None


def prepare_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    config: LCEConfig,
) -> FlatInputs:
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InputTypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if hidden.dim() < 1 or not hidden.is_floating_point():
        raise InputError(f"hidden: expected a floating-point tensor [..., H], got {_shape(hidden)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise InputError(f"weight: expected a floating-point tensor [V, H], got {_shape(weight)}")
    vocab, hidden_size = weight.shape
    # A rank's vocabulary shard may be empty: the distributed wrapper reports that on every rank at once.
    if vocab == 0 and config.process_group is None:
        raise InputError(f"weight: has shape {tuple(weight.shape)}, no classes; expected [V, H] with V >= 1")
    if hidden.shape[-1] != hidden_size:
        raise InputError(
            f"hidden: last dimension is {hidden.shape[-1]} but weight is [V={vocab}, H={hidden_size}]; "
            "expected hidden [..., H] with the same H"
        )
    # The shapes, not only the counts: a [5, 4] target against a [4, 5, H] hidden has one target per
    # token but pairs them by flat index with the wrong tokens (torch's cross_entropy raises too).
    if target.shape != hidden.shape[:-1]:
        tokens = hidden.shape[:-1].numel()
        raise InputError(
            f"target: has shape {tuple(target.shape)} ({target.numel()} elements) but hidden has shape "
            f"{tuple(hidden.shape)} ({tokens} tokens); expected target of shape hidden.shape[:-1] = "
            f"{tuple(hidden.shape[:-1])}"
        )
    # After the shape, as torch's cross_entropy: a target of probabilities with the wrong batch size is a
    # ValueError there too.
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise InputTypeError(f"target: expected an integer tensor of class ids, got dtype {target.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != vocab):
        raise InputError(f"bias: expected shape [V={vocab}], got {tuple(bias.shape)}")
    # With a process group the weight is this rank's shard but class_weight covers the global
    # vocabulary: the distributed wrapper checks it against the global size.
    if config.class_weight is not None and config.process_group is None and config.class_weight.shape[0] != vocab:
        raise InputError(
            f"class_weight: expected shape [V={vocab}], got {tuple(config.class_weight.shape)}"
        )
    _check_same_device(hidden, weight, target, bias, config.class_weight)

    hidden, weight, bias = _common_dtype(hidden, weight, bias)
    flat_target = target.reshape(-1).long()
    _check_target_range(flat_target, vocab, config.ignore_index, config.process_group is not None)
    return FlatInputs(
        hidden=hidden.reshape(flat_target.numel(), hidden_size),
        weight=weight,
        target=flat_target,
        bias=bias,
        token_shape=target.shape,
    )


def check_token_weights(token_weights: object, flat: FlatInputs) -> torch.Tensor:
    """The call's ``token_weights`` checked against its target and flattened to [N] in the statistics' dtype
    (float32, or float64 for float64 inputs)."""
    if not isinstance(token_weights, torch.Tensor):
        raise InputTypeError(f"token_weights: expected a torch.Tensor or None, got {type(token_weights).__name__}")
    if not token_weights.is_floating_point():
        raise InputTypeError(f"token_weights: expected a floating-point tensor, got dtype {token_weights.dtype}")
    if token_weights.shape != flat.token_shape:
        raise InputError(f"token_weights: has shape {tuple(token_weights.shape)}; expected the target's shape "
                         f"{tuple(flat.token_shape)}, one weight per token")
    if token_weights.requires_grad:
        raise InputError("token_weights requires grad, but token weights are constants (no gradient flows to "
                         "them, as to class_weight); pass token_weights.detach()")
    if token_weights.device != flat.target.device:
        raise InputError(f"token_weights is on {token_weights.device} but target is on {flat.target.device}; "
                         "expected all tensors on one device")
    dtype = torch.promote_types(flat.hidden.dtype, torch.float32)
    return token_weights.reshape(-1).to(dtype)


def _common_dtype(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, compute in the autocast dtype; outside, dtypes must agree."""
    device_type = hidden.device.type
    # Autocast has no state for the meta device (torch raises when asked): meta tensors keep their dtypes.
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return (hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if hidden.dtype != weight.dtype:
        raise InputTypeError(
            f"hidden has dtype {hidden.dtype} but weight has dtype {weight.dtype}; expected the same "
            "dtype (or call inside torch.autocast)"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise InputTypeError(f"bias has dtype {bias.dtype}; expected the weight's dtype {weight.dtype}")
    return hidden, weight, bias


def _check_same_device(*tensors: torch.Tensor | None) -> None:
    names = ("hidden", "weight", "target", "bias", "class_weight")
    present = [(n, t) for n, t in zip(names, tensors, strict=True) if t is not None]
    first_name, first = present[0]
    for name, tensor in present[1:]:
        if tensor.device != first.device:
            raise InputError(
                f"{name} is on {tensor.device} but {first_name} is on {first.device}; "
                "expected all tensors on one device"
            )


def _check_target_range(target: torch.Tensor, vocab: int, ignore_index: int, sharded: bool) -> None:
    """Targets must be in [0, V) or equal ignore_index: checked here, on the host, for CPU tensors. On an
    accelerator the engine checks them on the device in its first pass over the targets
    (RowKernels.count_tokens; :func:`assert_targets_in_range` where a backend has no kernel of its own).

    With a process group, V is only this rank's shard; the distributed wrapper
    checks against the global vocabulary instead.
    """
    if sharded or target.numel() == 0 or target.device.type != "cpu" or torch.compiler.is_compiling():
        # Under torch.compile the custom op checks at run time: reading values here would break the graph.
        return
    bad = _out_of_range(target, vocab, ignore_index)
    if bool(bad.any()):
        value = int(target[bad][0])
        raise InputError(
            f"target contains {value}, outside [0, {vocab}) and not ignore_index={ignore_index}"
        )


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Targets in [0, vocab) or equal to ignore_index, wherever they are: on the host for CPU tensors (an
    InputError naming the value), a device-side assertion on an accelerator (no host synchronisation)."""
    _check_target_range(target, vocab, ignore_index, sharded=False)
    assert_targets_in_range(target, vocab, ignore_index)


def assert_targets_in_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The accelerator's form of the range check: a device-side assertion, so that no call waits for a host
    synchronisation (CPU tensors were checked on the host by prepare_inputs)."""
    if target.numel() == 0 or target.device.type == "cpu":
        return
    torch._assert_async(~_out_of_range(target, vocab, ignore_index).any(), out_of_range_message(vocab, ignore_index))


def _out_of_range(target: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    return ((target < 0) | (target >= vocab)) & (target != ignore_index)


def out_of_range_message(vocab: int, ignore_index: int) -> str:
    """What a device-side assertion on the targets says."""
    return f"target has a value outside [0, {vocab}) that is not ignore_index={ignore_index}"


def _shape(t: torch.Tensor) -> str:
    return f"dtype {t.dtype}, shape {tuple(t.shape)}"
