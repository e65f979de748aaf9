"""The loss, its extras and its gradient, expressed through per-row statistics.

Backends differ in how they scan the vocabulary; what the scan must produce is
the same everywhere: per token row, the statistics below. Everything after the
scan (reductions, extras, the per-row gradient coefficients) lives here once.

With z the capped, temperature-scaled logits of one row, p = softmax(z), y the
target and w the class weights (all ones when there are none), the gradient of
every differentiable output with respect to z has the form

    grad_z[c] = p[c] * (a - h * (z[c] - lse)) - (c == y) * d - e * w[c]

for four per-row scalars (a, h, d, e) computed by :func:`flce.gradients.grad_coefficients`.
A grad kernel only needs those, the row's lse and its target.

The entropy's term is written with z - lse = log p, not z: at large logits (|z| ~ 100 at a low
temperature) ``a - h * z`` would subtract two fp32 numbers of size |z| whose difference is the
gradient, and keep only ~|z| * 6e-8 of absolute precision; log p and the entropy are small where p
is not. For the same reason the scans sum exp(z - max) * (z - max), not exp(z - max) * z.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flce.config import LCEConfig


@dataclass
class PartialRowStats:
    """One scan's statistics, combinable across vocabulary shards.

    sum_exp and sum_exp_dz are relative to row_max; target_z is 0 on a shard
    that does not hold the target; argmax is a global vocabulary index.
    """

    row_max: torch.Tensor  # [n] fp32
    sum_exp: torch.Tensor  # [n] fp32, sum exp(z - row_max)
    target_z: torch.Tensor  # [n] fp32
    sum_exp_dz: torch.Tensor | None = None  # [n] fp32, sum exp(z - row_max) * (z - row_max) (entropy)
    weighted_sum_z: torch.Tensor | None = None  # [n] fp32, sum w[c] * z[c]      (smoothing)
    argmax: torch.Tensor | None = None  # [n] int64                              (metrics)
    row_min: torch.Tensor | None = None  # [n] fp32, min z                       (logit stats)
    sum_z: torch.Tensor | None = None  # [n] fp32, sum z                         (logit stats)

    @staticmethod
    def allocate(n_rows: int, cfg: LCEConfig, device: torch.device) -> PartialRowStats:
        """Uninitialised fp32 statistics for a kernel to write: the optional ones only where cfg needs them."""
        def f32() -> torch.Tensor:
            return torch.empty(n_rows, dtype=torch.float32, device=device)

        return PartialRowStats(
            row_max=f32(), sum_exp=f32(), target_z=f32(),
            sum_exp_dz=f32() if needs_sum_exp_dz(cfg) else None,
            weighted_sum_z=f32() if needs_weighted_sum_z(cfg) else None,
            argmax=torch.empty(n_rows, dtype=torch.int64, device=device) if needs_argmax(cfg) else None,
            row_min=f32() if needs_logit_stats(cfg) else None,
            sum_z=f32() if needs_logit_stats(cfg) else None,
        )


def moved_to(p: PartialRowStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The online-softmax merge, torch's one copy of it (flce/backends/online_softmax.py in Triton): p's sum of
    exp(z - max) and its entropy sum of exp(z - max) * (z - max), both moved to ``new_max`` >= p.row_max."""
    scale = torch.exp(p.row_max - new_max)
    dz = shifted_sum_exp_dz(p, new_max)
    return p.sum_exp * scale, None if dz is None else dz * scale


def merge_partial_stats(a: PartialRowStats, b: PartialRowStats) -> PartialRowStats:
    """Statistics of the union of two disjoint column ranges (b's columns after a's)."""
    row_max = torch.maximum(a.row_max, b.row_max)
    (sum_a, dz_a), (sum_b, dz_b) = moved_to(a, row_max), moved_to(b, row_max)
    return PartialRowStats(
        row_max=row_max,
        sum_exp=sum_a + sum_b,
        target_z=a.target_z + b.target_z,
        sum_exp_dz=None if dz_a is None or dz_b is None else dz_a + dz_b,
        weighted_sum_z=None if a.weighted_sum_z is None else a.weighted_sum_z + b.weighted_sum_z,
        # Strictly greater: a's columns come first, so ties keep a's (first) index.
        argmax=None if a.argmax is None else torch.where(b.row_max > a.row_max, b.argmax, a.argmax),
        row_min=None if a.row_min is None or b.row_min is None else torch.minimum(a.row_min, b.row_min),
        sum_z=None if a.sum_z is None or b.sum_z is None else a.sum_z + b.sum_z,
    )


def shifted_sum_exp_dz(p: PartialRowStats, new_max: torch.Tensor) -> torch.Tensor | None:
    """p's sum exp(z - max) * (z - max) with the differences taken from new_max >= p.row_max (the sum
    still relative to p's max): + (max - new_max) * sum_exp; 0 where p has no columns (max = -inf)."""
    if p.sum_exp_dz is None:
        return None
    shift = torch.where(p.sum_exp > 0, p.row_max - new_max, 0.0)
    return p.sum_exp_dz + shift * p.sum_exp


@dataclass
class RowStats:
    lse: torch.Tensor  # [n] fp32
    target_z: torch.Tensor  # [n] fp32
    entropy: torch.Tensor | None = None  # [n] fp32, log sum exp(z - max) - E_p[z - max]
    # [n] fp32, lse - E_p[z] with the stored (rounded) lse: the entropy as the gradient kernels see it
    lse_minus_mean_z: torch.Tensor | None = None
    weighted_sum_z: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    # (max z, min z, sum z) per row: the logit statistics (return_logit_stats), else None.
    row_max: torch.Tensor | None = None
    row_min: torch.Tensor | None = None
    sum_z: torch.Tensor | None = None

    @staticmethod
    def from_partial(p: PartialRowStats) -> RowStats:
        with_stats = p.row_min is not None
        log_sum_exp = torch.log(p.sum_exp)
        lse = p.row_max + log_sum_exp
        mean_dz = None if p.sum_exp_dz is None else p.sum_exp_dz / p.sum_exp
        return RowStats(
            lse=lse,
            target_z=p.target_z,
            # The output from the small terms alone; the gradient's with lse - max taken from the rounded
            # lse (exact in fp32), so that the kernels' z - lse and it carry the same rounding of lse,
            # which cancels (at |lse| ~ 500 that rounding is 2-3x the entropy's own fp32 error).
            entropy=None if mean_dz is None else log_sum_exp - mean_dz,
            lse_minus_mean_z=None if mean_dz is None else (lse - p.row_max) - mean_dz,
            weighted_sum_z=p.weighted_sum_z,
            argmax=p.argmax,
            row_max=p.row_max if with_stats else None,
            row_min=p.row_min,
            sum_z=p.sum_z,
        )


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Row statistics and per-call scalars: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def needs_sum_exp_dz(cfg: LCEConfig) -> bool:
    return cfg.return_entropy or cfg.entropy_weight != 0.0


def needs_weighted_sum_z(cfg: LCEConfig) -> bool:
    return cfg.label_smoothing != 0.0


def needs_argmax(cfg: LCEConfig) -> bool:
    return cfg.return_token_accuracy or cfg.return_predicted_tokens


def needs_logit_stats(cfg: LCEConfig) -> bool:
    return cfg.return_logit_stats


@dataclass(frozen=True)
class Denominators:
    """Divisors of the mean reduction, computed on the device without a host sync, once per call with what
    every mean of the call divides by: a mean is then one division and one select (small launches are
    most of a short call's host time)."""

    cross_entropy: torch.Tensor  # scalar fp32: non-ignored tokens, or their class-weight sum (any sign, or NaN)
    z_loss: torch.Tensor  # scalar fp32: non-ignored tokens
    counted: torch.Tensor  # scalar bool: a token was counted
    # The divisors where a token was counted, else 1 (no 0 / 0 in the branch the select drops), and a 0.
    cross_entropy_divisor: torch.Tensor
    token_divisor: torch.Tensor
    zero: torch.Tensor

    def mean_over_weights(self, total: torch.Tensor) -> torch.Tensor:
        """total / the cross-entropy denominator, as torch's mean divides (a class-weight sum that is
        negative, zero or NaN included), and 0 where no token was counted (every target ignored: torch
        gives NaN there)."""
        return torch.where(self.counted, total / self.cross_entropy_divisor, self.zero)

    def mean_over_tokens(self, total: torch.Tensor) -> torch.Tensor:
        """total / the count of non-ignored tokens, and 0 where there is none."""
        return torch.where(self.counted, total / self.token_divisor, self.zero)


class TokenCounts(NamedTuple):
    """The non-ignored tokens of a call as 0-d device tensors: what every mean divides by, before class weights."""

    count: torch.Tensor  # the number of non-ignored tokens, in the statistics dtype
    counted: torch.Tensor  # bool: count > 0
    divisor: torch.Tensor  # count where it is > 0, else 1
    zero: torch.Tensor  # 0 in the statistics dtype


def count_tokens(target: torch.Tensor, ignore_index: int, dtype: torch.dtype = torch.float32) -> TokenCounts:
    """TokenCounts from PyTorch ops (RowKernels.count_tokens may count in one kernel instead)."""
    count = (target != ignore_index).sum(dtype=dtype)
    # token_divisor: a whole number, 1 where the count is 0 (no 0 / 0 in the branch a select drops)
    return TokenCounts(count, count > 0, count.clamp(min=1), torch.zeros((), dtype=dtype, device=target.device))


def denominators(target: torch.Tensor, cfg: LCEConfig, dtype: torch.dtype, counts: TokenCounts) -> Denominators:
    """The call's Denominators from its non-ignored tokens ``counts`` (RowKernels.count_tokens, in ``dtype``)."""
    count, counted, token_divisor, zero = counts
    if cfg.class_weight is None:
        return Denominators(count, count, counted, token_divisor, token_divisor, zero)
    weight_sum = class_weight_of_target(target, cfg, dtype).sum(dtype=dtype)
    return Denominators(weight_sum, count, counted, torch.where(counted, weight_sum, 1.0), token_divisor, zero)


def class_weight_of_target(target: torch.Tensor, cfg: LCEConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each row's target class weight, 0 on ignored rows: selected, not multiplied, since an ignored row's
    clamped index reads some class's weight, which may be NaN (torch lets a NaN weight reach only the rows
    whose target it is, and, through label smoothing, every row)."""
    assert cfg.class_weight is not None
    weight = cfg.class_weight.to(dtype)[target.clamp(0, cfg.class_weight.shape[0] - 1)]
    return torch.where(target != cfg.ignore_index, weight, 0.0)


@dataclass
class RowTerms:
    """Per-row loss pieces before reduction (0 on ignored rows)."""

    cross_entropy: torch.Tensor  # [n] fp32, token scaling included
    z_loss: torch.Tensor | None  # [n] fp32; None without a z-loss (lse_square_scale 0: its terms are all 0)
    valid: torch.Tensor  # [n] bool
    # [n] fp32, the label-smoothing part of cross_entropy, kept with class weights only: torch's mean divides
    # it and the rest by the weight sum separately, which differs from dividing their sum where that sum is 0.
    smoothing: torch.Tensor | None = None
    # [n] fp32, -entropy_weight * entropy, None without; a mean divides it by the counted tokens, as the z-loss.
    entropy: torch.Tensor | None = None


def row_terms(stats: RowStats, target: torch.Tensor, cfg: LCEConfig, vocab: int,
              token_weight: torch.Tensor | None = None) -> RowTerms:
    """Per-row cross-entropy and z-loss with exactly torch's cross_entropy semantics; ``token_weight`` [n]
    (the call's token_weights) multiplies each row's cross-entropy, and cfg.entropy_weight adds the entropy
    term."""
    valid = target != cfg.ignore_index
    nll = stats.lse - stats.target_z
    eps = cfg.label_smoothing
    dtype = stats.lse.dtype
    if cfg.class_weight is not None:
        nll = nll * class_weight_of_target(target, cfg, dtype)
    ce = nll if eps == 0.0 else (1.0 - eps) * nll
    smoothing = None
    if eps != 0.0:
        weight_sum = float(vocab) if cfg.class_weight is None else cfg.class_weight.to(dtype).sum()
        smoothing = (eps / vocab) * (weight_sum * stats.lse - stats.weighted_sum_z)
        ce = ce + smoothing
    if cfg.token_scaling:
        scale = torch.exp(stats.target_z - stats.lse)
        ce = ce * scale
        smoothing = None if smoothing is None else smoothing * scale
    if token_weight is not None:
        ce = ce * token_weight
        smoothing = None if smoothing is None else smoothing * token_weight
    # Python zeros: a zero tensor would be one more launch a call.
    zl = torch.where(valid, cfg.lse_square_scale * stats.lse.square(), 0.0) if cfg.lse_square_scale else None
    kept_smoothing = None if smoothing is None or cfg.class_weight is None else torch.where(valid, smoothing, 0.0)
    bonus = torch.where(valid, -cfg.entropy_weight * stats.entropy, 0.0) if cfg.entropy_weight else None
    return RowTerms(torch.where(valid, ce, 0.0), zl, valid, kept_smoothing, bonus)


def reduce_terms(terms: RowTerms, cfg: LCEConfig, denoms: Denominators) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, z_loss) reduced as cfg.reduction says, in fp32, the z-loss and entropy terms in the loss. Without
    either the loss is the cross-entropy's alone (nothing added); without a z-loss the z-loss is a fresh zero
    where the call returns it."""
    loss = _reduced_cross_entropy(terms, cfg, denoms)
    z_loss = None if terms.z_loss is None else _reduced_over_tokens(terms.z_loss, cfg, denoms)
    loss = loss if z_loss is None else loss + z_loss
    loss = loss if terms.entropy is None else loss + _reduced_over_tokens(terms.entropy, cfg, denoms)
    if z_loss is None and cfg.return_z_loss:
        z_loss = torch.zeros_like(terms.cross_entropy if cfg.reduction == "none" else denoms.zero)
    return loss, denoms.zero if z_loss is None else z_loss


def _reduced_over_tokens(rows: torch.Tensor, cfg: LCEConfig, denoms: Denominators) -> torch.Tensor:
    """A per-row term reduced as cfg.reduction says, a mean over the non-ignored tokens."""
    if cfg.reduction == "none":
        return rows
    total = rows.sum()
    return total if cfg.reduction == "sum" else denoms.mean_over_tokens(total)


def _reduced_cross_entropy(terms: RowTerms, cfg: LCEConfig, denoms: Denominators) -> torch.Tensor:
    if cfg.reduction == "none":
        return terms.cross_entropy
    ce_sum = terms.cross_entropy.sum()
    if cfg.reduction == "sum":
        return ce_sum
    if terms.smoothing is None:
        return denoms.mean_over_weights(ce_sum)
    smoothing_sum = terms.smoothing.sum()
    return denoms.mean_over_weights(ce_sum - smoothing_sum) + denoms.mean_over_weights(smoothing_sum)


def extras(stats: RowStats, terms: RowTerms, target: torch.Tensor, cfg: LCEConfig, denoms: Denominators,
           vocab: int) -> dict:
    """token_accuracy, predicted_tokens, logprobs, entropy, logit_stats where asked (fp32 / int64)."""
    out: dict[str, torch.Tensor] = {}
    valid = terms.valid
    if cfg.return_token_accuracy:
        correct = ((stats.argmax == target) & valid).float()
        if cfg.reduction == "none":
            out["token_accuracy"] = correct
        elif cfg.reduction == "sum":
            out["token_accuracy"] = correct.sum()
        else:
            out["token_accuracy"] = denoms.mean_over_tokens(correct.sum())
    if cfg.return_predicted_tokens:
        out["predicted_tokens"] = torch.where(valid, stats.argmax, -1)
    if cfg.return_logprobs:
        out["logprobs"] = torch.where(valid, stats.target_z - stats.lse, 0.0)
    if cfg.return_entropy:
        out["entropy"] = torch.where(valid, stats.entropy, 0.0)
    if cfg.return_logit_stats:
        max_min_mean = torch.stack([stats.row_max, stats.row_min, stats.sum_z / vocab], dim=-1)
        out["logit_stats"] = torch.where(valid.unsqueeze(-1), max_min_mean, 0.0)
    return out
