"""The warp-specialised Gluon GEMM's standalone entry points for the benchmarks and the tests (not the
library's: flce's calls go through the kernel choice and ops.py):

* :func:`ws_row_stats`: the plain loss's row statistics of x @ w.T from the statistics epilogue, as
  three tensors;
* :func:`compile_for_hopper`: the kernel compiled for sm_90a without a GPU, for the CPU tests (its PTX,
  registers and shared memory) and the resource report.

Import it as ``ws_kernels`` with tools/benchmarks on ``sys.path`` (the scripts there have it; the tests
insert it).
"""

from __future__ import annotations

import torch
import triton

from flce.backends.cuda.ws_gemm_ops import DEFAULT_CONFIG, ROW_STATS_CONFIG, WsGemmConfig, ws_partial_row_stats
from flce.config import LCEConfig


def ws_row_stats(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, config: WsGemmConfig = ROW_STATS_CONFIG,
                 logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain loss's row statistics of the logits z = x @ w.T (each rounded to x's dtype):
    (row_max, sum_exp, target_z), [N] fp32 each, as semantics.PartialRowStats's fields (sum_exp =
    sum exp(z - row_max); target_z = 0 where target is outside [0, V)). The logits are written into
    ``logits_out`` ([N, V], x's dtype, 16-byte aligned rows) when given, and nowhere otherwise."""
    stats = ws_partial_row_stats(x, w, target, 0, LCEConfig(), logits_out, config=config)
    return stats.row_max, stats.sum_exp, stats.target_z


def compile_for_hopper(a_mmajor: bool, b_kmajor: bool, config: WsGemmConfig | None = None,
                       dtype: str = "bfloat16", row_stats: bool = False, store_tile: bool = False,
                       accumulate: bool = False, sum_exp_dz: bool = False, argmax: bool = False,
                       sum_z: bool = False, softcap: bool = False, class_weight: bool = False,
                       bias: bool = False, store_exp: bool = False, against: bool = False) -> object:
    """Compile the kernel for sm_90a without a GPU (triton.compile on a Gluon source), for the CPU
    tests and the resource report; returns Triton's CompiledKernel (``.asm["ptx"]``, ``.metadata``)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from flce.backends.cuda.ws_gemm_kernels import _ws_gemm_kernel

    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]

    def descriptor(block: list[int]) -> str:
        layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, dtype))
        return f"tensordesc<{short}[{block[0]},{block[1]}],{layout!r}>"

    cfg = config or (ROW_STATS_CONFIG if row_stats else DEFAULT_CONFIG)
    types = {"a_desc": descriptor([cfg.block_k, cfg.block_m] if a_mmajor else [cfg.block_m, cfg.block_k]),
             "b_desc": descriptor([cfg.block_n, cfg.block_k] if b_kmajor else [cfg.block_k, cfg.block_n]),
             "c_desc": descriptor([cfg.block_m // 2, cfg.block_n]), "M": "i32", "N": "i32", "K": "i32",
             "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_sum_dz_ptr": "*fp32",
             "part_argmax_ptr": "*i64", "part_sum_y_ptr": "*fp32", "target_ptr": "*i64",
             "target_z_ptr": "*fp32", "class_weight_ptr": "*fp32", "bias_ptr": f"*{short}",
             "exp_offset_ptr": "*fp32", "against_ptr": f"*{short}", "stride_against": "i32", "y_scale": "fp32",
             "z_scale": "fp32", "softcap": "fp32"}
    constants = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "A_MMAJOR": a_mmajor, "B_KMAJOR": b_kmajor,
                 "GROUP_M": cfg.group_m, "NUM_STAGES": cfg.stages, "ROW_STATS": row_stats,
                 "INTERLEAVE": row_stats, "STORE_TILE": store_tile, "ACCUMULATE": accumulate,
                 "SUM_EXP_DZ": sum_exp_dz, "ARGMAX": argmax, "SUM_Z": sum_z, "SOFTCAP": softcap,
                 "CLASS_WEIGHT": class_weight, "HAS_BIAS": bias, "STORE_EXP": store_exp, "AGAINST": against,
                 "CONSUMER_REGS": cfg.consumer_regs, "LOAD_REGS": cfg.load_regs}
    names = list(inspect.signature(_ws_gemm_kernel.fn).parameters)
    signature = {name: "constexpr" if name in constants else types[name] for name in names}
    # What the JIT infers at a launch on 16-byte aligned tensors and a vocabulary that is a multiple of 16
    # (N, and the other head's row stride): divisible by 16, which lets masked loads along the columns be vectorised.
    divisible = [name for name, kind in types.items() if kind.startswith("*")] + ["N", "stride_against"]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = GluonASTSource(_ws_gemm_kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.max_regs})
