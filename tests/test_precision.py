"""precision="accurate": the statistics and the gradient from fp32 logits, 16-bit only as GEMM
operands. Against the float64 oracle it must be far closer than the default (which rounds each logit
to bf16 before the fp32 softmax), on every schedule, and identical to it where inputs are fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import TEMPERATURE, assert_entropy_near_eager, entropy_errors, large_logits_inputs, reference_loss

import flce
from flce.testing.measure import ulp_spacing


def _errors(x, w, t, **options) -> tuple[float, float, float]:
    """Relative errors of loss, grad_hidden, grad_weight against float64 (random upstream gradient)."""
    out = flce.linear_cross_entropy(x, w, t, **options)
    upstream = torch.linspace(0.5, 1.5, out.numel(), device=out.device).reshape(out.shape)
    gx, gw = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    options.pop("precision", None), options.pop("memory_budget", None)
    want = reference_loss(xd, wd, t, **options).loss
    rx, rw = torch.autograd.grad((want * upstream.double()).sum(), (xd, wd))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b).norm() / b.norm())

    return rel(out, want.detach()), rel(gx, rx), rel(gw, rw)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget_rows", [None, 16], ids=["one-chunk", "chunks"])
def test_accurate_is_closer_to_float64_than_fast(reduction: str, budget_rows: int | None,
                                                 generator: torch.Generator) -> None:
    # Logits of magnitude ~25: a bf16 logit is off by up to 0.06, a visible share of each loss.
    x, w, t = large_logits_inputs(generator, 96, 32, 2000, 4.0, torch.bfloat16)
    budget = None if budget_rows is None else budget_rows * 2000 * 6
    fast = _errors(x, w, t, reduction=reduction, memory_budget=budget)
    accurate = _errors(x, w, t, reduction=reduction, memory_budget=budget, precision="accurate")
    assert accurate[0] < min(1e-6, fast[0] / 10), (accurate, fast)
    # The gradients still pass through bf16 GEMM operands: closer, not exact.
    assert accurate[1] < fast[1] / 2 and accurate[2] < fast[2] / 2, (accurate, fast)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("budget_rows", [None, 32], ids=["one-chunk", "chunks"])
# The CUDA backend on the GPU (its fp32 sums are cuBLAS's fp32-output GEMMs; on CPU tensors under the interpreter
# its accumulate_fp32_ rounds each block's product to 16 bits first).
@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_accurate_gradients_are_fp32_sums_rounded_once(dtype: torch.dtype, reduction: str, budget_rows: int | None,
                                                       backend: str, generator: torch.Generator) -> None:
    """precision="accurate" takes the fp32 logit gradient G into both products (two 16-bit parts, fp32 sums) and
    rounds each gradient once: per element within one ULP of float64 plus 2**-15 of the products' absolute terms
    (|G| @ |W|, |G|.T @ |x|: the parts carry 16 bits of G; fp16's smallest subnormal per element of G besides).
    A single 16-bit rounding of G (2**-9 of those terms for bf16) and a weight gradient summed across chunks in
    the weight's dtype missed this bound by up to 1e4 ULP."""
    n, h, v = 192, 32, 256
    x = torch.randn(n, h, generator=generator, dtype=torch.float64).to(dtype)
    w = (torch.randn(v, h, generator=generator, dtype=torch.float64) / h ** 0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=generator)
    budget = None if budget_rows is None else budget_rows * v * 6
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    logits = (xd @ wd.T).detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits, t, reduction=reduction)
    (g,) = torch.autograd.grad(loss, logits)
    want = (g @ wd.detach(), g.T @ xd.detach())
    device = "cuda" if backend == "cuda" else "cpu"
    xs, ws = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    got = torch.autograd.grad(flce.linear_cross_entropy(xs, ws, t.to(device), reduction=reduction,
                                                        precision="accurate", memory_budget=budget, backend=backend),
                              (xs, ws))
    got = tuple(grad.cpu() for grad in got)
    g_error = 2.0 ** -15 * g.abs() + torch.finfo(dtype).smallest_normal * 2.0 ** -10
    bounds = (g_error @ wd.detach().abs(), g_error.T @ xd.detach().abs())
    for name, mine, exact, bound in zip(("grad_hidden", "grad_weight"), got, want, bounds, strict=True):
        error, ulp = (mine.double() - exact).abs(), ulp_spacing(exact, dtype)
        excess = error - ulp - bound
        assert float(excess.max()) <= 0, (name, float((error / ulp).max()))


def test_16_bit_inputs_give_an_fp32_loss(generator: torch.Generator) -> None:
    """The documented choice (docs/precision.md): a bf16/fp16 call returns its loss and per-token outputs in fp32,
    as torch's cross_entropy does under autocast, where torch's linear_cross_entropy outside autocast returns the
    input dtype. fp32 and fp64 inputs keep their dtype."""
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)):
        x, w, t = large_logits_inputs(generator, 8, 16, 50, 2.0, dtype)
        for precision in ("fast", "accurate"):
            out = flce.linear_cross_entropy(x, w, t, precision=precision, reduction="none", return_logprobs=True)
            assert out.loss.dtype == out.logprobs.dtype == want, (dtype, precision, out.loss.dtype)


def test_single_token_loss(generator: torch.Generator) -> None:
    """One bf16 token with large logits; fast rounds its logits to bf16."""
    x, w, t = large_logits_inputs(generator, 1, 64, 1000, 30.0, torch.bfloat16)
    t[0] = 3
    assert _errors(x, w, t, precision="accurate")[0] < 1e-6


def test_accurate_is_the_default_for_fp32(generator: torch.Generator) -> None:
    x, w, t = large_logits_inputs(generator, 40, 16, 300, 3.0, torch.float32)
    fast = flce.linear_cross_entropy(x, w, t, reduction="none")
    accurate = flce.linear_cross_entropy(x, w, t, reduction="none", precision="accurate")
    assert torch.equal(fast, accurate)


def test_bad_precision_is_named() -> None:
    with pytest.raises(ValueError, match="precision='exact': expected one of"):
        flce.linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                                  precision="exact")


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_accurate_bf16(reduction: str, generator: torch.Generator) -> None:
    x, w, t = large_logits_inputs(generator, 4096, 1024, 32000, 2.0, torch.bfloat16)
    x, w, t = (a.detach().cuda().requires_grad_() if a.is_floating_point() else a.cuda() for a in (x, w, t))
    fast = _errors(x, w, t, reduction=reduction)
    accurate = _errors(x, w, t, reduction=reduction, precision="accurate")
    assert accurate[0] < fast[0] / 4, (accurate, fast)
    assert accurate[1] <= fast[1] and accurate[2] <= fast[2], (accurate, fast)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_entropy_at_large_logits_is_as_accurate_as_eager(backend: str, generator: torch.Generator) -> None:
    """At temperature 0.25 these logits reach |z| ~ 400-500 and the softmax is peaked (entropies 0-0.7).
    The entropy's gradient p (z - E[z]) is then a small difference of large numbers; flce forms it from
    log p = z - lse and sums exp(z - max) * (z - max), so its fp32 error stays near eager's, whose own
    comes from rounding z. Over 40 seeds (384 rows, reference and interpreted cuda kernels): the entropy's
    within 1.01x, the gradients' within 1.48x; forming both from z, as flce did until the property tests'
    drawn seeds 1236 and 1259 failed, gave 5-12x (entropy) and 4.0-19x (gradients) on the same draws.
    The cuda backend's Triton kernels run interpreted without a GPU."""
    if backend == "cuda" and torch.cuda.is_available():
        pytest.skip("interpreter test: the GPU runs test_gpu_entropy_at_large_logits")
    x, w, t = large_logits_inputs(generator)
    assert_entropy_near_eager(entropy_errors(_flce_entropy(backend), x, w, t, TEMPERATURE))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["default", "1MiB"])
def test_gpu_entropy_at_large_logits(dtype: torch.dtype, budget: int | None, generator: torch.Generator) -> None:
    """The same on the GPU at a real vocabulary, every kernel of the default and the low-memory
    schedules (the statistics GEMM, the gradient GEMMs), bf16 included; the gradients within 3x of
    eager's error, the bound this test passed with on the H100 (2026-11-25)."""
    x, w, t = large_logits_inputs(generator, 1024, 256, 32001, 0.5, dtype)
    x, w, t = (a.detach().cuda().requires_grad_() if a.is_floating_point() else a.cuda() for a in (x, w, t))
    errors = entropy_errors(_flce_entropy("cuda", memory_budget=budget), x, w, t, TEMPERATURE)
    assert_entropy_near_eager(errors, gradient_factor=3.0)


def _flce_entropy(backend: str, **options):
    def call(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> flce.LCEOutput:
        return flce.linear_cross_entropy(x, w, t, reduction="none", return_entropy=True, temperature=TEMPERATURE,
                                         backend=backend, **options)
    return call


def test_bf16_single_token_loss_within_the_documented_bounds(generator: torch.Generator) -> None:
    """docs/precision.md: a bf16 single-token loss is within 2**-9 (max |z| + |z_y|) of float64 with
    precision="fast" (each logit rounded to bf16), and within torch's bf16 tolerance (rtol 1.6e-2,
    atol 1e-5) with precision="accurate", on the inputs torch's own tests draw and at V = 1000."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "benchmarks" / "precision_single_token.py"
    spec = importlib.util.spec_from_file_location("precision_single_token", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = [tool.errors(*case, torch.device("cpu")) for case in tool.single_token_cases(generator, 60, 1000)]
    for row in rows:
        assert row["flce fast"] <= row["fast bound"], row
        assert row["flce accurate"] <= row["torch tolerance"], row
