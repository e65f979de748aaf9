"""The steps of a TokenChunks plan run by row kernels between torch GEMMs (the reference and Ascend
backends; the CUDA backend's steps add its fused GEMMs, backends/cuda/steps.py): each step's functions,
as a backend names its row kernels, in the order the schedule (token_chunks.py) runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flce.engine.call import grads_in_forward_allowed, logits_kept_for_gradients
from flce.engine.choice import CallDescription, Step
from flce.engine.plans import TokenChunks, kept_rows
from flce.engine.rows import logits_dtype


@dataclass(frozen=True)
class RowKernelNames:
    """The dotted paths of what a backend's RowKernels methods launch, one per role."""

    plain_loss: str  # plain_loss: the loss row by row (and, in forward, the gradient over the logits)
    plain_grad: str  # plain_grad_
    row_stats: str  # row_stats
    full_grad: str  # full_grad_
    scale: str  # scale_
    bias_sums: str  # add_column_sums_
    fp32_product: str  # accumulate_fp32_


def logits_gemm(call: CallDescription) -> str:
    """The torch function a chunk's logits come from (flce.engine.rows.gemm_logits)."""
    return "torch.addmm" if call.bias and logits_dtype(call.dtype, call.cfg) == call.dtype else "torch.mm"


def row_kernel_steps(call: CallDescription, plan: TokenChunks, names: RowKernelNames,
                     launch: Callable[[str], str]) -> tuple[Step, ...]:
    """The steps of ``plan``; ``launch(role)``: how the role's kernel is launched (blocks, programs)."""
    cfg = call.cfg
    in_forward = call.request.training and grads_in_forward_allowed(cfg)
    # A sequence-level objective: forward takes every row's statistics, then the gradients as a backward would.
    second_pass = in_forward and call.request.statistics_first
    gemm = logits_gemm(call)
    grad = names.plain_grad if call.plain else names.full_grad
    options = ", ".join(cfg.full_feature_options()) or "per-token outputs"
    why_variant = "the plain variant's row kernel" if call.plain else f"the full variant's row kernels ({options})"
    if call.plain:
        steps = [Step("each chunk: logits, loss" + (" and gradient" if in_forward else ""), (gemm, names.plain_loss),
                      why_variant, launch("plain_grad" if in_forward else "plain_loss"))]
    else:
        steps = [Step("each chunk: logits and statistics", (gemm, names.row_stats), why_variant, launch("row_stats"))]
        if in_forward and not second_pass:
            steps.append(Step("each chunk: gradient over its logits", (names.full_grad,), why_variant,
                              launch("full_grad")))
    if not call.request.training:
        return tuple(steps)
    kept = logits_kept_for_gradients(cfg, call.request)
    keep = kept_rows(plan, call.n_rows) if kept else 0
    if kept:
        when_grads = "forward, after every row's statistics" if second_pass else "backward"
        if keep:
            steps.append(Step(f"{when_grads}: gradient of the {keep} kept rows' logits", (grad,),
                              "logits kept from forward (the memory plan's save limit)",
                              launch("plain_grad" if call.plain else "full_grad")))
        if keep < call.n_rows:
            steps.append(Step(f"{when_grads}: each recomputed chunk's gradient", (gemm, grad), why_variant,
                              launch("plain_grad" if call.plain else "full_grad")))
    updates = (keep > 0) + -(-(call.n_rows - keep) // max(1, plan.tokens_per_chunk))
    exact = logits_dtype(call.dtype, cfg) != call.dtype  # precision="accurate": both products in fp32
    fp32_weight = (cfg.accum_dtype == torch.float32 or exact) and call.dtype != torch.float32
    weight = (names.fp32_product,) if fp32_weight else ("torch.mm", "torch.Tensor.addmm_") if updates > 1 else (
        "torch.mm",)
    hidden = (names.fp32_product,) if exact else ("torch.mm",)
    when = " (in forward)" if in_forward else " (in backward)"
    why = ("; the fp32 gradient as two 16-bit parts, both products summed in fp32 (precision='accurate')" if exact
           else "; grad_weight accumulated in fp32 (accum_dtype)" if fp32_weight else "")
    steps.append(Step(f"gradient products G @ W and G.T @ x{when}", tuple(dict.fromkeys((*hidden, *weight))),
                      "torch GEMMs" + why))
    if call.bias:
        steps.append(Step(f"grad_bias: column sums of the gradient{when}, if bias requires grad", (names.bias_sums,),
                          "the backend's column sums"))
    if in_forward:
        steps.append(Step("backward: the gradients times grad_output", (names.scale,),
                          "in-forward gradients, scaled in place"))
    return tuple(steps)
