"""The elementwise half of :mod:`flce.distillation.semantics`, in torch: one tile of a row range's raw
teacher and student logits (any columns of the vocabulary) to its partial statistics, to its share of
JSD's second-pass sums, and to its gradients. The reference backend's kernels run these on row blocks;
the Triton kernels (Ascend, CUDA) restate them tile by tile.

Every function takes the logits already upcast to the math dtype (fp32, or fp64 for fp64 inputs) and
``target_col`` [n] int64: the target's column within the tile, -1 where the tile does not hold it.
"""

from __future__ import annotations

import math

import torch

from flce.distillation.config import DistillationConfig
from flce.distillation.semantics import PairCoefficients, PartialPairStats, needs_cross


def tile_statistics(teacher_u: torch.Tensor, student_u: torch.Tensor, target_col: torch.Tensor,
                    cfg: DistillationConfig) -> PartialPairStats:
    """The tile's partial statistics (semantics module docstring), sums relative to the tile's maxima."""
    inv_t = 1.0 / cfg.temperature
    teacher_max, student_max = teacher_u.amax(dim=1), student_u.amax(dim=1)
    teacher_exp = torch.exp((teacher_u - teacher_max.unsqueeze(1)) * inv_t)
    student_exp = torch.exp((student_u - student_max.unsqueeze(1)) * inv_t)
    stats = PartialPairStats(teacher_max, teacher_exp.sum(1), student_max, student_exp.sum(1))
    if cfg.return_entropy:
        stats.student_dz_sum = (student_exp * ((student_u - student_max.unsqueeze(1)) * inv_t)).sum(1)
    if needs_cross(cfg):
        t, s = teacher_u * inv_t, student_u * inv_t
        if cfg.loss == "forward_kl":
            stats.cross = (teacher_exp * (t - s)).sum(1)
        else:
            stats.cross = (student_exp * (s - t)).sum(1)
    if cfg.hard_needs_own_lse:
        stats.hard_max = student_u.amax(dim=1)
        stats.hard_sum = torch.exp(student_u - stats.hard_max.unsqueeze(1)).sum(1)
    if cfg.hard:
        here = target_col >= 0
        picked = student_u.gather(1, target_col.clamp(min=0).unsqueeze(1)).squeeze(1)
        stats.target_logit = torch.where(here, picked, 0.0)
    return stats


def log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log(beta p + (1 - beta) q) from the two log-probabilities, without overflow or log(0)."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def log_softmax_of(u: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor, inv_t: float) -> torch.Tensor:
    """A softmax's log-probabilities from its normaliser as PairStats keeps it: (u - max) / T - log_sum."""
    return (u - row_max.unsqueeze(1)) * inv_t - log_sum.unsqueeze(1)


def tile_mixture_sums(teacher_u: torch.Tensor, student_u: torch.Tensor, teacher_norm: tuple[torch.Tensor, torch.Tensor],
                      student_norm: tuple[torch.Tensor, torch.Tensor],
                      cfg: DistillationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile's shares of KL(P || M) and KL(Q || M), given both rows' normalisers (max, log_sum) over the whole
    vocabulary."""
    inv_t = 1.0 / cfg.temperature
    log_p = log_softmax_of(teacher_u, *teacher_norm, inv_t)
    log_q = log_softmax_of(student_u, *student_norm, inv_t)
    log_m = log_mixture(log_p, log_q, cfg.beta)
    return (torch.exp(log_p) * (log_p - log_m)).sum(1), (torch.exp(log_q) * (log_q - log_m)).sum(1)


def tile_gradients(teacher_u: torch.Tensor, student_u: torch.Tensor, target_col: torch.Tensor,
                   coeffs: PairCoefficients, cfg: DistillationConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d loss / d u_s of the tile and, where ``coeffs.teacher_scale`` is set, d loss / d u_t (semantics
    module docstring), in the math dtype."""
    teacher = coeffs.teacher_scale is not None
    if cfg.soft:
        student_f, teacher_f = _divergence_terms(teacher_u, student_u, coeffs, cfg, teacher)
    else:  # hard_label_weight 1: nothing soft to differentiate
        student_f, teacher_f = torch.zeros_like(student_u), torch.zeros_like(teacher_u) if teacher else None
    student_grad = student_f * coeffs.soft_scale.unsqueeze(1)
    if coeffs.hard_scale is not None:
        hard_p = torch.exp(student_u - coeffs.hard_lse.unsqueeze(1))
        onehot = torch.arange(student_u.shape[1], device=student_u.device).unsqueeze(0) == target_col.unsqueeze(1)
        student_grad = student_grad + coeffs.hard_scale.unsqueeze(1) * (hard_p - onehot.to(hard_p.dtype))
    teacher_grad = None if teacher_f is None else teacher_f * coeffs.teacher_scale.unsqueeze(1)
    return student_grad, teacher_grad


def _divergence_terms(teacher_u: torch.Tensor, student_u: torch.Tensor, coeffs: PairCoefficients,
                      cfg: DistillationConfig, teacher: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(f_s, f_t) of the semantics module docstring; f_t None without a teacher gradient."""
    inv_t = 1.0 / cfg.temperature
    t, s = teacher_u * inv_t, student_u * inv_t
    log_p = log_softmax_of(teacher_u, coeffs.teacher_max, coeffs.teacher_log_sum, inv_t)
    log_q = log_softmax_of(student_u, coeffs.student_max, coeffs.student_log_sum, inv_t)
    p, q = torch.exp(log_p), torch.exp(log_q)
    if cfg.loss == "forward_kl":
        return q - p, p * ((t - s) - coeffs.teacher_center.unsqueeze(1)) if teacher else None
    if cfg.loss == "reverse_kl":
        return q * ((s - t) - coeffs.student_center.unsqueeze(1)), p - q if teacher else None
    log_m = log_mixture(log_p, log_q, cfg.beta)
    student_f = (1.0 - cfg.beta) * q * (log_q - log_m - coeffs.student_center.unsqueeze(1))
    return student_f, cfg.beta * p * (log_p - log_m - coeffs.teacher_center.unsqueeze(1)) if teacher else None
