"""Family ``cublas``: cuBLAS GEMMs (torch.mm) and the Triton row kernels over their logits. It takes every role,
fits every call and cannot fail to compile (its row kernels are the backend's own): the last family of every
fallback chain, and the generic path of a GPU that no fused family fits."""

from __future__ import annotations

from flce.backends.cuda.families.family import (
    EXPONENTIALS,
    GRADIENT,
    PRODUCTS,
    ROLES,
    KernelFamily,
    exponentials_unfit,
)
from flce.engine.choice import CallDescription
from flce.engine.rows import logits_dtype

_K = "flce.backends.cuda."
ROW_STATS = _K + "kernels._row_stats_kernel"
FULL_GRAD = _K + "kernels._full_grad_kernel"
EXP_LOGITS = _K + "exp_grad_kernels._exp_logits_kernel"


def cublas_logits_function(call: CallDescription) -> str:
    """The torch function that has cuBLAS write a block of logits: addmm where the bias is added in the GEMM (not
    under precision="accurate", whose fp32 logits get it added after: engine/rows.py gemm_logits)."""
    return "torch.addmm" if call.bias and logits_dtype(call.dtype, call.cfg) == call.dtype else "torch.mm"


class CublasRows(KernelFamily):
    name = "cublas"
    title = "cuBLAS GEMMs and the Triton row kernels"
    roles = frozenset(ROLES)
    fused = False
    fallback = None
    accumulate_kernels = ("torch.Tensor.addmm_",)

    def available(self, gpu):
        return True, "cuBLAS through torch, and the row kernels"

    def unfit(self, device, call, role):
        return exponentials_unfit(call) if role == EXPONENTIALS else None

    def unpreferred(self, device, call, role):
        if role == EXPONENTIALS:
            return "exponentials pay only where the statistics GEMM writes them: cuBLAS logits keep their pass"
        return None

    def kernels(self, role, settings, call):
        """Where a fused family's kernel failed to compile, its role falls to these (the plans' "cublas" paths
        the engine runs itself: engine/all_rows.py, token_chunks.py)."""
        logits = cublas_logits_function(call)
        if role == PRODUCTS:
            return ("torch.mm",)
        if role == GRADIENT:
            return (logits, FULL_GRAD)
        if role == EXPONENTIALS:
            return ("torch.mm", ROW_STATS, EXP_LOGITS)
        return (logits, ROW_STATS)

    def launch_text(self, role, settings):
        if role in (PRODUCTS, GRADIENT):
            return ""
        return (f"BLOCK_V up to {settings.launch.block_v}, {settings.launch.num_warps or '4 or 8'} warps "
                f"({settings.launch_source})")

    def statistics(self, settings, hidden, weight, bias, target, cfg, vocab_offset, logits_out, against=None):
        from flce.backends.cuda.row_ops import cublas_row_stats

        if against is not None:  # the choice gives a call that reads a second head only to reads_other_logits
            raise ValueError("cuBLAS and the row kernel read one head's logits: no statistics against another's")

        return cublas_row_stats(hidden, weight, bias, target, cfg, vocab_offset, logits_out, settings.launch,
                                settings.fallback_scan_block)

    def exponentials(self, settings, hidden, weight, target, cfg, offsets, exp_out):
        from flce.backends.cuda.exp_grad_ops import exponentials_from_logits_

        partial = self.statistics(settings, hidden, weight, None, target, cfg, 0, exp_out)
        exponentials_from_logits_(exp_out, offsets, cfg.temperature)
        return partial

    def products(self, settings, a, b, out, accumulate):
        from flce.engine.rows import torch_matmul_

        torch_matmul_(a, b, out, accumulate)

    def gradient(self, settings, hidden, weight, bias, target, cfg, vocab_offset, lse, coeffs):
        from flce.backends.cuda.row_ops import cublas_logits, full_grad_

        logits = cublas_logits(hidden, weight, bias, hidden.new_empty(hidden.shape[0], weight.shape[0]))
        return full_grad_(logits, target, cfg, vocab_offset, lse, coeffs, settings.launch)

    def tuning_candidates(self, device, shape, quick):
        launches = [(4096, 8)] if quick else [(4096, 8), (4096, 16), (2048, 8)]
        return [{"forward_logits": "cublas", "block_v": block_v, "num_warps": warps} for block_v, warps in launches]


FAMILY = CublasRows()
