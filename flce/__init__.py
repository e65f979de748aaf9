"""flce: fused linear cross-entropy without the [tokens, vocab] logits.

    import flce
    loss_fn = flce.get_impl("cuda")(ignore_index=-100, reduction="mean")
    loss = loss_fn(hidden, lm_head.weight, labels)
"""

from flce.distillation.api import LinearDistillation, get_distillation_impl, linear_distillation_loss
from flce.errors import InputError, InputTypeError
from flce.explain import explain
from flce.explain_distillation import explain_distillation
from flce.module import LinearCrossEntropy, get_impl, linear_cross_entropy
from flce.outputs import DistillationOutput, LCEOutput
from flce.policy.api import LinearPolicyLoss, PolicyLossOutput, get_policy_impl, linear_policy_loss
from flce.registry import Backend, available_backends, register_backend

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "InputError",
    "InputTypeError",
    "DistillationOutput",
    "LCEOutput",
    "LinearCrossEntropy",
    "LinearPolicyLoss",
    "PolicyLossOutput",
    "LinearDistillation",
    "available_backends",
    "explain",
    "explain_distillation",
    "get_distillation_impl",
    "get_impl",
    "get_policy_impl",
    "linear_cross_entropy",
    "linear_policy_loss",
    "linear_distillation_loss",
    "register_backend",
]
