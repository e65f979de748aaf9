"""The one place the CUDA backend decides what a call runs: (device, dtype, shape, options, autotune entry)
in, one record out. The record (flce.engine.choice.CallChoice) names the schedule, its sizes and memory,
and per step the kernel functions and why; :class:`~flce.backends.cuda.configs.KernelChoice` is what the
launchers are told. Both are pure functions of descriptions (no tensor, no driver): ``python -m flce
explain`` makes the same choice on a machine without the GPU.

Where each decision comes from, in order: the autotune cache's knob for the shape (``cache entry``), the
heuristics of cuda/plan.py (``heuristic``), what the device and the operands allow (``eligibility``), and
kernels that failed to compile earlier in this process (``fallback``, cuda/fallback.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.backends.cuda import plan as sizes
from flce.backends.cuda import steps
from flce.backends.cuda.configs import (
    CUBLAS,
    GRAD_PERSISTENT,
    GRAD_TILES,
    TRITON,
    TRITON_STATS_GEMM,
    WARP_SPECIALIZED,
    WS_GEMM,
    WS_PRODUCTS,
    WS_STATISTICS,
    GemmConfig,
    KernelChoice,
    LaunchParams,
    default_gemm_config,
)
from flce.backends.cuda.hardware import (
    has_16bit_tensor_cores,
    has_tma,
    is_hopper,
    warp_specialized_available,
)
from flce.config import LCEConfig
from flce.engine.call import gradient_timing
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription
from flce.engine.plans import PlanRequest
from flce.engine.rows import logits_dtype

# The gradient products' default: cuBLAS. On the H100 the warp-specialised products made the default call
# slower (1.24-1.26x the floor against 1.15-1.18x at 16384x2048x151936: its accumulating G.T @ x of one
# chunk 7% slower than cuBLAS's addmm, and G @ W of a 1536-row chunk has 96 tiles for 132 SMs;
# docs/design-notes.md). flce-autotune measures both on Hopper (knob grad_gemm_kernel).
DEFAULT_GRAD_GEMM_KERNEL = CUBLAS
_DEFAULTS = LCEConfig()


def choose(device: DeviceDescription, call: CallDescription, entry: TunedEntry,
           failed: Mapping[tuple[str, str], str] | None = None) -> tuple[CallChoice, KernelChoice]:
    """The record of what a call of this description runs on this device, and the launchers' instructions.
    ``failed``: (kernel, configuration) -> error of kernels that failed to compile here (cuda/fallback.py)."""
    failed = failed or {}
    tuned = sizes.tuned_knobs(entry)
    sixteen = call.dtype in (torch.bfloat16, torch.float16)
    ws_ok, ws_why = warp_specialized_available(device)
    operands = _ws_operand_problem(call, sixteen)
    gemm = _gemm_config(device, call, tuned)
    triton_failed = failed.get((TRITON_STATS_GEMM, gemm.text()))
    grad_failed = failed.get((GRAD_PERSISTENT if gemm.persistent else GRAD_TILES, gemm.text()))

    def ws_role(knob: str, asked: str | None, role: str, needs_vocab_rows: bool, other: str) -> tuple[str, str]:
        """(kernel, why) of a role the warp-specialised GEMM may take."""
        wanted = asked or (DEFAULT_GRAD_GEMM_KERNEL if role == WS_PRODUCTS else WARP_SPECIALIZED)
        source = f"cache entry: {knob}={asked}" if asked else f"heuristic: {knob} {wanted}"
        if wanted != WARP_SPECIALIZED:
            return other, source
        problem = None if ws_ok else ws_why
        problem = problem or operands.get("rows") or (operands.get("vocab") if needs_vocab_rows else None)
        if problem:
            return other, f"{source}; not eligible ({problem})"
        error = failed.get((WS_GEMM, role))
        if error:
            return other, f"{source}; fallback: it failed to compile here earlier ({error})"
        return WARP_SPECIALIZED, f"{source}; eligible ({ws_why})"

    stats_role, stats_why = ws_role("stats_kernel", tuned.stats_kernel, WS_STATISTICS, False, TRITON)
    logits_role, logits_why = ws_role("logits_kernel", tuned.logits_kernel, WS_STATISTICS, True, TRITON)
    products_role, products_why = ws_role("grad_gemm_kernel", tuned.grad_gemm_kernel, WS_PRODUCTS, True, CUBLAS)
    eligible = sizes.Eligible(
        fused_stats=not triton_failed or (stats_role == logits_role == WARP_SPECIALIZED),
        fused_grad=not grad_failed,
        ws_logits=logits_role == WARP_SPECIALIZED,
        fused_stats_default=(device.type == "cuda" and sixteen and call.n_rows >= sizes.FUSED_FORWARD_MIN_ROWS
                             and has_16bit_tensor_cores(device)),
        fused_grad_default=is_hopper(device) and sixteen and not operands,
    )
    plan, memory = sizes.schedule(device, call, tuned, eligible)
    kernels = KernelChoice(stats=stats_role, logits=logits_role, products=products_role,
                           launch=tuned.launch or LaunchParams(block_v=sizes.MAX_BLOCK_V), gemm=gemm,
                           fallback_scan_block=sizes.fallback_scan_block(call.n_rows, call.dtype.itemsize))
    why = _Reasons(call, tuned, eligible, stats_why, logits_why, products_why, triton_failed, grad_failed)
    record = CallChoice(backend="cuda", device=device.text(), inputs=call.text(), cache=tuned.source, plan=plan,
                        gradients=gradient_timing(call.cfg, call.request.training), memory=memory,
                        steps=tuple(steps.of_plan(device, call, plan, kernels, why)),
                        kernel_package="flce.backends.cuda")
    return record, kernels


def explain(device: DeviceDescription, call: CallDescription) -> CallChoice:
    """The record for a described call (``Backend.choose``): the autotune cache looked up by the device's
    name, no kernel failed."""
    return choose(device, call, entry_for(device, call))[0]


def entry_for(device: DeviceDescription, call: CallDescription) -> TunedEntry:
    return tuned_entry(device.name, "cuda", call.variant, call.dtype, call.hidden, call.vocab, call.n_rows)


def ws_takes_every_product(device: DeviceDescription, dtype: torch.dtype, hidden: int, vocab: int) -> bool:
    """Whether the warp-specialised GEMM can take every product of a call of this shape (aligned operands)."""
    return warp_specialized_available(device)[0] and not _ws_operand_problem(
        CallDescription(n_rows=0, hidden=hidden, vocab=vocab, dtype=dtype, bias=False, rows_aligned=True,
                        cfg=_DEFAULTS, variant="plain", request=PlanRequest(training=True)),
        dtype in (torch.bfloat16, torch.float16))


def _ws_operand_problem(call: CallDescription, sixteen: bool) -> dict[str, str]:
    """What in the operands keeps the warp-specialised GEMM out: "rows" (every use), "vocab" (where it
    writes [rows, V] logits or reads them as a product's operand: TMA needs 16-byte aligned rows)."""
    problems = {}
    if not sixteen:
        problems["rows"] = f"{str(call.dtype).removeprefix('torch.')}: the kernel takes bf16/fp16"
    elif call.hidden % 8 or not call.rows_aligned:
        problems["rows"] = f"H={call.hidden} or the operands' rows are not 16-byte aligned"
    if call.vocab % 8:
        problems["vocab"] = f"V={call.vocab} is not a multiple of 8: logits rows not 16-byte aligned"
    return problems


def _gemm_config(device: DeviceDescription, call: CallDescription, tuned: sizes.TunedKnobs) -> GemmConfig:
    """The Triton GEMMs' tiles (tuned, else the default), with TMA where the GPU and the operands allow it,
    and the gradient GEMM's persistent form where its TMA stores can write the gradient rows."""
    from dataclasses import replace

    base = tuned.gemm or default_gemm_config(device, call.dtype)
    tma = base.tma and has_tma(device) and call.rows_aligned
    return replace(base, tma=tma, persistent=base.persistent and tma and (call.vocab * call.dtype.itemsize) % 16 == 0)


class _Reasons:
    """Why each path of the plan was taken, in the words the record prints."""

    def __init__(self, call: CallDescription, tuned: sizes.TunedKnobs, eligible: sizes.Eligible, stats: str,
                 logits: str, products: str, triton_failed: str | None, grad_failed: str | None) -> None:
        self.stats_kernel, self.logits_kernel, self.products = stats, logits, products
        cfg = call.cfg
        forced = None
        if cfg.return_logit_stats:
            forced = "return_logit_stats: the fused GEMMs keep no row min or sum of z"
        elif logits_dtype(call.dtype, cfg) != call.dtype:
            forced = 'precision="accurate": fp32 logits come from cuBLAS'
        elif triton_failed:
            forced = f"fallback: the Triton statistics GEMM failed to compile here earlier ({triton_failed})"
        self.forward_stats = self._path("forward_stats", tuned.forward_stats, forced,
                                        "16-bit tensor cores and at least "
                                        f"{sizes.FUSED_FORWARD_MIN_ROWS} tokens" if eligible.fused_stats_default
                                        else "fp32, the interpreter, a pre-sm_80 GPU or fewer than "
                                        f"{sizes.FUSED_FORWARD_MIN_ROWS} tokens: cuBLAS")
        self.forward_logits = self._path("forward_logits", tuned.forward_logits, forced,
                                         "the warp-specialised GEMM writes them" if eligible.ws_logits
                                         else f"no warp-specialised GEMM here ({logits}): cuBLAS")
        grad_forced = ('precision="accurate": fp32 logits come from cuBLAS' if logits_dtype(call.dtype, cfg) !=
                       call.dtype else f"fallback: the fused gradient GEMM failed to compile here earlier "
                       f"({grad_failed})" if grad_failed else None)
        self.backward_grad = self._path("backward_grad", tuned.backward_grad, grad_forced,
                                        "the persistent Hopper kernel with TMA stores" if eligible.fused_grad_default
                                        else "not Hopper with aligned 16-bit rows: cuBLAS")
        self.schedule = (f"cache entry: grad_schedule={tuned.grad_schedule}" if tuned.grad_schedule
                         else "heuristic: the budget's chunk size (cuda/plan.py)")
        if tuned.tokens_per_chunk is not None:
            self.schedule += f"; tokens_per_chunk={tuned.tokens_per_chunk} from the cache entry"
        self.chunk_grad = (f"cache entry: chunk_grad={tuned.chunk_grad}" if tuned.chunk_grad else
                           "heuristic: kept exponentials beside the warp-specialised statistics GEMM where the "
                           "call allows them (bf16, no bias, a scalar loss whose gradient is a row multiple of "
                           "softmax - onehot: no option but a temperature from 0.5, token weights, detached "
                           "log-probs)")
        self.launch = ("cache entry: block_v, num_warps" if tuned.launch else
                       f"heuristic: up to {sizes.MAX_BLOCK_V} columns a block, 8 warps from 2048 columns")
        self.gemm = "cache entry: gemm_*" if tuned.gemm else "heuristic: default_gemm_config"

    @staticmethod
    def _path(knob: str, tuned: str | None, forced: str | None, heuristic: str) -> str:
        if forced:
            return forced
        return f"cache entry: {knob}={tuned}" if tuned else f"heuristic: {heuristic}"

