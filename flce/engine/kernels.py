"""What a backend's kernels offer the schedules: row kernels (every backend) and optional capabilities.

Row kernels work on one chunk's logits ``[n, V]`` in the compute dtype, produced by a plain GEMM
(``torch.mm``). A capability is a kernel family that does more inside a GEMM; a backend lists the
capabilities it has in its descriptor (``Backend.capabilities``) and a plan names the ones it needs
(``plan.requires``), so a schedule only calls a capability its backend has.
"""

from __future__ import annotations

from typing import Protocol

import torch

from flce.config import LCEConfig
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats, RowStats, TokenCounts

# Statistics (and optionally the logits) from one GEMM whose epilogue reduces each logits tile.
FUSED_STATS_GEMM = "fused_stats_gemm"
# d loss / d u from one GEMM whose epilogue applies semantics.py's gradient formula.
FUSED_GRAD_GEMM = "fused_grad_gemm"
# The plain loss's statistics from one GEMM that keeps, instead of the logits, row-offset exponentials whose
# row scaling is the gradient (no pass over the logits turns them into it).
KEPT_EXPONENTIALS = "kept_exponentials"
CAPABILITIES = (FUSED_STATS_GEMM, FUSED_GRAD_GEMM, KEPT_EXPONENTIALS)


class RowKernels(Protocol):
    """The row kernels every backend implements."""

    def count_tokens(self, target: torch.Tensor, ignore_index: int, dtype: torch.dtype,
                     vocab: int | None) -> TokenCounts:
        """The call's non-ignored tokens in ``dtype`` and, with ``vocab``, the check that every other target is
        in [0, vocab): a device-side assertion on an accelerator (CPU targets were checked on the host). The
        first pass over the targets, before any other kernel of the call. rows.torch_count_tokens where the
        backend has no kernel of its own."""

    def plain_loss(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(per-row loss, per-row lse, grad) with loss and lse in fp32. With grad_scale [n], grad is
        (softmax - onehot) * grad_scale (0 on ignored rows) in the logits' dtype, written over
        logits where the kernel can; else None."""

    def plain_grad_(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, lse: torch.Tensor,
        grad_scale: torch.Tensor,
    ) -> torch.Tensor:
        """(softmax - onehot) * grad_scale given the row lse, written over logits (returned)."""

    def row_stats(
        self, logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
        into: PartialRowStats | None = None,
    ) -> PartialRowStats:
        """Scan raw logits u (capped and temperature-scaled inside) into partial row statistics.
        With ``into`` (statistics of the columns before vocab_offset), merge into it and return it."""

    def full_grad_(
        self, logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
        lse: torch.Tensor, coeffs: GradCoefficients,
    ) -> torch.Tensor:
        """d loss / d u for raw logits u (semantics.py's formula, chained through cap and T),
        written over logits (returned)."""

    def matmul_(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """out = a @ b (accumulate: out += a @ b) for operands in out's dtype, fp32 sums rounded once:
        the gradient products G @ W and G.T @ x. rows.torch_matmul_ where the backend has no faster GEMM."""

    def accumulate_fp32_(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """acc += a @ b with fp32 accumulation, for low-precision a and b, without a full-size temporary."""

    def add_column_sums_(self, acc: torch.Tensor, a: torch.Tensor) -> None:
        """acc [V] += a.sum(0) in acc's dtype for a chunk's [n, V] gradient (the bias gradient). PyTorch's own
        column sum holds a temporary that grows with a (CUDA: its split reduction's staging; CPU: an fp32
        copy of 16-bit input): the CUDA kernels and the CPU reference kernels avoid it, the others use it."""

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """tensor *= scale (a 0-d device tensor) in place, without a host sync; returns tensor.
        The usual scale is exactly 1 (loss.backward()), which a kernel may detect on the device
        and skip the pass over a V x H gradient."""


class FusedStatsGemm(Protocol):
    """Capability FUSED_STATS_GEMM."""

    def gemm_row_stats(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        cfg: LCEConfig, vocab_offset: int, logits_out: torch.Tensor | None = None,
        against: torch.Tensor | None = None,
    ) -> PartialRowStats:
        """Partial row statistics of the logits hidden @ weight.T + bias from one fused GEMM, which
        also writes the logits into ``logits_out`` when given and materialises nothing otherwise.
        ``against``: another head's [n, V] logits u_a (this shard's columns, unit column stride; a
        distillation's teacher, flce.distillation.semantics.student_reads_teacher) read tile by tile
        beside these, sum_exp_dz then being sum exp(z - max) (z - max - u_a / T) (no softcap)."""


class FusedGradGemm(Protocol):
    """Capability FUSED_GRAD_GEMM."""

    def gemm_grad(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        cfg: LCEConfig, vocab_offset: int, lse: torch.Tensor, coeffs: GradCoefficients,
    ) -> torch.Tensor:
        """d loss / d u of the logits hidden @ weight.T + bias from one GEMM whose epilogue applies
        semantics.py's formula, so the logits never reach memory."""


class KeptExponentials(Protocol):
    """Capability KEPT_EXPONENTIALS: calls whose gradient is a row multiple of softmax - onehot
    (flce.gradients.gradient_is_row_scaled_softmax: the plain loss, a temperature, token weights)."""

    def gemm_exp_grad(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, cfg: LCEConfig,
        grad_scale: torch.Tensor, exp_out: torch.Tensor,
    ) -> tuple[RowStats, torch.Tensor]:
        """(row statistics, row_scale [n] fp32) of the logits z = hidden @ weight.T / cfg.temperature, with
        ``exp_out`` [n, V] (the inputs' dtype) written such that row_scale[:, None] * exp_out is the gradient of
        the raw logits, (softmax(z) - onehot) * grad_scale / cfg.temperature: the two gradient products are then
        GEMMs on exp_out whose rows (grad_hidden) or whose other operand's rows (grad_weight) are scaled."""

    def scale_rows(self, src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [n, H] = src * scale[:, None] (fp32 [n]) computed in fp32 and rounded once; out may be src."""


def options_only_reference_serves(cfg: LCEConfig, scan_keeps_logit_stats: bool) -> list[str]:
    """Options set in ``cfg`` that only the reference backend's kernels and planner implement so far,
    each with why: a Triton backend's support check declines such a call, so the registry routes it to
    the reference backend (on the same device) and says why, once. ``scan_keeps_logit_stats``: the
    backend's row-kernel scan keeps the row min and sum of z (its planner then avoids fused statistics)."""
    reasons = []
    if cfg.return_logit_stats and not scan_keeps_logit_stats:
        reasons.append("return_logit_stats (the Triton scan kernels keep no row min or sum of z)")
    if cfg.batch_invariant:
        reasons.append("batch_invariant (fixed-shape token tiles are planned by the reference backend only)")
    return reasons
