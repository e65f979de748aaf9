"""The float64 oracle of linear distillation: the definitions, materialised, the obvious way.

:func:`reference_distillation_loss` builds both ``[tokens, vocab]`` logits in float64, takes torch's
log-softmax of each and sums the divergence's definition over the vocabulary; the hard term is torch's
``cross_entropy``. It shares nothing with flce's statistics or kernels, so it checks them::

    from flce.testing import reference_distillation_loss
    expected = reference_distillation_loss(xs, ws, xt, wt, target, loss="jsd", beta=0.5)
    torch.testing.assert_close(flce.linear_distillation_loss(xs, ws, xt, wt, target).double(), expected)

Differentiable with respect to every input (float64 leaves give float64 gradients); slow, and
2 x tokens x vocab x 8 bytes: meant for checks at test sizes. :func:`reference_student_entropy` is
``return_entropy``'s oracle, the definition -sum q log q on the same materialised logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flce.linear_distillation_loss``'s value in float64 (docs/distillation.md states the semantics)."""
    xs = student_hidden.double().reshape(-1, student_weight.shape[1])
    xt = teacher_hidden.double().reshape(-1, teacher_weight.shape[1])
    u_s = xs @ student_weight.double().T
    u_t = xt @ teacher_weight.double().T
    if student_bias is not None:
        u_s = u_s + student_bias.double()
    if teacher_bias is not None:
        u_t = u_t + teacher_bias.double()
    log_q = F.log_softmax(u_s / temperature, dim=-1)
    log_p = F.log_softmax(u_t / temperature, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    if loss == "forward_kl":
        divergence = (p * (log_p - log_q)).sum(-1)
    elif loss == "reverse_kl":
        divergence = (q * (log_q - log_p)).sum(-1)
    elif loss == "jsd":
        log_m = torch.log(beta * p + (1.0 - beta) * q)
        divergence = beta * (p * (log_p - log_m)).sum(-1) + (1.0 - beta) * (q * (log_q - log_m)).sum(-1)
    else:
        raise ValueError(f"loss={loss!r}")
    rows = (1.0 - hard_label_weight) * divergence
    if target is None:
        valid = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    else:
        flat_target = target.reshape(-1).long()
        valid = flat_target != ignore_index
        if hard_label_weight:
            ce = F.cross_entropy(u_s, flat_target, ignore_index=ignore_index, reduction="none")
            rows = rows + hard_label_weight * ce
    rows = torch.where(valid, rows, 0.0)
    if reduction == "none":
        return rows.reshape(student_hidden.shape[:-1])
    if reduction == "sum":
        return rows.sum()
    count = valid.sum()
    return rows.sum() / count if count > 0 else rows.sum() * 0.0



def reference_student_entropy(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                              target: torch.Tensor | None = None, *, temperature: float = 1.0, ignore_index: int = -100,
                              student_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's entropy of Q = softmax(student logits / temperature) in float64, -sum q log q, 0 where the
    target is ``ignore_index``: ``flce.linear_distillation_loss(..., return_entropy=True).entropy``'s value, in the
    student hidden's leading shape."""
    u_s = student_hidden.double().reshape(-1, student_weight.shape[1]) @ student_weight.double().T
    if student_bias is not None:
        u_s = u_s + student_bias.double()
    log_q = F.log_softmax(u_s / temperature, dim=-1)
    entropy = -(log_q.exp() * log_q).sum(-1)
    if target is not None:
        entropy = torch.where(target.reshape(-1) != ignore_index, entropy, 0.0)
    return entropy.reshape(student_hidden.shape[:-1])
