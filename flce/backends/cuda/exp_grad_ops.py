"""Launchers of the loss's gradient from kept exponentials (exp_grad_kernels.py).

The schedule (engine capability KEPT_EXPONENTIALS) for one token chunk of a training call whose gradient is a
per-row multiple of softmax - onehot (the plain loss; a temperature, token weights:
flce.gradients.gradient_is_row_scaled_softmax):

1. :func:`exp_offsets`: c per row from the target's logit (a dot product per row, before the GEMM);
2. the warp-specialised statistics GEMM writes E = exp2(y - c) instead of the logits (ws_gemm_ops,
   exp_offset=) and the row statistics as before; elsewhere the logits and :func:`exponentials_from_logits_`;
3. :func:`finish_exp_rows`: per row the lse from the merged statistics, the scale s with G = s * E, the
   target's column of E set so that s * E is p_t - 1 there, the rows past the GEMM's cap listed;
4. :func:`redo_exp_rows`: those rows' E recomputed from their logits as their gradient, with the lse of those
   logits, which replaces theirs in the statistics (no rows: one launch whose programs read a count);
5. the gradient GEMMs: grad_hidden = s * (E @ W), grad_weight += E.T @ (s * x) (engine/rows.py).

What it saves: the pass that turns a chunk's logits into its gradient (one read and one write of
[rows, V]), for one multiply a logit in the GEMM's epilogue and two small row scalings.
"""

from __future__ import annotations

import torch
import triton

from flce.backends.cuda import exp_grad_kernels as k
from flce.semantics import PartialRowStats, RowStats

_FINISH_BLOCK = 256
_REDO_ROWS, _REDO_COLS, _REDO_K = 16, 128, 64


def exp_offsets(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                temperature: float = 1.0) -> torch.Tensor:
    """[n] fp32 base-2 offsets c: the target's logit (in fp32 from the inputs, divided by the temperature) +
    OFFSET_ABOVE_TARGET; 0 on ignored rows."""
    n, hidden_size = hidden.shape
    offsets = torch.empty(n, dtype=torch.float32, device=hidden.device)
    if n:
        block = min(1024, triton.next_power_of_2(max(hidden_size, 16)))
        k._exp_offsets_kernel[(n,)](hidden, hidden.stride(0), weight, weight.stride(0), target, offsets, hidden_size,
                                    weight.shape[0], ignore_index, 1.0 / temperature, BLOCK_H=block, num_warps=4)
    return offsets


def exponentials_from_logits_(logits: torch.Tensor, offsets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The logits u [n, V] overwritten with exp2(min(y - c, CAP)), y = u log2(e) / temperature (what the fused GEMM
    writes)."""
    n, vocab = logits.shape
    if n:
        block = min(4096, triton.next_power_of_2(max(vocab, 16)))
        k._exp_logits_kernel[(n, triton.cdiv(vocab, block))](logits, logits.stride(0), offsets, vocab,
                                                              1.0 / temperature, BLOCK_V=block, num_warps=8)
    return logits


def finish_exp_rows(exp: torch.Tensor, target: torch.Tensor, ignore_index: int, partial: PartialRowStats,
                    offsets: torch.Tensor, grad_scale: torch.Tensor, temperature: float = 1.0
                    ) -> tuple[RowStats, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the row statistics: lse [n] fp32 and target_z, natural; row_scale [n] fp32; rows to redo [n] int32; their
    count [1] int32) from the chunk's merged statistics (row max, sum of exponentials, target_z) and the
    upstream per-row scale; writes the target's column of E. row_scale includes 1 / temperature: the gradient
    products multiply the raw logits' operands."""
    n, vocab = exp.shape
    lse = torch.empty(n, dtype=torch.float32, device=exp.device)
    row_scale = torch.empty(n, dtype=torch.float32, device=exp.device)
    redo_rows = torch.empty(n, dtype=torch.int32, device=exp.device)
    redo_count = torch.zeros(1, dtype=torch.int32, device=exp.device)
    if n:
        k._exp_rows_finish_kernel[(triton.cdiv(n, _FINISH_BLOCK),)](
            exp, exp.stride(0), target, partial.row_max, partial.sum_exp, lse, partial.target_z, offsets, grad_scale,
            grad_scale.stride(0) if grad_scale.dim() else 0, 1.0 / temperature, row_scale, redo_rows, redo_count, n,
            vocab, ignore_index, BLOCK=_FINISH_BLOCK, num_warps=4)
    return RowStats(lse=lse, target_z=partial.target_z), row_scale, redo_rows, redo_count


def redo_exp_rows(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, redo_rows: torch.Tensor,
                  redo_count: torch.Tensor, exp: torch.Tensor, lse: torch.Tensor, temperature: float = 1.0) -> None:
    """E of the listed rows recomputed as their gradient (finish_exp_rows gave them the upstream scale / temperature
    alone), with the lse of the recomputed logits, written into ``lse`` [n] (natural) for those rows. No host sync:
    the kernel reads the count."""
    n, vocab = exp.shape
    if n:
        k._exp_rows_redo_kernel[(triton.cdiv(n, _REDO_ROWS),)](
            hidden, hidden.stride(0), weight, weight.stride(0), target, redo_rows, redo_count, exp, exp.stride(0), lse,
            hidden.shape[1], vocab, 1.0 / temperature, BLOCK_R=_REDO_ROWS, BLOCK_V=_REDO_COLS, BLOCK_K=_REDO_K,
            IEEE=hidden.dtype == torch.float32, num_warps=4)


def scale_rows(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [n, H] = src * scale[:, None] (fp32 [n]), rounded once to out's dtype; out may be src. One pass where
    PyTorch's broadcast of an fp32 column over 16-bit rows takes its unvectorised kernel (3-4x slower, H100)."""
    n, cols = src.shape
    if n and cols:
        block = min(2048, triton.next_power_of_2(cols))
        k._scale_rows_kernel[(n, triton.cdiv(cols, block))](src, src.stride(0), out, out.stride(0), scale, cols,
                                                            BLOCK=block, num_warps=4)
    return out
