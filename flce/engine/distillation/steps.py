"""The steps of a DistillChunks plan as a backend's record names them (``python -m flce explain`` prints
them): each step's functions, in the order flce.engine.distillation.schedule runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flce.distillation.semantics import needs_cross, student_reads_teacher
from flce.engine.choice import Step
from flce.engine.distillation.call import DistillChunks, DistillDescription


@dataclass(frozen=True)
class PairKernelNames:
    """The dotted paths of what a backend's PairKernels (and RowKernels) methods launch, one per role."""

    pair_stats: str  # pair_stats: both softmaxes' statistics
    mixture_sums: str  # mixture_sums: JSD's second pass
    pair_grad: str  # pair_grad_: the gradients over the logits
    scale: str  # scale_
    bias_sums: str  # add_column_sums_
    logits_gemm: str = "torch.mm"  # the chunk's logits (flce.engine.rows.gemm_logits)
    grad_gemms: tuple[str, ...] = ("torch.mm", "torch.Tensor.addmm_")  # RowKernels.matmul_'s GEMMs
    pair_passes: str = ""  # FusedPairPasses.pair_passes_ (a plan with fused_passes)
    count_tokens: str = ""  # count_tokens, where it launches a kernel of the backend's own


def distillation_steps(desc: DistillDescription, plan: DistillChunks, names: PairKernelNames,
                       launch: Callable[[str], str],
                       products: Callable[[str, tuple[str, ...]], Step] | None = None,
                       logits: Step | None = None, logits_reason: str = "") -> tuple[Step, ...]:
    """The steps of ``plan``; ``launch(role)``: how the role's kernel is launched (blocks, programs);
    ``products(name, kernels)``: the gradient products' step where the backend chooses their kernels itself
    (``kernels``: the RowKernels GEMMs a plan of this many chunks runs); ``logits``: the chunk logits' step of a
    plan with stats_in_gemm (the backend's FusedStatsGemm kernels); ``logits_reason``: why a plan without it takes
    its logits from cuBLAS."""
    cfg = desc.cfg
    training = desc.request.training
    in_forward = desc.grads_in_forward
    teacher = training and cfg.teacher_grad
    chunks = -(-desc.n_rows // plan.tokens_per_chunk) if desc.n_rows else 0
    gemm = "torch.addmm" if (desc.student_bias or desc.teacher_bias) and names.logits_gemm == "torch.mm" \
        else names.logits_gemm
    what = cfg.loss + (", the hard-label term" if cfg.hard else "")
    jsd = cfg.soft and cfg.loss == "jsd"
    who = "the student's and the teacher's" if teacher else "the student's"
    steps = []
    if names.count_tokens:
        steps.append(Step("the targets, where given: the non-ignored count the mean divides by, and the range check",
                          (names.count_tokens,), "one kernel and a device-side assertion before the first GEMM"))
    if plan.stats_in_gemm:
        steps.append(logits)
    else:
        steps.append(Step(f"each of {chunks} chunks: teacher and student logits", (gemm,),
                          f"two GEMMs into two buffers of {plan.tokens_per_chunk} rows x V"
                          + (f" ({logits_reason})" if logits_reason else "")))
    entropy = " and the student's entropy sum" if cfg.return_entropy else ""
    first_pass = [] if plan.stats_in_gemm else [f"both softmaxes' statistics{entropy}"]
    # forward KL on the GEMMs' statistics (semantics.per_head_unfit): E_p[t - s] from the gradient's sweep, as the
    # schedule takes it (reverse KL's E_q[s - t] comes from the student's GEMM)
    expectation = (" and the loss's E_p[t - s]" if plan.stats_in_gemm and needs_cross(cfg)
                   and not student_reads_teacher(cfg) else "")
    if plan.fused_passes:
        passes = first_pass + (["JSD's second pass (KL(P||M), KL(Q||M))"] if jsd else [])
        passes += [f"{who} gradient over the logits{expectation}"] if in_forward else []
        why = (f"one pass over both logits ({what})" if len(passes) == 1 else
               f"{what}; a row's sweeps back to back, each starting on the blocks the one before read last (in L2 "
               "while the rows in flight fit it)")
        if passes:  # none: the GEMMs made all there is
            steps.append(Step(f"each chunk: {', '.join(passes)}, in one kernel", (names.pair_passes,), why,
                              launch("pair_passes")))
    else:
        if first_pass:
            steps.append(Step(f"each chunk: {first_pass[0]}", (names.pair_stats,),
                              f"one pass over both logits ({what})", launch("pair_stats")))
        if jsd:
            steps.append(Step("each chunk: JSD's second pass (KL(P||M), KL(Q||M))", (names.mixture_sums,),
                              "log M needs both rows' lse first", launch("mixture_sums")))
    if not training:
        return tuple(steps)
    when = "in forward" if in_forward else "in backward"
    if not in_forward:
        steps.append(Step("backward: each chunk's teacher and student logits again", (gemm,),
                          "each row's upstream gradient arrives in backward; forward kept the rows' statistics"))
    if not (plan.fused_passes and in_forward):
        steps.append(Step(f"each chunk: {who} gradient over the logits{expectation} ({when})", (names.pair_grad,),
                          "written over the logits buffers", launch("pair_grad")))
    product_names = f"gradient products G_s @ W_s and G_s.T @ x_s{', G_t @ W_t and G_t.T @ x_t' if teacher else ''}"
    gemms = names.grad_gemms if chunks > 1 else names.grad_gemms[:1]
    steps.append(products(product_names, gemms) if products else
                 Step(product_names, gemms, "grad_weight accumulated chunk by chunk in the weight's dtype"))
    if desc.student_bias or (teacher and desc.teacher_bias):
        steps.append(Step("grad_bias: column sums of the gradient, if a bias requires grad", (names.bias_sums,),
                          "the backend's column sums"))
    if in_forward:
        steps.append(Step("backward: the gradients times grad_output", (names.scale,),
                          "in-forward gradients, scaled in place"))
    return tuple(steps)


def gradient_timing(desc: DistillDescription) -> str:
    """When a call's gradients are computed, and why (explain's ``gradients:`` line)."""
    if not desc.request.training:
        return "none (no gradient follows)"
    if desc.cfg.reduction == "none":
        return "in backward (reduction='none': each token's upstream gradient arrives in backward)"
    return "in forward (the scalar loss is the only output; backward scales them by grad_output)"
