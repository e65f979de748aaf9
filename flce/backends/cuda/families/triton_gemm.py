"""Families ``triton_tma`` and ``triton``: the fused Triton GEMMs of gemm_kernels.py, whose epilogue turns each
logits tile into row statistics (the statistics GEMM, which may also write the tile) or into the gradient tile
(the gradient GEMM). ``triton_tma`` loads its operands by tensor descriptors (TMA, sm_90 and later; its gradient
GEMM persistent with TMA stores), ``triton`` by pointers: the generic path of any GPU with 16-bit tensor cores,
and what the Triton interpreter runs. The autotune knobs call both ``triton`` (the first that fits), and
gemm_tma=false asks for the one without TMA."""

from __future__ import annotations

from dataclasses import replace

from flce.backends.cuda.configs import GemmConfig, LaunchSettings, default_gemm_config
from flce.backends.cuda.families.family import (
    CHUNK_LOGITS,
    EXPONENTIALS,
    GRADIENT,
    STATISTICS,
    KernelFamily,
    exponentials_unfit,
    fused_statistics_unfit,
    fused_statistics_unpreferred,
    sixteen_bit,
)
from flce.backends.cuda.hardware import has_tma, is_hopper
from flce.engine.rows import logits_dtype

_K = "flce.backends.cuda."
STATS_GEMM = _K + "gemm_kernels._gemm_row_stats_kernel"
STATS_KERNELS = (STATS_GEMM, _K + "gemm_kernels._target_logit_kernel", _K + "gemm_kernels._merge_splits_kernel")
GRAD_PERSISTENT = _K + "gemm_kernels._gemm_grad_persistent_kernel"
GRAD_TILES = _K + "gemm_kernels._gemm_grad_kernel"
class TritonGemm(KernelFamily):
    roles = frozenset({STATISTICS, CHUNK_LOGITS, EXPONENTIALS, GRADIENT})
    fused = True
    uses_gemm_tiles = True
    reads_other_logits = True

    def __init__(self, tma: bool) -> None:
        self.tma = tma
        self.name = "triton_tma" if tma else "triton"
        self.title = ("the fused Triton GEMMs with TMA (sm_90 and later)" if tma else
                      "the fused Triton GEMMs, pointer loads")
        self.fallback = "triton" if tma else "cublas"

    def unfit(self, device, call, role):
        if role not in self.roles:
            return super().unfit(device, call, role)
        if self.tma and (device.interpreter or not has_tma(device)):
            return ("the interpreter has no TMA" if device.interpreter
                    else f"{device.arch}: no TMA (sm_90 and later)")
        if self.tma and not call.rows_aligned:
            return "the operands' rows are not 16-byte aligned for TMA"
        if role == GRADIENT:
            if logits_dtype(call.dtype, call.cfg) != call.dtype:
                return 'precision="accurate": fp32 logits come from cuBLAS'
            return None
        return fused_statistics_unfit(call) or (exponentials_unfit(call) if role == EXPONENTIALS else None)

    def unpreferred(self, device, call, role):
        if role == STATISTICS:
            return fused_statistics_unpreferred(device, call)
        if role == GRADIENT:
            if self.tma and is_hopper(device) and sixteen_bit(call) and call.hidden % 8 == 0 and call.vocab % 8 == 0:
                return None
            return "the heuristic takes the fused gradient GEMM as the persistent Hopper kernel only (16-bit, aligned)"
        # A chunk's logits: the fused Triton GEMM measured slower there than cuBLAS and the row kernel (an RL
        # objective at 16384x4096x151936 on the H100: 1.112x against 1.089x the floor; docs/benchmarks.md).
        return "measured slower than cuBLAS and the row kernel for a chunk's logits (flce-autotune times it)"

    def available(self, gpu):
        if self.tma and (gpu is None or not has_tma(gpu)):
            return False, "TMA: an sm_90 or later GPU" + ("" if gpu is None else f", {gpu.name} is {gpu.arch}")
        return True, "Triton"

    def config(self, settings: LaunchSettings) -> GemmConfig:
        """The tiles as this family launches them: TMA loads (and the persistent gradient GEMM) or pointer loads."""
        return replace(settings.gemm, tma=self.tma, persistent=self.tma and settings.gemm.persistent)

    def kernels(self, role, settings, call):
        if role == GRADIENT:
            return (GRAD_PERSISTENT if self.config(settings).persistent else GRAD_TILES,)
        return STATS_KERNELS

    def launch_text(self, role, settings):
        return f"{self.config(settings).text()} ({settings.gemm_source})"

    def compile_key(self, role, settings):
        return f"{self.kernels(role, settings, None)[0]} {self.config(settings).text()}"

    def statistics(self, settings, hidden, weight, bias, target, cfg, vocab_offset, logits_out, against=None):
        from flce.backends.cuda.gemm_ops import gemm_row_stats

        return gemm_row_stats(hidden, weight, bias, target, cfg, vocab_offset, self.config(settings), logits_out,
                              against=against)

    def exponentials(self, settings, hidden, weight, target, cfg, offsets, exp_out):
        from flce.backends.cuda.gemm_ops import gemm_row_stats

        # The statistics GEMM's epilogue writes the exponentials: no pass over the logits.
        return gemm_row_stats(hidden, weight, None, target, cfg, 0, self.config(settings), exp_out, exp_offset=offsets)

    def gradient(self, settings, hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs):
        from flce.backends.cuda.gemm_ops import gemm_grad

        return gemm_grad(hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs, self.config(settings))

    def tuning_candidates(self, device, shape, quick):
        """The fused Triton GEMM writing each chunk's logits, per tile configuration (the knob value "triton"
        names both families: the one without TMA lists them once)."""
        if self.tma:
            return []
        tiles = [default_gemm_config(device, shape.dtype)]
        if not quick:
            tiles += [GemmConfig(128, 256, 64, 16, 8, 3), GemmConfig(128, 256, 64, 8, 8, 4)]
        return [{"forward_logits": "fused", "logits_kernel": "triton", **t.as_params()} for t in tiles]


TMA_FAMILY = TritonGemm(tma=True)
FAMILY = TritonGemm(tma=False)
