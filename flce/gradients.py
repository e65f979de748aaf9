"""The per-row coefficients (a, h, d, e) of the gradient formula in :mod:`flce.semantics`' docstring, from
the row statistics, the loss's upstream scales and the upstream gradients of the log-probs and the entropy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flce.config import LCEConfig
from flce.semantics import Denominators, RowStats, class_weight_of_target


@dataclass
class GradCoefficients:
    """Per-row (a, h, d, e) of the module docstring's gradient formula, fp32 [n]."""

    a: torch.Tensor
    h: torch.Tensor | None  # None when no entropy gradient flows
    d: torch.Tensor
    e: torch.Tensor | None  # None without label smoothing


# The options under which a token's gradient is a multiple of softmax(z) - onehot(target) alone (a = d, no h or e
# in the formula): the temperature divides the logits and the multiple, the log-probs come from the row
# statistics. The call's token_weights (an input, not an option) multiply it too.
_ROW_SCALED_SOFTMAX_OPTIONS = frozenset({"temperature", "return_logprobs"})


def gradient_is_row_scaled_softmax(cfg: LCEConfig) -> bool:
    """True where d loss / d u of the raw logits u is, row by row, (softmax(z) - onehot) * the upstream scale /
    temperature (z = u / temperature): no full-feature option but the temperature and the returned log-probs.
    A chunk's gradient can then be kept as exponentials and a row scale (capability KEPT_EXPONENTIALS)."""
    return set(cfg.full_feature_options()) <= _ROW_SCALED_SOFTMAX_OPTIONS


class UpstreamScales(NamedTuple):
    """Per-row multipliers of the loss's terms from its grad_output, [n] fp32 each."""

    cross_entropy: torch.Tensor  # the call's token_weights included
    z_loss: torch.Tensor
    entropy: torch.Tensor | None  # d loss / d entropy: -entropy_weight times the token mean's scale; None without

    def rows(self, rows: slice) -> UpstreamScales:
        return UpstreamScales(self.cross_entropy[rows], self.z_loss[rows],
                              None if self.entropy is None else self.entropy[rows])


def upstream_scales(
    cfg: LCEConfig, denoms: Denominators, grad_loss: torch.Tensor, rows: slice, n_rows: int,
    token_weight: torch.Tensor | None = None,
) -> UpstreamScales:
    """Per-row multipliers of the cross-entropy, z-loss and entropy terms of ``rows``, from the loss's
    grad_output; ``token_weight`` is the call's token_weights, all rows (sliced here)."""
    if cfg.reduction == "none":
        g_ce = g_z = g_tokens = grad_loss.reshape(-1)[rows].to(denoms.z_loss.dtype)
    else:
        g = grad_loss.to(denoms.z_loss.dtype).reshape(())
        mean = cfg.reduction == "mean"
        g_ce = denoms.mean_over_weights(g) if mean else g
        g_tokens = denoms.mean_over_tokens(g) if mean and (cfg.lse_square_scale or cfg.entropy_weight) else g_ce
        # Without a z-loss nothing reads its scale (grad_coefficients adds its term only with one).
        g_z = g_tokens if cfg.lse_square_scale else g_ce
        g_ce, g_z, g_tokens = g_ce.expand(n_rows), g_z.expand(n_rows), g_tokens.expand(n_rows)
    if token_weight is not None:
        g_ce = g_ce * token_weight[rows]
    return UpstreamScales(g_ce, g_z, -cfg.entropy_weight * g_tokens if cfg.entropy_weight else None)


def grad_coefficients(
    stats: RowStats,
    target: torch.Tensor,
    cfg: LCEConfig,
    vocab: int,
    scales: UpstreamScales,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> GradCoefficients:
    """(a, h, d, e) of rows whose loss terms ``scales`` multiplies and whose log-probs and entropy get the upstream
    gradients ``grad_logprobs`` / ``grad_entropy`` (None: none flows); the loss's entropy term adds to the latter."""
    grad_ce, grad_z_loss, bonus = scales
    if bonus is not None:
        grad_entropy = bonus if grad_entropy is None else grad_entropy.to(bonus.dtype) + bonus
    dtype = stats.lse.dtype
    # Selected, not multiplied: an ignored row gets no gradient even where the upstream scale is inf or
    # NaN (a class-weighted mean over weights that sum to 0 or NaN), as in torch.
    valid = target != cfg.ignore_index
    g_ce = torch.where(valid, grad_ce, 0.0)
    if cfg.token_scaling:
        g_ce = g_ce * torch.exp(stats.target_z - stats.lse)
    w_y = class_weight_of_target(target, cfg, dtype) if cfg.class_weight is not None else 1.0
    eps = cfg.label_smoothing
    nll_scale = g_ce * ((1.0 - eps) * w_y)
    a = nll_scale
    d = nll_scale
    e = None
    if eps != 0.0:
        weight_sum = float(vocab) if cfg.class_weight is None else cfg.class_weight.to(dtype).sum()
        a = a + g_ce * (eps * weight_sum / vocab)
        e = g_ce * (eps / vocab)
    if cfg.lse_square_scale:
        a = a + (2.0 * cfg.lse_square_scale) * torch.where(valid, grad_z_loss, 0.0) * stats.lse
    if grad_logprobs is not None:
        g_lp = torch.where(valid, grad_logprobs.to(dtype), 0.0)
        a = a - g_lp
        d = d - g_lp
    h = None
    if grad_entropy is not None:
        # d entropy / d z = -p (z - E[z]) = -p ((z - lse) + (lse - E[z])): the kernels multiply h by z - lse.
        h = torch.where(valid, grad_entropy.to(dtype), 0.0)
        a = a - h * stats.lse_minus_mean_z
    return GradCoefficients(a=a, h=h, d=d, e=e)
