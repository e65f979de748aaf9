"""The engine's first pass over a call's targets (RowKernels.count_tokens): the non-ignored tokens every mean
divides by, and the range check of the targets on an accelerator.

The CUDA backend's kernel (cuda/target_kernels.py) runs under the Triton interpreter on CPU tensors where there is no
GPU, on the GPU where there is one; both against PyTorch's form (semantics.count_tokens)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from flce.engine.rows import torch_count_tokens
from flce.semantics import count_tokens as torch_counts

pytest.importorskip("triton")


def _targets(n: int, vocab: int, ignore_index: int, generator: torch.Generator, device: torch.device,
             ignored_share: float) -> torch.Tensor:
    target = torch.randint(0, vocab, (n,), generator=generator)
    target[torch.rand(n, generator=generator) < ignored_share] = ignore_index
    return target.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "ignored_share"), [(0, 0.0), (1, 0.0), (7, 1.0), (300, 0.3), (9000, 0.1)])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_kernel_counts_as_pytorch(n, ignored_share, ignore_index, dtype, generator, device) -> None:
    """Count, divisor, zero and counted equal PyTorch's exactly: no tokens, every token ignored, a block's
    worth and several (9000 rows span three of the kernel's 4096-row blocks), ignore_index inside the vocabulary
    too; and the range check passes on valid targets."""
    from flce.backends.cuda.target_ops import count_tokens

    if device.type not in ("cpu", "cuda"):
        pytest.skip("the CUDA backend's kernel: GPU or Triton interpreter")
    target = _targets(n, 50, ignore_index, generator, device, ignored_share)
    got = count_tokens(target, ignore_index, dtype, vocab=50)
    want = torch_counts(target, ignore_index, dtype)
    for name in ("count", "counted", "divisor", "zero"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape == () and a.dtype == b.dtype, name
        assert a.item() == b.item(), f"{name}: {a.item()} against PyTorch's {b.item()}"
    assert got.count.item() == int((target != ignore_index).sum())


def test_kernel_reads_strided_targets(generator, device) -> None:
    """Every other element of a target buffer (a strided view, as a sliced batch gives): the kernel counts and
    checks those elements only; the ones between are out of range and ignored by it."""
    from flce.backends.cuda.target_ops import count_tokens

    if device.type not in ("cpu", "cuda"):
        pytest.skip("the CUDA backend's kernel: GPU or Triton interpreter")
    buffer = _targets(2 * 5000, 50, -100, generator, device, 0.3)
    buffer[1::2] = 999
    target = buffer[::2]
    got = count_tokens(target, -100, torch.float32, vocab=50)
    assert got.count.item() == int((target != -100).sum()) and bool(got.counted)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: the GPU's assertion ends the process")
@pytest.mark.parametrize("bad", [-1, 50, 10**12])
def test_kernel_asserts_out_of_range_targets(bad, generator) -> None:
    """A target below 0 or at/after V (ignore_index aside) fails the check (on CPU tensors the assertion
    raises at once); without a vocabulary to check against (a sharded call) it only counts."""
    from flce.backends.cuda.target_ops import count_tokens

    target = _targets(100, 50, -100, generator, torch.device("cpu"), 0.2)
    target[37] = bad
    with pytest.raises(RuntimeError, match=r"outside \[0, 50\) that is not ignore_index=-100"):
        count_tokens(target, -100, torch.float32, vocab=50)
    assert count_tokens(target, -100, torch.float32, vocab=None).count.item() == int((target != -100).sum())


def test_pytorch_form_counts_without_checking_cpu_targets(generator) -> None:
    """The PyTorch form leaves CPU targets to prepare_inputs' host check (which raises a ValueError naming the
    value before any kernel runs) and counts."""
    target = _targets(64, 50, -100, generator, torch.device("cpu"), 0.25)
    target[3] = 77
    counts = torch_count_tokens(target, -100, torch.float32, vocab=50)
    assert counts.count.item() == int((target != -100).sum())


_OUT_OF_RANGE_CALL = """
import torch, flce
x = torch.randn(64, 32, device="cuda", requires_grad=True)
w = torch.randn(100, 32, device="cuda", requires_grad=True)
t = torch.randint(0, 100, (64,), device="cuda")
t[{row}] = {value}
loss = flce.linear_cross_entropy(x, w, t, backend={backend!r})
loss.backward()
torch.cuda.synchronize()
print("no assertion")
"""


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "reference"])
@pytest.mark.parametrize("value", [100, -5])
def test_out_of_range_target_stops_a_gpu_call(backend, value) -> None:
    """On the GPU an out-of-range target fails the call's device-side assertion (the process's CUDA context
    is lost, hence a subprocess), by the CUDA backend's kernel and by the PyTorch form alike; a valid
    ignore_index (-100 in row 0) does not."""
    ok = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_CALL.format(row=0, value=-100, backend=backend)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "no assertion" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_CALL.format(row=5, value=value, backend=backend)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no assertion" not in bad.stdout
    assert "device-side assert" in bad.stderr or "Assertion" in bad.stderr, bad.stderr[-2000:]


_COMPILE_FOR_GPU = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flce.backends.cuda.target_kernels import _count_tokens_kernel

arch, values = int(sys.argv[1]), sys.argv[2]
signature = {"target_ptr": "*i64", "stride": "i32", "n": "i32", "vocab": "i32", "ignore_index": "i32",
             "values_ptr": values, "flags_ptr": "*i1", "CHECK": "constexpr", "BLOCK": "constexpr"}
source = ASTSource(_count_tokens_kernel, signature, {(7,): True, (8,): 4096})
compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
sys.stdout.write(compiled.asm["ptx"])
"""


@pytest.mark.parametrize(("arch", "values"), [(90, "*fp32"), (80, "*fp64")])
def test_kernel_compiles_for_the_gpu(arch, values) -> None:
    """The targets' kernel runs on every CUDA call but, without a GPU, only under the interpreter: compiled here
    for sm_90 and sm_80 (in a process without TRITON_INTERPRET, under whichever Triton the suite runs with), its
    PTX loads the targets in a loop and stores the three values and two flags."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_GPU, str(arch), values], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    assert f".target sm_{arch}" in ptx and "ld.global" in ptx
    bits = 32 if values == "*fp32" else 64
    stores = re.findall(r"st\.global(?:\.\w+)*?\.[bfu](8|32|64)\b", ptx)
    assert sorted(stores) == sorted([str(bits)] * 3 + ["8"] * 2), stores  # count, divisor, zero; counted, ok
    assert "bra" in ptx  # the loop over blocks of targets
