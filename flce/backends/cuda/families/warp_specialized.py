"""Family ``warp_specialized``: the persistent warp-specialised Gluon GEMM for Hopper (ws_gemm_kernels.py: a TMA
producer warp, two wgmma consumer warpgroups, the epilogue overlapped with the next tile), whose row-statistics
epilogue (ws_stats_kernels.py) computes every statistic and option of the loss and can write a chunk's logits or
its kept exponentials instead; its plain form takes the gradient products."""

from __future__ import annotations

import logging
from functools import cache

from flce.backends.cuda.families.family import (
    CHUNK_LOGITS,
    EXPONENTIALS,
    PRODUCTS,
    STATISTICS,
    KernelFamily,
    exponentials_unfit,
    fused_statistics_unfit,
    fused_statistics_unpreferred,
    sixteen_bit,
    tuning_call,
)
from flce.backends.cuda.hardware import installed_triton, is_hopper, triton_too_old
from flce.engine.choice import DeviceDescription

WS_GEMM = "flce.backends.cuda.ws_gemm_kernels._ws_gemm_kernel"
MERGE_SPLITS = "flce.backends.cuda.gemm_kernels._merge_splits_kernel"
# Roles that write [rows, V] logits, or read them as a product's operand: TMA wants those rows 16-byte aligned.
_VOCAB_ROWS = frozenset({CHUNK_LOGITS, EXPONENTIALS, PRODUCTS})


def warp_specialized_available(device: DeviceDescription) -> tuple[bool, str]:
    """(available, why) for the warp-specialised Gluon kernels on this device."""
    if device.interpreter:
        return False, "the Triton interpreter runs no Gluon kernel"
    if not is_hopper(device):
        return False, f"{device.arch}: the kernels are written for sm_90 (Hopper)"
    problem = triton_too_old(device.triton)
    if problem:
        return False, problem
    if device.triton == installed_triton():
        # The Triton installed here: whether its Gluon module has what the kernels call (a broken install, or
        # triton-ascend under the same name, has the version but not the API), probed once per process.
        from flce.backends.cuda.gluon_compat import gluon_support

        builds, why = gluon_support()
        if not builds:
            _say_once(f"flce: the warp-specialised Gluon GEMM cannot be built here ({why}); the fused Triton GEMM "
                      "and cuBLAS take its place")
        return builds, why
    return True, f"triton {device.triton} has Gluon"


@cache
def _say_once(message: str) -> None:
    logging.getLogger("flce").warning(message)


class WarpSpecializedGemm(KernelFamily):
    name = "warp_specialized"
    title = "the warp-specialised GEMM (Gluon, sm_90a)"
    roles = frozenset({STATISTICS, CHUNK_LOGITS, EXPONENTIALS, PRODUCTS})
    fused = True
    fallback = "triton_tma"
    reads_other_logits = True

    def unfit(self, device, call, role):
        if role not in self.roles:
            return super().unfit(device, call, role)
        available, why = warp_specialized_available(device)
        if not available:
            return why
        if not sixteen_bit(call):
            return f"{str(call.dtype).removeprefix('torch.')}: the kernel takes bf16/fp16"
        if call.hidden % 8 or not call.rows_aligned:
            return f"H={call.hidden} or the operands' rows are not 16-byte aligned"
        if role in _VOCAB_ROWS and call.vocab % 8:
            return f"V={call.vocab} is not a multiple of 8: logits rows not 16-byte aligned"
        if role == PRODUCTS:
            return None
        return fused_statistics_unfit(call) or (exponentials_unfit(call) if role == EXPONENTIALS else None)

    def unpreferred(self, device, call, role):
        if role == STATISTICS:
            return fused_statistics_unpreferred(device, call)
        if role == PRODUCTS:
            # On the H100 the warp-specialised products made the default call slower (1.24-1.26x the floor against
            # 1.15-1.18x at 16384x2048x151936: its accumulating G.T @ x of one chunk 7% slower than cuBLAS's
            # addmm, and G @ W of a 1536-row chunk has 96 tiles for 132 SMs; docs/design-notes.md).
            return "measured slower than cuBLAS on the gradient products (flce-autotune times it: grad_gemm_kernel)"
        return None

    def available(self, gpu):
        if gpu is not None:
            return warp_specialized_available(gpu)
        from flce.backends.cuda.gluon_compat import gluon_support

        return False, f"{gluon_support()[1]}; runs on an sm_90 GPU only, and there is no GPU here"

    def kernels(self, role, settings, call):
        return (WS_GEMM,) if role == PRODUCTS else (WS_GEMM, MERGE_SPLITS)

    def launch_text(self, role, settings):
        config = "DEFAULT_CONFIG" if role == PRODUCTS else "ROW_STATS_CONFIG"
        return f"ws_gemm_ops.{config}, one program per SM"

    def compile_key(self, role, settings):
        # The statistics epilogue and the plain products compile as separate constexpr variants, so one can fail
        # where the other does not.
        return "products" if role == PRODUCTS else "statistics"

    def statistics(self, settings, hidden, weight, bias, target, cfg, vocab_offset, logits_out, against=None):
        # Hopper: plain 0.94-1.02x one cuBLAS GEMM against 1.01-1.07x for the Triton GEMM, RL 0.99-1.04x against
        # 1.03-1.10x, softcap + bias 1.07x against 1.11-1.21x on the H100 (docs/design-notes.md).
        from flce.backends.cuda.ws_gemm_ops import ws_partial_row_stats

        return ws_partial_row_stats(hidden, weight, target, vocab_offset, cfg, logits_out, bias, against=against)

    def exponentials(self, settings, hidden, weight, target, cfg, offsets, exp_out):
        from flce.backends.cuda.ws_gemm_ops import ws_partial_row_stats

        return ws_partial_row_stats(hidden, weight, target, 0, cfg, exp_out, exp_offset=offsets)

    def products(self, settings, a, b, out, accumulate):
        from flce.backends.cuda.ws_gemm_ops import ws_matmul

        ws_matmul(a, b, out, accumulate=accumulate)

    def tuning_candidates(self, device, shape, quick):
        """The warp-specialised statistics GEMM writing each chunk's logits and, for bf16, the kept exponentials
        (the exponentials need bf16's exponent range)."""
        call = tuning_call(shape)
        if self.unfit(device, call, CHUNK_LOGITS):
            return []
        forwards = [{"forward_logits": "fused", "logits_kernel": self.name, "chunk_grad": "logits"}]
        if not self.unfit(device, call, EXPONENTIALS):
            forwards.append({"forward_logits": "fused", "logits_kernel": self.name, "chunk_grad": "exponentials"})
        return forwards


FAMILY = WarpSpecializedGemm()
