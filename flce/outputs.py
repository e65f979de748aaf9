"""The named tuple returned when any ``return_*`` option is set."""

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
