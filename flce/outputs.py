"""The named tuples returned when a ``return_*`` option is set: cross-entropy's and distillation's."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LCEOutput(NamedTuple):
    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    selected_logprobs: torch.Tensor | None = None
    logit_stats: torch.Tensor | None = None


class DistillationOutput(NamedTuple):
    """``flce.linear_distillation_loss(..., return_entropy=True)``: the loss, and each token's entropy of the
    student's softmax at the call's temperature (fp32, fp64 for fp64 inputs; the tokens' shape, 0 where the target
    is ignored, no gradient)."""

    loss: torch.Tensor
    entropy: torch.Tensor
