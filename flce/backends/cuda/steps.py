"""The steps of a CUDA call's record: for the plan and the kernel choice, which functions each step launches
(their dotted paths: the Triton and Gluon kernels of this package, cuBLAS as the torch function that calls it),
following exactly what the schedules (flce/engine) run. A role's kernels, launch and fallback are its family's
(cuda/families); this module only orders them as the schedules do.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flce.backends.cuda.families import KernelChoice
from flce.backends.cuda.families import family as role
from flce.backends.cuda.families.cublas import FULL_GRAD, ROW_STATS, cublas_logits_function
from flce.backends.cuda.families.family import KernelFamily
from flce.backends.cuda.row_ops import GRAD_BLOCKS_PER_PROGRAM, PLAIN_FORWARD, PLAIN_GRAD, SCALE
from flce.distillation.semantics import student_reads_teacher
from flce.engine.call import grads_in_forward_allowed, logits_kept_for_gradients
from flce.engine.choice import CallDescription, DeviceDescription, Step
from flce.engine.distillation.call import DistillChunks, DistillDescription
from flce.engine.distillation.steps import PairKernelNames, distillation_steps
from flce.engine.plans import EXPONENTIALS, FUSED, AllRows, Plan, TokenChunks, VocabBlocks, kept_rows
from flce.engine.rows import logits_dtype

_K = "flce.backends.cuda."
EXP_OFFSETS = _K + "exp_grad_kernels._exp_offsets_kernel"
EXP_FINISH = _K + "exp_grad_kernels._exp_rows_finish_kernel"
EXP_REDO = _K + "exp_grad_kernels._exp_rows_redo_kernel"
SCALE_ROWS = _K + "exp_grad_kernels._scale_rows_kernel"
COUNT_TOKENS = _K + "target_kernels._count_tokens_kernel"
PAIR_STATS = _K + "distill_kernels._pair_stats_kernel"
MIXTURE_SUMS = _K + "distill_kernels._mixture_sums_kernel"
PAIR_GRAD = _K + "distill_kernels._pair_grad_kernel"
PAIR_PASSES = _K + "distill_kernels._pair_passes_kernel"


def of_distillation(device: DeviceDescription, desc: DistillDescription, plan: DistillChunks, kernels: KernelChoice,
                    products_call: CallDescription, products_reason: str, logits_call: CallDescription,
                    logits_reason: str) -> tuple[Step, ...]:
    """The steps of a linear distillation plan (flce.engine.distillation.steps orders them), its row kernels
    distill_ops.py's and its gradient products (``products_call``: the student head's, as the families read a
    call) those of the family the choice gave the role; with stats_in_gemm the chunk logits' too
    (``logits_call``)."""
    settings = kernels.settings
    row = settings.launch
    blocks = f"BLOCK_V up to {row.block_v}, {row.num_warps or '4 or 8'} warps ({settings.launch_source})"
    in_flight = (f"{settings.rows_in_flight} programs walking the rows (cache entry: rows_in_flight)"
                 if settings.rows_in_flight else "one program a row (heuristic)")
    registers = (f"; at most {settings.pair_registers} registers a thread on an NVIDIA GPU"
                 if settings.pair_registers else "")
    launches = {"pair_passes": f"{blocks}; {in_flight}{registers}",
                "pair_grad": f"{blocks}; {GRAD_BLOCKS_PER_PROGRAM} blocks of a row a program"}
    sums = "torch.addmm" if device.type == "cuda" and desc.dtype != torch.float32 else "torch.Tensor.sum"
    family, fallbacks = kernels.family(role.PRODUCTS), kernels.fallbacks(role.PRODUCTS)

    def gemms(of: KernelFamily, chunks: int) -> tuple[str, ...]:
        # the weight gradient: written by the first chunk's product, added into by the others'
        accumulate = of.accumulate_kernels if chunks > 1 else ()
        return tuple(dict.fromkeys(of.kernels(role.PRODUCTS, settings, products_call) + accumulate))

    def products(name: str, engine_gemms: tuple[str, ...]) -> Step:
        chunks = -(-desc.n_rows // plan.tokens_per_chunk) if desc.n_rows else 0
        return Step(name, gemms(family, chunks), products_reason, family.launch_text(role.PRODUCTS, settings),
                    gemms(fallbacks[0], chunks) if fallbacks else ())

    logits = None
    if plan.stats_in_gemm:
        chunks = -(-desc.n_rows // plan.tokens_per_chunk) if desc.n_rows else 0
        first, after = kernels.family(role.CHUNK_LOGITS), kernels.fallbacks(role.CHUNK_LOGITS)
        entropy = (" (the student's with its entropy sum)" if desc.cfg.return_entropy else
                   " (the student's with E_q[s - t], its epilogue reading the teacher's logits)"
                   if student_reads_teacher(desc.cfg) else "")
        logits = Step(f"each of {chunks} chunks: teacher and student logits, each head's softmax statistics{entropy} "
                      "in its GEMM's epilogue", first.kernels(role.CHUNK_LOGITS, settings, logits_call), logits_reason,
                      first.launch_text(role.CHUNK_LOGITS, settings),
                      after[0].kernels(role.CHUNK_LOGITS, settings, logits_call) if after else ())
    names = PairKernelNames(pair_stats=PAIR_STATS, mixture_sums=MIXTURE_SUMS, pair_grad=PAIR_GRAD, scale=SCALE,
                            bias_sums=sums, pair_passes=PAIR_PASSES, count_tokens=COUNT_TOKENS)
    return distillation_steps(desc, plan, names, lambda kernel: launches.get(kernel, blocks), products, logits,
                              logits_reason)


def of_plan(device: DeviceDescription, call: CallDescription, plan: Plan, kernels: KernelChoice,
            reasons: Mapping[str, str]) -> list[Step]:
    """The steps of ``plan`` in the order they run (``reasons``: why each role's family was taken), after the pass
    over the targets."""
    targets = Step("the targets: the non-ignored count the means divide by, and the range check", (COUNT_TOKENS,),
                   "one kernel and a device-side assertion before the first GEMM (target_ops.py)")
    return [targets, *_plan_steps(device, call, plan, kernels, reasons)]


def _plan_steps(device: DeviceDescription, call: CallDescription, plan: Plan, kernels: KernelChoice,
                reasons: Mapping[str, str]) -> list[Step]:
    cfg, settings = call.cfg, kernels.settings
    in_forward = call.request.training and grads_in_forward_allowed(cfg)
    accurate = logits_dtype(call.dtype, cfg) != call.dtype
    cublas_logits = cublas_logits_function(call)
    row = settings.launch
    row_launch = f"BLOCK_V up to {row.block_v}, {row.num_warps or '4 or 8'} warps ({settings.launch_source})"
    full_or_plain_grad = PLAIN_GRAD if call.plain else FULL_GRAD

    def family_step(name: str, of_role: str) -> Step:
        """A step its role's family runs, and what takes its place should it fail to compile."""
        family, fallbacks = kernels.family(of_role), kernels.fallbacks(of_role)
        return Step(name, family.kernels(of_role, settings, call), reasons[of_role],
                    family.launch_text(of_role, settings),
                    fallbacks[0].kernels(of_role, settings, call) if fallbacks else ())

    def all_rows(stats: AllRows, when: str) -> Step:
        name = f"statistics of all rows{when}"
        if stats.forward_stats == FUSED:
            return family_step(name, role.STATISTICS)
        return Step(name, (cublas_logits, ROW_STATS), reasons[role.STATISTICS],
                    f"vocabulary blocks of {stats.scan_block} columns; {row_launch}")

    def recomputed_gradient(name: str, backward_grad: str | None, grad_kernel: str) -> Step:
        if backward_grad == FUSED:
            return family_step(name, role.GRADIENT)
        return Step(name, (cublas_logits, grad_kernel), reasons[role.GRADIENT], row_launch)

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
        products = (fp32_product,) if fp32_weight else ("torch.Tensor.addmm_", "torch.mm")
        return [all_rows(plan.stats, " (in forward)"),
                recomputed_gradient(f"block gradient{when}", plan.backward_grad, FULL_GRAD),
                Step(f"gradient products of each block{when}", products,
                     "cuBLAS: each block's rows of grad_weight are written once, grad_hidden accumulates "
                     "(the warp-specialised GEMM measured 0-23% slower on these products: docs/design-notes.md)"),
                *bias_sums(when), *(scaled_in_backward() if in_forward else [])]

    assert isinstance(plan, TokenChunks)
    n_rows = call.n_rows
    # A statistics-first objective (a sequence-level policy loss): a deferred plan's forward and backward, both
    # in forward (flce.engine.schedule).
    two_pass = in_forward and call.request.statistics_first
    deferred = logits_kept_for_gradients(cfg, call.request)
    keep = kept_rows(plan, n_rows) if deferred else 0
    later = "after every row's statistics" if two_pass else "backward"
    kept_exponentials = two_pass and plan.chunk_grad == EXPONENTIALS and keep > 0

    def exponentials_step(name: str) -> Step:
        making = family_step(name, role.EXPONENTIALS)
        return Step(making.name, (EXP_OFFSETS, *making.kernels, EXP_FINISH, EXP_REDO), making.reason,
                    making.launch, making.fallback)

    def chunk_logits_step(name: str) -> Step:
        if plan.forward_logits == FUSED:
            return family_step(name, role.CHUNK_LOGITS)
        return Step(name, (cublas_logits, ROW_STATS), reasons[role.CHUNK_LOGITS], row_launch)

    out: list[Step] = []
    if kept_exponentials:
        out.append(exponentials_step(f"each of the first {keep} rows' chunks: exponentials and statistics (the "
                                     "gradient up to a row scale)"))
        if keep < n_rows:
            out.append(chunk_logits_step("each other chunk: logits and statistics"))
    elif deferred and keep == 0 and plan.stats_first is not None:
        out.append(all_rows(plan.stats_first, " (in forward)"))
    elif in_forward and not two_pass and plan.chunk_grad == EXPONENTIALS:
        out.append(exponentials_step("each chunk: exponentials and statistics (the gradient up to a row scale)"))
    elif plan.forward_logits == FUSED:
        out.append(chunk_logits_step("each chunk: logits and statistics"))
        if in_forward and not two_pass:
            out.append(Step("each chunk: gradient over its logits", (full_or_plain_grad,),
                            "the row kernel over the logits the statistics GEMM wrote", row_launch))
    elif call.plain:
        out.append(Step("each chunk: logits, loss" + (" and gradient" if in_forward else ""),
                        (cublas_logits, PLAIN_FORWARD), reasons[role.CHUNK_LOGITS], row_launch))
    else:
        out.append(chunk_logits_step("each chunk: logits and statistics"))
        if in_forward and not two_pass:
            out.append(Step("each chunk: gradient over its logits", (FULL_GRAD,), "the full variant's row kernel",
                            row_launch))
    if not call.request.training:
        return out
    when = " (in forward)" if in_forward else " (in backward)"
    if deferred:
        if keep and not kept_exponentials:
            out.append(Step(f"{later}: gradient of the {keep} kept rows' logits", (full_or_plain_grad,),
                            "logits kept from forward (the memory plan's save limit)", row_launch))
        if keep < n_rows:
            out.append(recomputed_gradient(f"{later}: each recomputed chunk's gradient", plan.backward_grad,
                                           full_or_plain_grad))
    chunks = -(-n_rows // max(1, plan.tokens_per_chunk))
    updates = (keep > 0) + -(-(n_rows - keep) // max(1, plan.tokens_per_chunk)) if deferred else chunks
    products = kernels.family(role.PRODUCTS)
    product_kernels = products.kernels(role.PRODUCTS, settings, call)
    # The weight gradient: written by the first chunk's product, added into by the others (fp32 accumulators: cuBLAS
    # adds every chunk's product into them).
    if fp32_weight:
        weight_product = (fp32_product,)
    else:
        weight_product = product_kernels + (products.accumulate_kernels if updates > 1 else ())
    exponentials = in_forward and plan.chunk_grad == EXPONENTIALS and (kept_exponentials or not two_pass)
    names = tuple(dict.fromkeys(((SCALE_ROWS,) if exponentials else ()) + product_kernels + weight_product))
    step = family_step(f"gradient products G @ W and G.T @ x{when}", role.PRODUCTS)
    reason = step.reason + ("; grad_weight accumulated in fp32 by cuBLAS (accum_dtype)" if fp32_weight else "")
    fallback = step.fallback + (kernels.fallbacks(role.PRODUCTS)[0].accumulate_kernels if step.fallback else ())
    out.append(Step(step.name, names, reason, step.launch, fallback))
    out += bias_sums(when)
    if in_forward:
        out += scaled_in_backward()
    return out
