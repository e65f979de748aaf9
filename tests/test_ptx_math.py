"""flce/backends/cuda/ptx_math.py: which tensors take the one-instruction log2, and that a distillation pair kernel
compiled for a GPU (without one: Triton compiles for a named target) carries it in its PTX. Their numbers
are checked on the GPU by tests/test_distillation_gpu.py and tests/test_distillation_precision.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from flce.backends.cuda.ptx_math import compiles_to_ptx


def test_interpreter_tensors_keep_tritons_forms() -> None:
    """The interpreter runs kernels on CPU tensors and cannot run PTX; a meta tensor is what
    tools/compat/compile_for_gpus.py compiles a GPU's kernels for, so it takes the GPU's forms."""
    assert not compiles_to_ptx(torch.empty(2))
    assert compiles_to_ptx(torch.empty(2, device="meta")) == (torch.version.hip is None)


_COMPILE_MIXTURE_SUMS = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flce.backends.cuda.distill_kernels import _mixture_sums_kernel

signature = {"teacher_ptr": "*bf16", "stride_teacher": "i32", "student_ptr": "*bf16", "stride_student": "i32",
             **{name: "*fp32" for name in ("teacher_max_ptr", "teacher_log_sum_ptr", "student_max_ptr",
                                           "student_log_sum_ptr", "teacher_kl_ptr", "student_kl_ptr")},
             "V": "i32", "inv_temperature": "fp32", "beta": "fp32", "PTX": "constexpr", "BLOCK_V": "constexpr"}
source = ASTSource(_mixture_sums_kernel, signature, {(13,): True, (14,): 4096})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
sys.stdout.write(compiled.asm["ptx"])
"""


def _mixture_sums_ptx() -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_MIXTURE_SUMS], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_pair_kernel_compiles_the_one_instruction_log2() -> None:
    """JSD's mixture sweep forms p and q (two exp2, which Triton makes one MUFU instruction each) and log2 m a
    column: compiled for sm_90 with PTX, the logarithm is lg2.approx.ftz.f32 too, not libdevice's log2f."""
    ptx = _mixture_sums_ptx()
    assert ".target sm_90" in ptx
    assert ptx.count("ex2.approx.ftz.f32") >= 2 and ptx.count("lg2.approx.ftz.f32") >= 1, ptx[-2000:]
    assert "__nv_log2f" not in ptx
