"""TRL's distillation trainers on flce's linear distillation (TRL 1.16.0), neither model's logits made:

- :class:`GKDDistillationLossMixin`: ``GKDTrainer.compute_loss`` (``trl.experimental.gkd``) through the student and
  teacher patched by ``flce.integrations.trl.add_policy_head``;
- :func:`chunked_divergence_loss`: ``DistillationTrainer``'s loss function (``trl.trainer.distillation_trainer.
  _chunked_divergence_loss``), the same signature and returns.

Both are importable from flce.integrations.trl too (docs/distillation.md shows them there).
"""

from __future__ import annotations

import torch

import flce
from flce.distillation.config import loss_of_beta
from flce.integrations.transformers import per_item


class GKDDistillationLossMixin:
    """TRL's ``GKDTrainer.compute_loss`` (``trl.experimental.gkd``) in one flce call, neither model's logits made:
    mix in before GKDTrainer and patch both models first,

        class Trainer(GKDDistillationLossMixin, GKDTrainer): ...
        add_policy_head(student); add_policy_head(teacher)
        trainer = Trainer(model=student, teacher_model=teacher, ...)

    The same loss as TRL 1.16's: its generalized JSD at the trainer's ``beta`` (0: KL(P || Q), 1: KL(Q || P)) at
    temperature 1, as its compute_loss passes it, over the positions whose shifted label is not -100, divided by
    ``num_items_in_batch`` where the Trainer passes one (gradient accumulation), else by the positions counted.
    The student's loss runs inside its forward (through DDP or FSDP as TRL's does); the teacher's head weight is
    read from the unwrapped teacher (an FSDP2-sharded weight is gathered as docs/distributed.md says). A call that
    asks for the model's outputs (``return_outputs=True``, evaluation) runs TRL's own compute_loss, and a model
    with a logit softcap or scale raises ``ValueError``: flce's distillation applies neither."""

    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        ids = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        self.teacher_model.eval()
        with torch.no_grad():
            teacher_hidden = self.teacher_model(**ids, flce_policy=_unscaled_hidden)
        teacher_head = self.accelerator.unwrap_model(self.teacher_model).get_output_embeddings()
        beta = float(self.beta)
        reduction = "mean" if num_items_in_batch is None else "sum"

        def head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: dict) -> torch.Tensor:
            _unscaled_hidden(hidden, weight, bias, scaling)
            return flce.linear_distillation_loss(
                hidden[:, :-1], weight, teacher_hidden[:, :-1].to(hidden.device), teacher_head.weight,
                inputs["labels"][:, 1:], loss=loss_of_beta(beta), beta=beta, reduction=reduction, student_bias=bias,
                teacher_bias=teacher_head.bias)

        value = model(**ids, flce_policy=head)
        return value if num_items_in_batch is None else per_item(value, num_items_in_batch)


def chunked_divergence_loss(student_hidden_states: torch.Tensor, teacher_hidden_states: torch.Tensor,
                            student_lm_head_weight: torch.Tensor, teacher_lm_head_weight: torch.Tensor,
                            completion_mask: torch.Tensor, beta: float,
                            num_items_in_batch: torch.Tensor | int | None = None,
                            student_lm_head_bias: torch.Tensor | None = None,
                            teacher_lm_head_bias: torch.Tensor | None = None, student_logit_scale: float = 1.0,
                            teacher_logit_scale: float = 1.0, student_final_logit_softcapping: float | None = None,
                            teacher_final_logit_softcapping: float | None = None,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``DistillationTrainer`` loss (``trl.trainer.distillation_trainer._chunked_divergence_loss``, which
    runs TRL's ``trl.kernels.chunked_divergence``) through flce, with its signature and returns:

        import trl.trainer.distillation_trainer as distillation
        distillation._chunked_divergence_loss = flce.integrations.trl.chunked_divergence_loss

    The loss: the generalized JSD at ``beta`` (0 and 1: forward and reverse KL) of the student's and the teacher's
    softmax at ``temperature`` over the positions where ``completion_mask`` is nonzero, summed and divided by
    ``num_items_in_batch`` where given, else by those positions (at least 1); the teacher takes no gradient. Also,
    as TRL's, the student's entropy at ``temperature`` summed over those positions (detached, a logged metric, made
    in the same call's statistics: ``return_entropy``) and their count.
    Weights and biases in another dtype than their hidden states (an fp32 master copy) are cast to it, as TRL
    casts a gathered one. A logit scale other than 1 or a final logit softcap (flce's distillation applies neither)
    raises ``ValueError``: train such models with TRL's own."""
    if (student_logit_scale != 1.0 or teacher_logit_scale != 1.0 or student_final_logit_softcapping is not None
            or teacher_final_logit_softcapping is not None):
        raise ValueError(
            f"chunked_divergence_loss: logit scales {student_logit_scale} / {teacher_logit_scale}, softcaps "
            f"{student_final_logit_softcapping} / {teacher_final_logit_softcapping} (student / teacher): flce's "
            "distillation applies no logit scale or softcap; train this model with TRL's own _chunked_divergence_loss")
    valid = completion_mask.reshape(-1) != 0
    count = valid.sum()
    # Only the counted positions are projected, as TRL does on GPUs.
    student = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid]
    teacher = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid]
    student_weight = student_lm_head_weight.to(student.dtype)
    teacher_weight = teacher_lm_head_weight.to(teacher.dtype)
    student_bias = None if student_lm_head_bias is None else student_lm_head_bias.to(student.dtype)
    teacher_bias = None if teacher_lm_head_bias is None else teacher_lm_head_bias.to(teacher.dtype)
    beta = float(beta)
    total, entropy = flce.linear_distillation_loss(student, student_weight, teacher, teacher_weight,
                                                   loss=loss_of_beta(beta),
                                                   beta=beta, temperature=temperature, reduction="sum",
                                                   student_bias=student_bias, teacher_bias=teacher_bias,
                                                   return_entropy=True)
    loss = total / count.clamp(min=1) if num_items_in_batch is None else per_item(total, num_items_in_batch)
    return loss, entropy.sum(), count


def _unscaled_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scaling: dict) -> torch.Tensor:
    """add_policy_head's head for a distillation: the hidden states, for a model whose logits are the plain
    ``hidden @ weight.T + bias`` (flce's distillation applies no softcap or logit scale)."""
    if scaling["softcap"] is not None or scaling["logit_scale"] != 1.0:
        raise ValueError(f"GKDDistillationLossMixin: the model's config sets a logit softcap or scale ({scaling}), "
                         "which flce's distillation does not apply; train without the mixin (TRL's own loss)")
    return hidden
