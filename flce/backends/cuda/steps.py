"""The steps of a CUDA call's record: for the plan and the kernel choice, which functions each step
launches (their dotted paths: the Triton and Gluon kernels of this package, cuBLAS as the torch function
that calls it), following exactly what the schedules (flce/engine) and the launchers (ops.py) run.
"""

from __future__ import annotations

import torch

from flce.backends.cuda.configs import (
    TRITON_STATS_GEMM,
    WARP_SPECIALIZED,
    WS_GEMM,
    KernelChoice,
)
from flce.engine.call import grads_in_forward_allowed
from flce.engine.choice import CallDescription, DeviceDescription, Step
from flce.engine.plans import EXPONENTIALS, FUSED, AllRows, Plan, TokenChunks, VocabBlocks
from flce.engine.rows import logits_dtype
from flce.engine.token_chunks import kept_rows

_K = "flce.backends.cuda."
MERGE_SPLITS = _K + "gemm_kernels._merge_splits_kernel"
TRITON_STATS = (TRITON_STATS_GEMM, _K + "gemm_kernels._target_logit_kernel", MERGE_SPLITS)
PLAIN_FORWARD = _K + "kernels._plain_forward_kernel"
PLAIN_GRAD = _K + "kernels._plain_grad_kernel"
ROW_STATS = _K + "kernels._row_stats_kernel"
FULL_GRAD = _K + "kernels._full_grad_kernel"
SCALE = _K + "kernels._scale_kernel"
EXP_OFFSETS = _K + "exp_grad_kernels._exp_offsets_kernel"
EXP_LOGITS = _K + "exp_grad_kernels._exp_logits_kernel"
EXP_FINISH = _K + "exp_grad_kernels._exp_rows_finish_kernel"
EXP_REDO = _K + "exp_grad_kernels._exp_rows_redo_kernel"
SCALE_ROWS = _K + "exp_grad_kernels._scale_rows_kernel"
COUNT_TOKENS = _K + "target_kernels._count_tokens_kernel"
WS_LAUNCH = "ws_gemm_ops.ROW_STATS_CONFIG (statistics) / DEFAULT_CONFIG (products), one program per SM"


def statistics_kernels(kernel: str) -> tuple[str, ...]:
    """A fused statistics GEMM (gemm_ops.gemm_row_stats or ws_gemm_ops.ws_partial_row_stats), with the merge
    of its per-tile partials."""
    return (WS_GEMM, MERGE_SPLITS) if kernel == WARP_SPECIALIZED else TRITON_STATS


def of_plan(device: DeviceDescription, call: CallDescription, plan: Plan, kernels: KernelChoice,
            why: object) -> list[Step]:
    """The steps of ``plan`` in the order they run (``why``: choice._Reasons), after the pass over the targets."""
    targets = Step("the targets: the non-ignored count the means divide by, and the range check", (COUNT_TOKENS,),
                   "one kernel and a device-side assertion before the first GEMM (target_ops.py)")
    return [targets, *_plan_steps(device, call, plan, kernels, why)]


def _plan_steps(device: DeviceDescription, call: CallDescription, plan: Plan, kernels: KernelChoice,
                why: object) -> list[Step]:
    cfg = call.cfg
    in_forward = call.request.training and grads_in_forward_allowed(cfg)
    accurate = logits_dtype(call.dtype, cfg) != call.dtype
    cublas_logits = "torch.addmm" if call.bias and not accurate else "torch.mm"
    row = kernels.launch
    row_launch = f"BLOCK_V up to {row.block_v}, {row.num_warps or '4 or 8'} warps ({why.launch})"
    gemm_launch = f"{kernels.gemm.text()} ({why.gemm})"
    full_or_plain_grad = PLAIN_GRAD if call.plain else FULL_GRAD

    def fused_statistics(name: str, kernel: str, reason: str) -> Step:
        fallback = TRITON_STATS if kernel == WARP_SPECIALIZED else (cublas_logits, ROW_STATS)
        return Step(name, statistics_kernels(kernel), reason, WS_LAUNCH if kernel == WARP_SPECIALIZED else gemm_launch,
                    fallback)

    def all_rows(stats: AllRows, when: str) -> Step:
        name = f"statistics of all rows{when}"
        if stats.forward_stats == FUSED:
            return fused_statistics(name, kernels.stats, f"{why.forward_stats}; kernel: {why.stats_kernel}")
        return Step(name, (cublas_logits, ROW_STATS), why.forward_stats,
                    f"vocabulary blocks of {stats.scan_block} columns; {row_launch}")

    def bias_sums(when: str) -> list[Step]:
        if not (call.request.training and call.bias):
            return []
        sums = "torch.addmm" if device.type == "cuda" and call.dtype != torch.float32 and not accurate else \
            "torch.Tensor.sum"
        return [Step(f"grad_bias: column sums of the gradient{when}, if bias requires grad", (sums,),
                     "cuBLAS ones @ G into fp32 for 16-bit gradients on the GPU (no staging of a split reduction), "
                     "else torch's sum")]

    def scaled_in_backward() -> list[Step]:
        return [Step("backward: the gradients times grad_output", (SCALE,),
                     "in-forward gradients; the kernel skips the pass when grad_output is exactly 1")]

    fp32_weight = cfg.accum_dtype == torch.float32 and call.dtype != torch.float32
    fp32_product = "torch.addmm" if device.type == "cuda" else "torch.matmul"
    if isinstance(plan, AllRows):
        return [all_rows(plan, "")]
    if isinstance(plan, VocabBlocks):
        when = " (in forward)" if in_forward else " (in backward)"
        gradient = (Step(f"block gradient{when}", (kernels.grad_gemm,), why.backward_grad, gemm_launch,
                         (cublas_logits, FULL_GRAD))
                    if plan.backward_grad == FUSED else
                    Step(f"block gradient{when}", (cublas_logits, FULL_GRAD), why.backward_grad, row_launch))
        products = (fp32_product,) if fp32_weight else ("torch.Tensor.addmm_", "torch.mm")
        return [all_rows(plan.stats, " (in forward)"), gradient,
                Step(f"gradient products of each block{when}", products,
                     "cuBLAS: each block's rows of grad_weight are written once, grad_hidden accumulates "
                     "(the warp-specialised GEMM measured 0-23% slower on these products: docs/design-notes.md)"),
                *bias_sums(when), *(scaled_in_backward() if in_forward else [])]

    assert isinstance(plan, TokenChunks)
    n_rows = call.n_rows
    deferred = call.request.training and not in_forward
    keep = kept_rows(plan, n_rows) if deferred else 0
    chunks = -(-n_rows // max(1, plan.tokens_per_chunk))
    out: list[Step] = []
    if not in_forward and keep == 0 and plan.stats_first is not None:
        out.append(all_rows(plan.stats_first, " (in forward)"))
    elif in_forward and plan.chunk_grad == EXPONENTIALS:
        making = ((WS_GEMM, MERGE_SPLITS) if kernels.logits == WARP_SPECIALIZED else (*TRITON_STATS, EXP_LOGITS))
        out.append(Step("each chunk: exponentials and statistics (the gradient up to a row scale)",
                        (EXP_OFFSETS, *making, EXP_FINISH, EXP_REDO), f"{why.chunk_grad}; kernel: {why.logits_kernel}",
                        WS_LAUNCH if kernels.logits == WARP_SPECIALIZED else gemm_launch,
                        (*TRITON_STATS, EXP_LOGITS) if kernels.logits == WARP_SPECIALIZED else ()))
    elif plan.forward_logits == FUSED:
        out.append(fused_statistics("each chunk: logits and statistics", kernels.logits,
                                    f"{why.forward_logits}; kernel: {why.logits_kernel}"))
        if in_forward:
            out.append(Step("each chunk: gradient over its logits", (full_or_plain_grad,),
                            f"{why.chunk_grad if call.plain else 'the full variant'}: the row kernel", row_launch))
    elif call.plain:
        out.append(Step("each chunk: logits, loss" + (" and gradient" if in_forward else ""),
                        (cublas_logits, PLAIN_FORWARD), why.forward_logits, row_launch))
    else:
        out.append(Step("each chunk: logits and statistics", (cublas_logits, ROW_STATS), why.forward_logits,
                        row_launch))
        if in_forward:
            out.append(Step("each chunk: gradient over its logits", (FULL_GRAD,), "the full variant's row kernel",
                            row_launch))
    if not call.request.training:
        return out
    when = " (in forward)" if in_forward else " (in backward)"
    if deferred:
        if keep:
            out.append(Step(f"backward: gradient of the {keep} kept rows' logits", (full_or_plain_grad,),
                            "logits kept from forward (the memory plan's save limit)", row_launch))
        if keep < n_rows:
            out.append(Step("backward: each recomputed chunk's gradient", (kernels.grad_gemm,), why.backward_grad,
                            gemm_launch, (cublas_logits, FULL_GRAD)) if plan.backward_grad == FUSED else
                       Step("backward: each recomputed chunk's gradient", (cublas_logits, full_or_plain_grad),
                            why.backward_grad, row_launch))
    updates = (keep > 0) + -(-(n_rows - keep) // max(1, plan.tokens_per_chunk)) if deferred else chunks
    hidden_product = (WS_GEMM,) if kernels.products == WARP_SPECIALIZED else ("torch.mm",)
    if fp32_weight:
        weight_product = (fp32_product,)
    elif kernels.products == WARP_SPECIALIZED:
        weight_product = (WS_GEMM,)
    else:  # the first product writes the weight gradient, the others add into it
        weight_product = ("torch.mm", "torch.Tensor.addmm_") if updates > 1 else ("torch.mm",)
    exponentials = in_forward and plan.chunk_grad == EXPONENTIALS
    products = tuple(dict.fromkeys(((SCALE_ROWS,) if exponentials else ()) + hidden_product + weight_product))
    reason = why.products + ("; grad_weight accumulated in fp32 by cuBLAS (accum_dtype)" if fp32_weight else "")
    out.append(Step(f"gradient products G @ W and G.T @ x{when}", products, reason,
                    WS_LAUNCH if kernels.products == WARP_SPECIALIZED else "",
                    ("torch.mm", "torch.Tensor.addmm_") if kernels.products == WARP_SPECIALIZED else ()))
    out += bias_sums(when)
    if in_forward:
        out += scaled_in_backward()
    return out

