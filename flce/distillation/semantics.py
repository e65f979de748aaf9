"""Linear distillation's loss and gradient, expressed through per-row statistics of two softmaxes.

With u_t, u_s a row's raw teacher and student logits (``hidden @ weight.T + bias``), T the temperature,
t = u_t / T, s = u_s / T, P = softmax(t), Q = softmax(s), log p = t - lse_t, log q = s - lse_s:

    forward_kl = KL(P || Q) = E_p[t - s] - lse_t + lse_s
    reverse_kl = KL(Q || P) = E_q[s - t] - lse_s + lse_t
    jsd        = beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q,  0 < beta < 1

with no T^2 factor, and a row's loss ``w CE(u_s, y) + (1 - w) divergence`` (w = hard_label_weight; the
cross-entropy at temperature 1: lse(u_s) - u_s[y]). A row whose target is ignore_index contributes
nothing; "mean" divides by the counted rows (all rows without a target).

**Statistics.** A scan over vocabulary tiles keeps, per row, online (a running max, and sums relative
to it, rescaled when it grows: mergeable across tiles and across vocabulary shards in any order):
both softmaxes' (max of the raw logits, sum exp((u - max) / T)); for the KL divergences the "cross" sum that
makes their expectation in the same pass, sum exp((u_t - max u_t) / T) (t - s) for forward KL (its E_p[t - s])
and sum exp((u_s - max u_s) / T) (s - t) for reverse KL; for the hard term the target's raw logit and, where
T != 1, the raw student logits' own (max, sum exp); where the call returns the student's entropy, the sum
exp(d) d, d = (u_s - max u_s) / T, which makes it as cross-entropy's: H(Q) = log sum exp(d) - E_q[d]. JSD
needs log m = log(beta p + (1 - beta) q), known only once both lse are: a second pass over the tiles sums
KL(P || M) and KL(Q || M), plain sums (additive across tiles and shards).

**Gradients.** With r a row's upstream scale (0 on ignored rows), the gradient of the raw student
logits is ``r w (softmax(u_s) - onehot(y)) + r (1 - w) / T f_s`` and, where the teacher takes one, of
the raw teacher logits ``r (1 - w) / T f_t``, elementwise:

    forward_kl  f_s = q - p                                 f_t = p ((t - s) - E_p[t - s])
    reverse_kl  f_s = q ((s - t) - E_q[s - t])             f_t = p - q
    jsd         f_s = (1 - beta) q (log q - log m - KL(Q||M))  f_t = beta p (log p - log m - KL(P||M))

(each a softmax's Jacobian applied to d loss / d probabilities; the teacher's column is the student's
of the swapped loss). A row kernel needs only the per-row scalars of :class:`PairCoefficients`; the
formula itself is written once in torch, :mod:`flce.distillation.tiles`, which the reference kernels
run and the Triton kernels restate.

**Against Liger-Kernel and TRL.** TRL's GKD (``GKDTrainer.generalized_jsd_loss``) and Liger-Kernel 0.8.5's
``LigerFusedLinearJSDLoss`` compute the same generalized JSD (M = beta P + (1 - beta) Q, weights beta
on KL(P||M)), divide the logits by the temperature without a T^2 factor, sum over the vocabulary and
average over the non-ignored tokens. Differences: both take beta = 0 and beta = 1 as forward and
reverse KL (the limits of JSD(beta) / beta are those, not of JSD itself), here separate ``loss``
values; Liger weights the hard and soft terms independently (weight_hard_loss, weight_soft_loss: here
w and 1 - w), runs its JSD in the logits' dtype (bf16 logits: bf16 log-softmax) where flce's
statistics are fp32, pads a smaller student vocabulary with zero logits where flce refuses unequal
vocabularies, and never differentiates the teacher; Liger before 0.5 mixed M = beta Q + (1 - beta) P.
TRL's ``batchmean`` without labels divides by the batch size of its first dimension, not the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from flce.config import LCEConfig
from flce.distillation.config import DistillationConfig
from flce.semantics import PartialRowStats


@dataclass
class PartialPairStats:
    """One scan's statistics of a row range's two softmaxes over some columns, mergeable (module docstring).

    Sums are relative to their max; ``cross`` to the teacher's max (forward KL) or the student's (reverse
    KL); ``target_logit`` is 0 where the columns do not hold the target."""

    teacher_max: torch.Tensor  # [n], max u_t (the raw logits': see PairStats)
    teacher_sum: torch.Tensor  # [n], sum exp((u_t - teacher_max) / T)
    student_max: torch.Tensor  # [n], max u_s
    student_sum: torch.Tensor  # [n], sum exp((u_s - student_max) / T)
    cross: torch.Tensor | None = None  # [n] KL divergences only (module docstring)
    hard_max: torch.Tensor | None = None  # [n] max u_s: the hard term at a temperature != 1
    hard_sum: torch.Tensor | None = None  # [n] sum exp(u_s - hard_max)
    target_logit: torch.Tensor | None = None  # [n] u_s[target]: the hard term
    student_dz_sum: torch.Tensor | None = None  # [n] sum exp(d) d, d = (u_s - student_max) / T: the entropy

    @staticmethod
    def allocate(n_rows: int, cfg: DistillationConfig, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> PartialPairStats:
        """Uninitialised statistics for a kernel to write: the optional ones only where ``cfg`` needs them."""
        def row() -> torch.Tensor:
            return torch.empty(n_rows, dtype=dtype, device=device)

        own_lse = cfg.hard_needs_own_lse
        return PartialPairStats(row(), row(), row(), row(), cross=row() if needs_cross(cfg) else None,
                                hard_max=row() if own_lse else None, hard_sum=row() if own_lse else None,
                                target_logit=row() if cfg.hard else None,
                                student_dz_sum=row() if cfg.return_entropy else None)

    def present(self) -> list[torch.Tensor]:
        """The statistics this scan holds, in field order (what a vocab-parallel combine exchanges)."""
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def like(self, values: list[torch.Tensor]) -> PartialPairStats:
        """Statistics of the same kinds as this one's, from ``values`` in :meth:`present`'s order."""
        found = iter(values)
        return PartialPairStats(**{f.name: None if getattr(self, f.name) is None else next(found)
                                   for f in fields(self)})


def needs_cross(cfg: DistillationConfig) -> bool:
    """The KL divergences' expectation comes from the first pass; JSD has its second pass instead."""
    return cfg.soft and cfg.loss != "jsd"


def student_reads_teacher(cfg: DistillationConfig) -> bool:
    """Whether the student's GEMM epilogue, to make this call's statistics, reads the teacher's logits tile beside
    its own: reverse KL's centre E_q[s - t] is an online sum over the student's softmax of both heads' logits,
    made there once the teacher's GEMM has written its chunk (pair_stats_of_heads)."""
    return cfg.soft and cfg.loss == "reverse_kl"


def per_head_unfit(cfg: DistillationConfig, cross_in_grad_sweep: bool, reads_teacher: bool = False) -> str | None:
    """Why a call's statistics cannot come from the logits GEMMs' epilogues, or None. An epilogue sees one head's
    tile at a time, and ``reads_teacher``, the student's one the teacher's logits tile too (its family reads a
    second logits tensor: student_reads_teacher). Forward KL's cross sum is the loss's alone where the teacher
    takes no gradient (the student's, q - p, needs only the normalisers): ``cross_in_grad_sweep``, a kernel that
    writes the student's gradient alone makes it in that sweep, one read a row. Reverse KL's centre E_q[s - t]
    without the teacher's tile (or beside the entropy's sum, which takes the same slot of the epilogue), forward
    KL's without that sweep and the hard term's own softmax at T != 1 need more."""
    if student_reads_teacher(cfg) and not reads_teacher:
        return "reverse_kl's gradient centre E_q[s - t] needs both heads' logits at once"
    if student_reads_teacher(cfg) and cfg.return_entropy:
        return ("reverse_kl with return_entropy: the student's GEMM epilogue makes one weighted sum, E_q[s - t]'s "
                "or the entropy's")
    if cfg.soft and cfg.loss == "forward_kl" and not cross_in_grad_sweep:
        return ("forward_kl's cross sum needs both heads' logits at once (made in the gradient's sweep only where "
                "forward writes the student's gradient alone)")
    if cfg.hard_needs_own_lse:
        return f"the hard term at temperature {cfg.temperature} needs the student's softmax at temperature 1 too"
    return None


def head_config(cfg: DistillationConfig, student: bool = False) -> LCEConfig:
    """The cross-entropy options under which one head's row statistics (flce.semantics.PartialRowStats) are this
    call's: its temperature and ignore_index; the student's target_z is then the hard term's target logit (the
    hard term's temperature is 1 where per_head_unfit allows it), and its sum_exp_dz the entropy's sum where the
    call returns the entropy (or, where the student's GEMM reads the teacher's logits, reverse KL's sum)."""
    return LCEConfig(ignore_index=cfg.ignore_index, temperature=cfg.temperature,
                     return_entropy=student and cfg.return_entropy)


def pair_stats_of_heads(teacher: PartialRowStats, student: PartialRowStats,
                        cfg: DistillationConfig) -> PartialPairStats:
    """A call's partial statistics from each head's, computed under :func:`head_config` (where per_head_unfit is
    None; where student_reads_teacher, the student's sum_exp_dz is its GEMM's sum exp(s - max s) (s - max s - t),
    which moves with the max as the entropy's sum does, so the column tiles and splits merge it unchanged). A
    head's row_max is of u / T: times T it is the raw max the pair statistics keep (not bitwise a logit, so the top
    column's u - max is not exactly 0; the GEMMs that make these take 16-bit inputs, whose logits' own rounding is
    far coarser)."""
    cross = None
    if student_reads_teacher(cfg):  # sum exp(s - max s) (s - t), relative to the student's max as the pass's
        cross = student.sum_exp_dz + student.row_max * student.sum_exp
    return PartialPairStats(teacher.row_max * cfg.temperature, teacher.sum_exp, student.row_max * cfg.temperature,
                            student.sum_exp, cross=cross, target_logit=student.target_z if cfg.hard else None,
                            student_dz_sum=student.sum_exp_dz if cfg.return_entropy else None)


def merge_pair_stats(a: PartialPairStats, b: PartialPairStats, cfg: DistillationConfig) -> PartialPairStats:
    """Statistics of the union of two disjoint column ranges (or vocabulary shards)."""
    def rescaled(max_a: torch.Tensor, max_b: torch.Tensor, *pairs: tuple[torch.Tensor, torch.Tensor],
                 inv_temperature: float = 1.0 / cfg.temperature):
        new_max = torch.maximum(max_a, max_b)
        # exp(-inf - -inf) is nan: a side without columns (max -inf) weighs 0.
        scale_a = torch.where(max_a == -torch.inf, 0.0, torch.exp((max_a - new_max) * inv_temperature))
        scale_b = torch.where(max_b == -torch.inf, 0.0, torch.exp((max_b - new_max) * inv_temperature))
        return new_max, [x * scale_a + y * scale_b for x, y in pairs]

    cross_of_teacher = cfg.loss == "forward_kl"
    teacher_pairs = [(a.teacher_sum, b.teacher_sum)] + ([(a.cross, b.cross)] if a.cross is not None
                                                        and cross_of_teacher else [])
    student_pairs = [(a.student_sum, b.student_sum)] + ([(a.cross, b.cross)] if a.cross is not None
                                                        and not cross_of_teacher else [])
    teacher_max, teacher_sums = rescaled(a.teacher_max, b.teacher_max, *teacher_pairs)
    student_max, student_sums = rescaled(a.student_max, b.student_max, *student_pairs)
    merged = PartialPairStats(teacher_max, teacher_sums[0], student_max, student_sums[0])
    if a.student_dz_sum is not None:
        merged.student_dz_sum = (_moved_dz_sum(a, student_max, cfg.temperature)
                                 + _moved_dz_sum(b, student_max, cfg.temperature))
    if a.cross is not None:
        merged.cross = (teacher_sums if cross_of_teacher else student_sums)[1]
    if a.hard_max is not None:
        merged.hard_max, (merged.hard_sum,) = rescaled(a.hard_max, b.hard_max, (a.hard_sum, b.hard_sum),
                                                       inv_temperature=1.0)
    if a.target_logit is not None:
        merged.target_logit = a.target_logit + b.target_logit
    return merged


def _moved_dz_sum(p: PartialPairStats, new_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """p's sum exp(d) d relative to ``new_max`` >= p.student_max: each d moves by (max - new_max) / T and each
    exp(d) scales by exp of that (flce.semantics.shifted_sum_exp_dz, in the raw logits' units); 0 where p has no
    columns (max -inf)."""
    shift = torch.where(p.student_sum > 0, (p.student_max - new_max) / temperature, 0.0)
    return (p.student_dz_sum + shift * p.student_sum) * torch.exp(shift)


@dataclass
class PairStats:
    """A row's statistics over the whole vocabulary (all shards): what the loss and the gradient read.

    Each softmax's normaliser is kept as two numbers, the raw logits' max and the log of the sum relative to it,
    lse = max / T + log_sum, and its log-probabilities are formed as (u - max) / T - log_sum: at the largest
    logit u - max is exactly 0, so a row whose softmax is nearly one-hot keeps its probabilities summing to 1 to
    the last bit, where one rounded lse (u / T - lse) would shift them all by its rounding, which JSD's centred
    gradient (q (log q/m - KL(Q||M))) multiplies by the cancellation in its centring."""

    teacher_max: torch.Tensor  # [n], max u_t
    teacher_log_sum: torch.Tensor  # [n], log sum exp((u_t - teacher_max) / T)
    student_max: torch.Tensor  # [n], max u_s
    student_log_sum: torch.Tensor  # [n], log sum exp((u_s - student_max) / T)
    cross_mean: torch.Tensor | None = None  # [n], E_p[t - s] (forward KL) or E_q[s - t] (reverse KL)
    hard_lse: torch.Tensor | None = None  # [n], lse of u_s (the student's lse at temperature 1)
    target_logit: torch.Tensor | None = None  # [n], u_s[target]
    teacher_mixture_kl: torch.Tensor | None = None  # [n], KL(P || M) (JSD's second pass)
    student_mixture_kl: torch.Tensor | None = None  # [n], KL(Q || M)
    student_entropy: torch.Tensor | None = None  # [n], H(Q): an output only (no gradient reads it)

    @staticmethod
    def from_partial(p: PartialPairStats, cfg: DistillationConfig) -> PairStats:
        student_log_sum = torch.log(p.student_sum)
        cross_sum = p.teacher_sum if cfg.loss == "forward_kl" else p.student_sum
        hard_lse = None
        if cfg.hard:
            # At temperature 1 the student's softmax is the cross-entropy's.
            own = p.hard_max is not None
            hard_lse = p.hard_max + torch.log(p.hard_sum) if own else p.student_max + student_log_sum
        return PairStats(teacher_max=p.teacher_max, teacher_log_sum=torch.log(p.teacher_sum),
                         student_max=p.student_max, student_log_sum=student_log_sum,
                         cross_mean=None if p.cross is None else p.cross / cross_sum, hard_lse=hard_lse,
                         target_logit=p.target_logit,
                         student_entropy=None if p.student_dz_sum is None
                         else student_log_sum - p.student_dz_sum / p.student_sum)

    def teacher_lse(self, cfg: DistillationConfig) -> torch.Tensor:
        return self.teacher_max / cfg.temperature + self.teacher_log_sum

    def student_lse(self, cfg: DistillationConfig) -> torch.Tensor:
        return self.student_max / cfg.temperature + self.student_log_sum

    def rows(self, rows: slice) -> PairStats:
        return PairStats(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                            for f in fields(self)})

    def stacked(self) -> torch.Tensor:
        """The statistics a gradient reads, as one [k, n] tensor (what a deferred backward keeps)."""
        return torch.stack([getattr(self, f.name) for f in fields(self)
                            if getattr(self, f.name) is not None and f.name not in OUTPUT_ONLY])

    @staticmethod
    def unstacked(values: torch.Tensor, cfg: DistillationConfig) -> PairStats:
        """The inverse of :meth:`stacked` for a call of ``cfg``."""
        found = iter(values.unbind(0))
        present = stats_present(cfg)
        return PairStats(**{f.name: next(found) if f.name in present else None for f in fields(PairStats)})


# PairStats fields the call returns and no gradient reads: a deferred backward does not keep them.
OUTPUT_ONLY = ("student_entropy",)


def stats_present(cfg: DistillationConfig) -> tuple[str, ...]:
    """The PairStats fields a deferred backward keeps for a call of ``cfg`` (OUTPUT_ONLY's aside), in field
    order."""
    names = ["teacher_max", "teacher_log_sum", "student_max", "student_log_sum"]
    if needs_cross(cfg):
        names.append("cross_mean")
    if cfg.hard:
        names += ["hard_lse", "target_logit"]
    if cfg.soft and cfg.loss == "jsd":
        names += ["teacher_mixture_kl", "student_mixture_kl"]
    return tuple(names)


def with_mixture_sums(stats: PairStats, teacher_kl: torch.Tensor, student_kl: torch.Tensor) -> PairStats:
    """``stats`` with JSD's second-pass sums, KL(P || M) and KL(Q || M) over the whole vocabulary."""
    stats.teacher_mixture_kl, stats.student_mixture_kl = teacher_kl, student_kl
    return stats


def divergence(stats: PairStats, cfg: DistillationConfig) -> torch.Tensor:
    """Each row's divergence (module docstring)."""
    if cfg.loss == "forward_kl":
        return stats.cross_mean - stats.teacher_lse(cfg) + stats.student_lse(cfg)
    if cfg.loss == "reverse_kl":
        return stats.cross_mean - stats.student_lse(cfg) + stats.teacher_lse(cfg)
    return cfg.beta * stats.teacher_mixture_kl + (1.0 - cfg.beta) * stats.student_mixture_kl


def row_losses(stats: PairStats, valid: torch.Tensor | None, cfg: DistillationConfig) -> torch.Tensor:
    """Each row's loss, 0 where its target is ignored (``valid`` None: every row counts)."""
    loss = None
    if cfg.soft:
        loss = (1.0 - cfg.hard_label_weight) * divergence(stats, cfg)
    if cfg.hard:
        # A row whose target is ignored has no target logit: its value is dropped by the select below.
        ce = cfg.hard_label_weight * (stats.hard_lse - stats.target_logit)
        loss = ce if loss is None else loss + ce
    return loss if valid is None else torch.where(valid, loss, 0.0)


def reduced(rows: torch.Tensor, count: torch.Tensor, cfg: DistillationConfig) -> torch.Tensor:
    """The call's loss from its row losses: their sum, their mean over ``count`` counted rows (0 where
    there is none, as flce's cross-entropy), or the rows themselves."""
    if cfg.reduction == "none":
        return rows
    total = rows.sum()
    if cfg.reduction == "sum":
        return total
    return torch.where(count > 0, total / count.clamp(min=1), 0.0)


def row_scales(grad_loss: torch.Tensor, count: torch.Tensor, valid: torch.Tensor | None, n_rows: int,
               cfg: DistillationConfig, rows: slice = slice(None)) -> torch.Tensor:
    """d loss / d (row loss) of ``rows`` from the loss's upstream gradient, 0 on ignored rows: [n] in the
    statistics' dtype."""
    dtype = count.dtype
    if cfg.reduction == "none":
        scale = grad_loss.reshape(-1)[rows].to(dtype)
    else:
        g = grad_loss.reshape(()).to(dtype)
        if cfg.reduction == "mean":
            g = torch.where(count > 0, g / count.clamp(min=1), 0.0)
        scale = g.expand(n_rows)
    # Selected, not multiplied: an ignored row gets nothing even from an inf or NaN upstream gradient.
    return scale if valid is None else torch.where(valid[rows], scale, 0.0)


@dataclass
class PairCoefficients:
    """The per-row scalars of the module docstring's gradient formula, [n] each; each softmax's normaliser as
    PairStats keeps it (max, log_sum)."""

    teacher_max: torch.Tensor
    teacher_log_sum: torch.Tensor
    student_max: torch.Tensor
    student_log_sum: torch.Tensor
    soft_scale: torch.Tensor  # r (1 - w) / T
    student_center: torch.Tensor | None = None  # reverse KL: E_q[s - t]; JSD: KL(Q || M)
    teacher_center: torch.Tensor | None = None  # forward KL: E_p[t - s]; JSD: KL(P || M) (teacher gradient)
    hard_lse: torch.Tensor | None = None  # the cross-entropy's lse (hard term)
    hard_scale: torch.Tensor | None = None  # r w
    teacher_scale: torch.Tensor | None = None  # r (1 - w) / T, where the teacher takes a gradient


def pair_coefficients(stats: PairStats, scale: torch.Tensor, cfg: DistillationConfig,
                      teacher: bool) -> PairCoefficients:
    """The coefficients of rows whose loss is scaled by ``scale`` (:func:`row_scales`); ``teacher``: the
    teacher's logits take a gradient too."""
    soft_scale = scale * ((1.0 - cfg.hard_label_weight) / cfg.temperature)
    coeffs = PairCoefficients(teacher_max=stats.teacher_max, teacher_log_sum=stats.teacher_log_sum,
                              student_max=stats.student_max, student_log_sum=stats.student_log_sum,
                              soft_scale=soft_scale)
    if cfg.loss == "reverse_kl":
        coeffs.student_center = stats.cross_mean
    elif cfg.loss == "jsd":
        coeffs.student_center = stats.student_mixture_kl
    if teacher:
        coeffs.teacher_scale = soft_scale
        coeffs.teacher_center = {"forward_kl": stats.cross_mean, "reverse_kl": None,
                                 "jsd": stats.teacher_mixture_kl}[cfg.loss]
    if cfg.hard:
        coeffs.hard_lse, coeffs.hard_scale = stats.hard_lse, scale * cfg.hard_label_weight
    return coeffs
