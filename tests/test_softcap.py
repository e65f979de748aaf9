"""A softcap of any size: ``softcap * tanh(u / softcap)`` within fp32 rounding of itself on every backend.

Large caps are where a tanh built as ``1 - 2 / (exp(2x) + 1)`` fails: near x = 0 it loses softcap * 1e-7
absolutely on each logit (a per-token loss 1e-3 off at a cap of 1e4, 10 nats at 1e8, uniform at 1e30).
The per-token losses and the gradients are compared with the float64 oracle and must be as close as eager
fp32 torch on the same inputs. The CUDA backend's Triton kernels run here under the interpreter (fp32);
the GPU tests below run them compiled (fp32 and bf16, the warp-specialised statistics GEMM on Hopper), and
tests/test_ascend_contract.py runs the Ascend kernels'.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import make_inputs, relative_error

import flce
from flce.testing import reference_loss

BACKENDS = ["reference", pytest.param("cuda", marks=pytest.mark.triton)]
# (softcap, logit scale): logits of a few units against caps far above them (where tanh's argument is
# tiny), and logits up to ~10x a cap of 100 (where the cap saturates, and the seam between tanh's forms).
CAPS = [(1e2, 3.0), (1e2, 300.0), (1e4, 3.0), (1e8, 3.0), (1e30, 3.0)]


def _eager(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float) -> torch.Tensor:
    logits = hidden @ weight.T
    return F.cross_entropy(softcap * torch.tanh(logits / softcap), target, reduction="none")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap,logit_scale", CAPS)
def test_large_softcaps_match_float64_as_eager_does(backend: str, softcap: float, logit_scale: float,
                                                    generator: torch.Generator) -> None:
    # The CUDA backend's kernels take the GPU's tensors where there is one (compiled), else the CPU's (interpreted).
    device = "cuda" if backend == "cuda" and torch.cuda.is_available() else "cpu"
    hidden, weight, target, _ = make_inputs((24,), 32, 300, logit_scale=logit_scale, generator=generator,
                                            device=device)
    x64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    want = reference_loss(x64, w64, target, softcap=softcap, reduction="none").loss
    upstream = (torch.rand(want.shape, generator=generator, dtype=torch.float64) + 0.5).to(device)
    want_grads = torch.autograd.grad(want, (x64, w64), upstream)
    x32, w32 = (t.detach().requires_grad_() for t in (hidden, weight))
    eager = _eager(x32, w32, target, softcap)
    eager_grads = torch.autograd.grad(eager, (x32, w32), upstream.float())
    x, w = (t.detach().requires_grad_() for t in (hidden, weight))
    got = flce.linear_cross_entropy(x, w, target, backend=backend, softcap=softcap, reduction="none")
    grads = torch.autograd.grad(got, (x, w), upstream.float())

    error = float((got.double() - want).abs().max())
    eager_error = float((eager.double() - want).abs().max())
    assert error <= 2 * eager_error + 1e-6, (error, eager_error)
    for name, g, e, r in zip(("grad_hidden", "grad_weight"), grads, eager_grads, want_grads, strict=True):
        err, eager_err = relative_error(g, r), relative_error(e, r)
        assert err <= 2 * eager_err + 1e-6, (name, err, eager_err)


# On the GPU: the loss with a cap far above the logits minus the uncapped loss, on the same inputs and
# kernels (the full variant for both, so that only the cap differs), is the float64 difference (about
# u^3 / (3 softcap^2): nothing at these caps) to fp32 rounding; in bf16 too, where the rounding of the logits
# themselves would hide a softcap error of 1e-3 from a comparison with the oracle. "warp_specialized" pins
# the Hopper statistics GEMM (its Gluon epilogue computes the cap) for the statistics and the chunks' logits.
GPU_SHAPES = [(1000, 512, 8192), (3000, 1024, 50000)]
WS_KNOBS = {"forward_stats": "fused", "stats_kernel": "warp_specialized", "forward_logits": "fused",
            "logits_kernel": "warp_specialized"}


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["default", "warp_specialized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [1e4, 1e6, 1e8])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_large_softcaps_on_the_gpu_leave_the_loss_as_float64_does(kernels: str, dtype: torch.dtype, softcap: float,
                                                                  shape: tuple[int, int, int], training: bool,
                                                                  generator: torch.Generator) -> None:
    from flce.autotune import override_params

    if kernels == "warp_specialized" and (dtype == torch.float32 or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the warp-specialised statistics GEMM takes 16-bit inputs on an sm_90 GPU")
    tokens, hidden_size, vocab = shape
    hidden, weight, target, _ = make_inputs((tokens,), hidden_size, vocab, dtype=dtype, logit_scale=4.0,
                                            generator=generator, device="cuda")
    x64, w64 = hidden.double(), weight.double()
    want = (reference_loss(x64, w64, target, softcap=softcap, reduction="none").loss
            - reference_loss(x64, w64, target, reduction="none").loss)
    results = []
    for cap in (softcap, None):
        x, w = (t.detach().requires_grad_(training) for t in (hidden, weight))
        pinned = (override_params(WS_KNOBS, backend="cuda") if kernels == "warp_specialized"
                  else contextlib.nullcontext())
        with pinned, torch.set_grad_enabled(training):
            loss = flce.linear_cross_entropy(x, w, target, variant="full", softcap=cap, reduction="none")
            grads = torch.autograd.grad(loss.sum(), (x, w)) if training else ()
        results.append((loss.detach().double(), [g.double() for g in grads]))
    (capped, capped_grads), (plain, plain_grads) = results
    # Per-token losses of a few nats: fp32 rounding of the softmax statistics, a few 1e-6.
    error = float((capped - plain - want).abs().max())
    assert error <= 2e-5, error
    # The softcap's own effect on the gradients, O(u^2 / softcap^2), is far below fp32's 1e-4. In a 16-bit gradient
    # it still moves the elements it carries across a rounding boundary by one ulp (2^-8 relative): 1.2e-4 to
    # 1.5e-4 by relative norm at softcap 1e4 (H200, bf16). The defect this guards against, the former tanh's
    # softcap * 1e-7 on each logit (1e-3 at 1e4), would move about a quarter of them: ~2e-3 (estimated).
    bound = 1e-4 if dtype == torch.float32 else 4e-4
    for g, p in zip(capped_grads, plain_grads, strict=True):
        assert relative_error(g, p) <= bound
