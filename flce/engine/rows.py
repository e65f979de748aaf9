"""Pieces every schedule uses: a chunk's logits, the gradient accumulator, statistics of row ranges,
and the forward state built from all rows' statistics."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from flce.config import LCEConfig
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
from flce.engine.objective import Objective
from flce.inputs import FlatInputs, assert_targets_in_range
from flce.semantics import (
    Denominators,
    RowStats,
    RowTerms,
    TokenCounts,
    count_tokens,
    extras,
    reduce_terms,
    statistics_dtype,
)


def logits_dtype(weight_dtype: torch.dtype, cfg: LCEConfig) -> torch.dtype:
    """The dtype the logits are written in: the compute dtype, or fp32 under precision="accurate"."""
    if cfg.precision == "accurate" and weight_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight_dtype


def logits_bytes_per_row(vocab: int, weight_dtype: torch.dtype, cfg: LCEConfig) -> int:
    """Bytes per token row of a chunk's logits; under precision="accurate" for 16-bit inputs, the fp32
    logits and the 16-bit copy of their gradient that the two gradient GEMMs read."""
    dtype = logits_dtype(weight_dtype, cfg)
    extra = weight_dtype.itemsize if dtype != weight_dtype else 0
    return vocab * (dtype.itemsize + extra)


class WorkBuffer:
    """One allocation that every chunk (or vocabulary block) of a schedule writes its logits into.

    A fresh chunk-sized allocation per chunk fragments glibc's heap on the CPU once its dynamic mmap
    threshold has risen past the chunk size: at 4096 x 1024 x 32000 fp32 with memory_budget=16 MiB
    the deferred schedule's peak RSS grew 106 MiB above the gradients against 26 MiB with one reused
    buffer (one run each; such RSS readings vary run to run). CUDA's caching allocator recycles the
    same block either way."""

    def __init__(self, like: torch.Tensor, rows: int, cols: int, dtype: torch.dtype | None = None):
        self.storage = like.new_empty(max(0, rows) * cols, dtype=dtype or like.dtype)

    def view(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous [rows, cols] view of the buffer's start."""
        return self.storage[: rows * cols].view(rows, cols)


def gemm_logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w.T + bias from one plain GEMM, in out's dtype: fp32 logits of 16-bit operands come
    from cuBLAS's fp32 output on CUDA, and from fp32 operands elsewhere (no fp32-output GEMM there)."""
    if out.dtype == x.dtype:
        if bias is None:
            return torch.mm(x, w.t(), out=out)
        return torch.addmm(bias, x, w.t(), out=out)
    if x.is_cuda:
        torch.mm(x, w.t(), out_dtype=out.dtype, out=out)
    else:
        torch.mm(x.to(out.dtype), w.t().to(out.dtype), out=out)
    return out if bias is None else out.add_(bias.to(out.dtype))


def chunk_logits(flat: FlatInputs, rows: slice, out: torch.Tensor) -> torch.Tensor:
    """u = hidden[rows] @ weight.T + bias from one plain GEMM, written into out."""
    return gemm_logits(flat.hidden[rows], flat.weight, flat.bias, out)


def block_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cols: slice,
                 buffer: WorkBuffer) -> torch.Tensor:
    """u[:, cols] of all rows from one plain GEMM, written into ``buffer``."""
    w = weight[cols]
    return gemm_logits(hidden, w, None if bias is None else bias[cols], buffer.view(hidden.shape[0], w.shape[0]))


def torch_matmul_(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b with ``accumulate``, by torch (cuBLAS on CUDA): fp32 sums rounded
    once to out's dtype. What RowKernels.matmul_ does on a backend without a GEMM of its own."""
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def torch_count_tokens(target: torch.Tensor, ignore_index: int, dtype: torch.dtype, vocab: int | None) -> TokenCounts:
    """RowKernels.count_tokens by PyTorch ops (a dozen small launches)."""
    if vocab is not None:
        assert_targets_in_range(target, vocab, ignore_index)
    return count_tokens(target, ignore_index, dtype)


class GradAccumulator:
    """Turns each chunk's grad-logits into grad_hidden rows and grad_weight / grad_bias sums."""

    def __init__(self, kernels: object, flat: FlatInputs, cfg: LCEConfig, wanted: GradTargets,
                 start_hidden_reduce: Callable[[torch.Tensor], Callable[[], None]] | None = None):
        x, w = flat.hidden, flat.weight
        self.kernels, self.flat, self.wanted = kernels, flat, wanted
        self.grad_hidden = torch.empty_like(x) if wanted.hidden else None
        # A sharded call's grad_hidden reduction across the ranks (engine.call.Sharding): started once its last
        # rows exist, beside the weight-gradient product that follows them, and waited for in result().
        self.start_hidden_reduce = start_hidden_reduce if wanted.hidden else None
        self.hidden_reduced: Callable[[], None] | None = None
        # precision="accurate" with 16-bit inputs: the fp32 logit gradient enters the products whole (as two
        # 16-bit parts, _add_exact) and both gradients are fp32 sums rounded once, as torch's accurate policy.
        self.exact = logits_dtype(w.dtype, cfg) != w.dtype
        fp32_acc = (cfg.accum_dtype == torch.float32 or self.exact) and w.dtype != torch.float32
        self.weight_acc = None
        self.weight_written = False
        if wanted.weight:
            # fp32 accumulators are added into from the first chunk on; a same-dtype gradient is
            # written by the first chunk's GEMM, which saves a V x H zero fill.
            alloc = torch.zeros if fp32_acc else torch.empty
            self.weight_acc = alloc(w.shape, dtype=torch.float32 if fp32_acc else w.dtype, device=w.device)
        self.bias_acc = (
            torch.zeros(w.shape[0], dtype=statistics_dtype(w.dtype), device=w.device) if wanted.bias else None
        )

    def add(self, grad_logits: torch.Tensor, rows: slice) -> None:
        x_rows = self.flat.hidden[rows]
        if self.bias_acc is not None:
            self.kernels.add_column_sums_(self.bias_acc, grad_logits)
        if self.exact:
            self._add_exact(grad_logits, x_rows, rows)
            return
        if self.grad_hidden is not None:
            self.kernels.matmul_(grad_logits, self.flat.weight, self.grad_hidden[rows], False)
            self._hidden_rows_written(rows)
        if self.weight_acc is not None:
            if self.weight_acc.dtype != grad_logits.dtype:
                self.kernels.accumulate_fp32_(self.weight_acc, grad_logits.t(), x_rows)
            else:
                self.kernels.matmul_(grad_logits.t(), x_rows, self.weight_acc, self.weight_written)
                self.weight_written = True

    def _add_exact(self, grad_logits: torch.Tensor, x_rows: torch.Tensor, rows: slice) -> None:
        """add() of precision="accurate"'s fp32 gradient: both products in fp32 over its two 16-bit parts
        (fp32_parts), grad_hidden's rows rounded once, grad_weight kept in fp32 across chunks."""
        sums = None
        if self.grad_hidden is not None:
            sums = torch.zeros(grad_logits.shape[0], x_rows.shape[1], dtype=torch.float32, device=x_rows.device)
        for second, part in enumerate(fp32_parts(grad_logits, self.flat.weight.dtype)):
            if sums is not None:
                self.kernels.accumulate_fp32_(sums, part, self.flat.weight)
                if second:
                    self.grad_hidden[rows] = sums
                    self._hidden_rows_written(rows)
            if self.weight_acc is not None:
                self.kernels.accumulate_fp32_(self.weight_acc, part.t(), x_rows)

    def add_row_scaled(self, exp: torch.Tensor, row_scale: torch.Tensor, rows: slice) -> None:
        """add() for the gradient row_scale[:, None] * exp (KeptExponentials.gemm_exp_grad; no bias): grad_weight
        += exp.T @ (row_scale * x), then grad_hidden = row_scale * (exp @ W), each product one GEMM on exp.
        The scaled x rows are written into grad_hidden's rows before that GEMM overwrites them."""
        assert self.bias_acc is None, "the kept exponentials carry no bias gradient"
        x_rows = self.flat.hidden[rows]
        if self.weight_acc is not None:
            scaled_x = self.grad_hidden[rows] if self.grad_hidden is not None else torch.empty_like(x_rows)
            self.kernels.scale_rows(x_rows, row_scale, scaled_x)
            if self.weight_acc.dtype != exp.dtype:
                self.kernels.accumulate_fp32_(self.weight_acc, exp.t(), scaled_x)
            else:
                self.kernels.matmul_(exp.t(), scaled_x, self.weight_acc, self.weight_written)
                self.weight_written = True
        if self.grad_hidden is not None:
            grad_rows = self.grad_hidden[rows]
            self.kernels.matmul_(exp, self.flat.weight, grad_rows, False)
            self.kernels.scale_rows(grad_rows, row_scale, grad_rows)

    def _hidden_rows_written(self, rows: slice) -> None:
        """Start grad_hidden's reduction once its last rows are written (chunks come in order)."""
        if self.start_hidden_reduce is not None and rows.stop >= self.flat.hidden.shape[0]:
            self.hidden_reduced = self.start_hidden_reduce(self.grad_hidden)
            self.start_hidden_reduce = None

    def result(self) -> Grads:
        if self.start_hidden_reduce is not None and self.grad_hidden.numel():  # no rows written: start it now
            self.hidden_reduced = self.start_hidden_reduce(self.grad_hidden)
        if self.hidden_reduced is not None:
            self.hidden_reduced()
            self.hidden_reduced = None
        w = self.flat.weight
        if self.weight_acc is not None and self.weight_acc.dtype == w.dtype and not self.weight_written:
            self.weight_acc.zero_()  # no rows at all
        grad_weight = None if self.weight_acc is None else self.weight_acc.to(w.dtype)
        grad_bias = None
        if self.bias_acc is not None:
            assert self.flat.bias is not None
            grad_bias = self.bias_acc.to(self.flat.bias.dtype)
        return self.grad_hidden, grad_weight, grad_bias


def fp32_parts(grad: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """precision="accurate"'s fp32 gradient G as two parts in the 16-bit ``dtype``: G's rounding, then the
    rounding of the rest, together 16 of fp32's 24 mantissa bits for bf16 (22 for fp16) where one 16-bit
    rounding keeps 8 (11). 16-bit GEMMs keep their speed, and their fp32 sums over both parts carry the fp32
    gradient, as torch's accurate policy does with fp32 GEMMs. The second part is written over the first (use
    each before asking for the next) and G, a scratch chunk, holds the rest afterwards: one 16-bit copy of G."""
    part = grad.to(dtype)
    yield part
    part.copy_(grad.sub_(part))
    yield part


def forward_state(call: EngineCall, flat: FlatInputs, stats: RowStats, denoms: Denominators, terms: RowTerms,
                  objective: Objective, *, keep_stats: bool) -> ForwardState:
    """Loss, extras and (keep_stats: the gradients follow from them) the statistics and ``objective``, from all
    rows' and their loss terms (the objective's, flce.engine.objective, knowing every row's statistics)."""
    loss, z_loss = reduce_terms(terms, call.cfg, denoms)
    extra = extras(stats, terms, flat.target, call.cfg, denoms, call.vocab(flat.weight.shape[0]))
    return ForwardState(loss=loss, z_loss=z_loss, extras=extra, denoms=denoms, stats=stats if keep_stats else None,
                        objective=objective if keep_stats else None)


def slice_stats(stats: RowStats, rows: slice) -> RowStats:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return RowStats(lse=stats.lse[rows], target_z=stats.target_z[rows], entropy=part(stats.entropy),
                    lse_minus_mean_z=part(stats.lse_minus_mean_z),
                    weighted_sum_z=part(stats.weighted_sum_z), argmax=part(stats.argmax),
                    row_max=part(stats.row_max), row_min=part(stats.row_min), sum_z=part(stats.sum_z))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' row tensors as one: a single chunk's as it is (a call in one chunk copies nothing)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def concat_terms(chunks: list[RowTerms], target: torch.Tensor) -> RowTerms:
    if not chunks:
        empty = torch.zeros(0, dtype=torch.float32, device=target.device)
        return RowTerms(empty, None, torch.zeros(0, dtype=torch.bool, device=target.device))
    return RowTerms(
        _joined([c.cross_entropy for c in chunks]),
        None if chunks[0].z_loss is None else _joined([c.z_loss for c in chunks]),
        _joined([c.valid for c in chunks]),
        None if chunks[0].smoothing is None else _joined([c.smoothing for c in chunks]),
    )


def concat_stats(chunks: list[RowStats], target: torch.Tensor) -> RowStats:
    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(c, name) for c in chunks]
        if not parts:
            dtype = torch.int64 if name == "argmax" else torch.float32
            return torch.zeros(0, dtype=dtype, device=target.device)
        return None if parts[0] is None else _joined(parts)

    return RowStats(
        lse=cat("lse"), target_z=cat("target_z"), entropy=cat("entropy"), lse_minus_mean_z=cat("lse_minus_mean_z"),
        weighted_sum_z=cat("weighted_sum_z"), argmax=cat("argmax"),
        row_max=cat("row_max"), row_min=cat("row_min"), sum_z=cat("sum_z"),
    )
