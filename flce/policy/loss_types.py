"""TRL's GRPOTrainer loss types (trl 1.16.0) as flce's policy options and aggregations.

=========  =====================================================  ==========================================
loss_type  per-token term                                         aggregation of the masked per-token loss
=========  =====================================================  ==========================================
grpo       clip: -min(min(r, delta) A, clamp(r, 1-el, 1+eh) A)    each sequence's mean, then their mean
bnpo       clip                                                   sum / the mask's sum
dr_grpo    clip                                                   sum / (B * max_completion_length)
dapo       clip                                                   sum / num_items_in_batch (else the mask's sum)
cispo      -sg(min(r, epsilon_high)) A logp                       as dapo
luspo      clip                                                   each sequence's sum, then their mean
sapo       -sigmoid(tau (r - 1)) 4 / tau A                        as grpo
=========  =====================================================  ==========================================

The per-token loss is then times ``rollout_is_ratio`` (TRL's vLLM importance-sampling correction) and plus
``beta * k3`` (the KL to the reference policy); the entropy bonus is ``-entropy_weight`` times the masked mean
entropy, whatever the loss type (TRL's ``entropy_coef``). TRL's divisions by the gradient-accumulation steps and
processes are the trainer's (flce.integrations.trl applies them). vespo (a detached sequence weight from the
sum of the clamped log ratios, the rollout ratio inside it) is not implemented: it raises.
"""

from __future__ import annotations

import torch

from flce.policy.options import PolicyOptions
from flce.policy.semantics import Number, SequenceLayout, aggregation_weights

# loss_type -> (term, aggregation); the order is the table's.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "seq_mean_token_mean"),
    "bnpo": ("clip", "token_mean"),
    "dr_grpo": ("clip", "seq_mean_token_sum_norm"),
    "dapo": ("clip", "token_mean"),
    "cispo": ("cispo", "token_mean"),
    "luspo": ("clip", "seq_mean_token_sum"),
    "sapo": ("sapo", "seq_mean_token_mean"),
}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def check_loss_type(loss_type: object, importance_sampling_level: object) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {tuple(LOSS_TYPES)} (TRL 1.16's loss types; "
                         "vespo is not implemented)")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: expected one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")


def trl_options(loss_type: str, importance_sampling_level: str, *, epsilon_low: float, epsilon_high: float,
                delta: float | None, beta: float, sapo_temperature_pos: float,
                sapo_temperature_neg: float) -> PolicyOptions:
    """The policy options of a TRL loss type (the table of the module docstring)."""
    check_loss_type(loss_type, importance_sampling_level)
    for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r}: expected a real number >= 0")
    if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta > 0):
        raise ValueError(f"delta={delta!r}: expected None or a real number > 0 (TRL recommends > 1 + epsilon_high)")
    term = LOSS_TYPES[loss_type][0]
    if term == "cispo":  # TRL's cispo caps the ratio at epsilon_high itself, with no lower bound
        low, high = None, float(epsilon_high)
    else:
        low, high = 1.0 - float(epsilon_low), 1.0 + float(epsilon_high)
    return PolicyOptions(term=term, level=importance_sampling_level, ratio_low=low, ratio_high=high,
                         delta=None if delta is None else float(delta), sapo_tau_pos=float(sapo_temperature_pos),
                         sapo_tau_neg=float(sapo_temperature_neg), beta=float(beta), kl="k3")


def trl_weights(loss_type: str, mask: torch.Tensor, layout: SequenceLayout, *, num_items_in_batch: Number | None,
                max_completion_length: int | None) -> torch.Tensor:
    """Each token's weight in the loss [N] (its aggregation, the mask included)."""
    aggregation = LOSS_TYPES[loss_type][1]
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length=None: loss_type='dr_grpo' divides by B * max_completion_length "
                         "(TRL's GRPOConfig.max_completion_length)")
    if max_completion_length is not None and (isinstance(max_completion_length, bool)
                                              or not isinstance(max_completion_length, int)
                                              or max_completion_length <= 0):
        raise ValueError(f"max_completion_length={max_completion_length!r}: expected a positive int")
    divisor = None
    if loss_type in ("dapo", "cispo") and num_items_in_batch is not None:
        divisor = _divisor("num_items_in_batch", num_items_in_batch, mask)
    return aggregation_weights(mask, layout, aggregation, token_divisor=divisor, horizon=max_completion_length)


def trl_entropy_weights(mask: torch.Tensor, entropy_weight: float) -> torch.Tensor | None:
    """d loss / d entropy per token: -entropy_weight over the masked tokens' count (None without the bonus)."""
    if entropy_weight == 0:
        return None
    return -float(entropy_weight) * mask / mask.sum().clamp(min=1.0)


def _divisor(name: str, value: Number, like: torch.Tensor) -> torch.Tensor | float:
    """A count the loss divides by, at least 1 (TRL clamps its normaliser): a number, or a 0-d tensor (a device
    tensor stays on the device: no host synchronisation)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{name}: expected a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(()).to(device=like.device, dtype=like.dtype).clamp(min=1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}: expected a number > 0 or a tensor")
    return max(float(value), 1.0)
