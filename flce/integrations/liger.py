"""Liger-Kernel drop-in: ``LigerFusedLinearJSDLoss`` (``liger_kernel.chunked_loss``, Liger 0.8.5) through flce's
linear distillation, neither model's logits made:

    from flce.integrations.liger import LigerFusedLinearJSDLoss   # instead of liger_kernel.chunked_loss's

The same constructor, forward and loss: ``weight_hard_loss`` times the student's cross-entropy with the labels at
temperature 1 plus ``weight_soft_loss`` times the generalized JSD at ``beta`` and ``temperature`` (beta 0 and 1:
forward and reverse KL, as Liger takes them), each summed over the tokens whose label is not ``ignore_index`` and
divided by their count; the teacher takes no gradient. Where they differ:

- ``compiled`` and ``chunk_size`` are how Liger bounds its memory; flce bounds its own by ``memory_budget`` (a
  keyword of this class, flce's default where None) and takes those two without using them;
- the softmaxes' statistics are fp32 where Liger's JSD runs in the logits' dtype (bf16 logits: bf16 log-softmax);
- a teacher vocabulary larger than the student's (Liger pads the student's logits with zeros) raises ValueError;
- a temperature at or below 0 raises ValueError (Liger refuses 0 only);
- the terms' weights fold into one flce call where both are at least 0 and not both 0; otherwise, and with
  ``return_soft_hard_loss=True`` (one call returns the total only), the soft and the hard term are two calls,
  the distillation's and cross-entropy's, whose GEMMs over the student's head are then made twice.
"""

from __future__ import annotations

from typing import Any

import torch

import flce
from flce.distillation.config import loss_of_beta
from flce.errors import InputError


class LigerFusedLinearJSDLoss(torch.nn.Module):
    """``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` on flce (module docstring)."""

    def __init__(self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                 ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                 return_soft_hard_loss: bool = False, *, memory_budget: int | None = None,
                 backend: str | None = None) -> None:
        super().__init__()
        self.weight_hard_loss, self.weight_soft_loss = float(weight_hard_loss), float(weight_soft_loss)
        self.beta, self.ignore_index, self.temperature = beta, ignore_index, temperature
        self.compiled, self.chunk_size = compiled, chunk_size  # Liger's memory knobs (module docstring)
        self.return_soft_hard_loss = return_soft_hard_loss
        self.memory_budget, self.backend = memory_budget, backend

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, true_labels: torch.Tensor, student_bias: torch.Tensor | None = None,
                teacher_bias: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if teacher_weight.shape[0] != student_weight.shape[0]:
            raise InputError(f"LigerFusedLinearJSDLoss: the teacher's vocabulary ({teacher_weight.shape[0]}) differs "
                             f"from the student's ({student_weight.shape[0]}); flce does not pad the student's "
                             "logits with zeros as Liger does: pass heads of one vocabulary")
        hard, soft = self.weight_hard_loss, self.weight_soft_loss
        heads = (student_input, student_weight, teacher_input, teacher_weight, true_labels)
        biases = {"student_bias": student_bias, "teacher_bias": teacher_bias}
        if not self.return_soft_hard_loss and hard >= 0 and soft >= 0 and hard + soft > 0:
            # w_h CE + w_s D = (w_h + w_s) (w CE + (1 - w) D), w = w_h / (w_h + w_s): flce's hard_label_weight.
            total = hard + soft
            return total * self._distillation(*heads, hard_label_weight=hard / total, **biases)
        soft_loss = self._distillation(*heads, hard_label_weight=0.0, **biases)
        hard_loss = flce.linear_cross_entropy(student_input, student_weight, true_labels, student_bias,
                                              ignore_index=self.ignore_index, backend=self.backend,
                                              **self._budget())
        loss = soft * soft_loss + hard * hard_loss
        return (loss, soft_loss, hard_loss) if self.return_soft_hard_loss else loss

    def _distillation(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                      teacher_weight: torch.Tensor, true_labels: torch.Tensor, *, hard_label_weight: float,
                      student_bias: torch.Tensor | None, teacher_bias: torch.Tensor | None) -> torch.Tensor:
        beta = float(self.beta)
        return flce.linear_distillation_loss(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, loss=loss_of_beta(beta),
            beta=beta, temperature=self.temperature, hard_label_weight=hard_label_weight,
            ignore_index=self.ignore_index, student_bias=student_bias, teacher_bias=teacher_bias, backend=self.backend,
            **self._budget())

    def _budget(self) -> dict[str, Any]:
        return {} if self.memory_budget is None else {"memory_budget": self.memory_budget}

    def extra_repr(self) -> str:
        return (f"weight_hard_loss={self.weight_hard_loss}, weight_soft_loss={self.weight_soft_loss}, "
                f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}")
