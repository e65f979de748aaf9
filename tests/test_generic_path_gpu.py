"""The generic kernels on silicon: calls planned as another GPU would plan them (``FLCE_CUDA_PLAN_AS``, flce/backends/
cuda/hardware.py: an A100 or an L40S, which have neither TMA nor the warp-specialised Gluon GEMM; a B200, which has
TMA but not that GEMM) run on this Hopper GPU. Each call's loss and gradients are held to the float64 oracle (bf16:
within 1.5x of materialised eager bf16's error), the kernels that ran are the ones its record names, and none of them
is the warp-specialised GEMM (nor, planned as an sm_80 or sm_89 GPU, a TMA variant)."""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch
from helpers import launched, launches_against_record, relative_error

import flce
from flce.autotune import override_params
from flce.engine import run as engine_run

pytestmark = pytest.mark.cuda

PLAN_AS = ["NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA B200"]
RL = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "temperature": 0.7}
# name: (tokens, hidden, vocab, bias, training, options, autotune knobs or None)
CALLS = {
    "default": (4096, 1024, 32000, False, True, {}, None),
    "forward-only": (4096, 1024, 32000, False, False, {}, None),
    "rl-deferred": (4096, 1024, 32000, False, True, RL, None),
    "full-variant-bias": (4096, 1024, 32001, True, True, {"label_smoothing": 0.1, "softcap": 30.0}, None),
    "64MiB": (4096, 1024, 32000, False, True, {"memory_budget": 64 << 20}, None),
    "tuned-triton-logits": (4096, 1024, 32000, False, True, {}, {"forward_logits": "fused", "logits_kernel": "triton"}),
    "tuned-exponentials": (4096, 1024, 32000, False, True, {},
                           {"chunk_grad": "exponentials", "logits_kernel": "triton"}),
    "tuned-fused-gradient": (4096, 1024, 32000, False, True, dict(RL, memory_budget=64 << 20),
                             {"forward_stats": "fused", "backward_grad": "fused"}),
}


def _outputs_and_grads(out: object, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       upstream: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(the loss, the gradients of hidden, weight and bias) of a call's output, RL outputs through fixed upstream
    gradients."""
    if isinstance(out, torch.Tensor):
        loss, total = out, out
    else:
        loss = out.loss
        total = (loss * upstream).sum() + out.logprobs.sum() + 0.5 * out.entropy.sum()
    inputs = tuple(t for t in (x, w, b) if t is not None)
    return loss, torch.autograd.grad(total, inputs) if x.requires_grad else ()


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("gpu", PLAN_AS)
def test_generic_path_against_float64(gpu: str, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLCE_CUDA_PLAN_AS", gpu)
    n, h, v, with_bias, training, options, knobs = CALLS[call]
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{gpu} {call}".encode()))
    x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(training)
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).bfloat16().requires_grad_(training)
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_(training) if with_bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::17] = -100
    upstream = torch.rand(n, device="cuda", generator=g) if options.get("reduction") == "none" else None
    records = []
    real = engine_run.apply_eager
    monkeypatch.setattr(engine_run, "apply_eager", lambda flat, c: records.append(c.choice) or real(flat, c))

    def call_flce() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with (override_params(knobs, backend="cuda") if knobs else contextlib.nullcontext(),
              torch.set_grad_enabled(training)):
            return _outputs_and_grads(flce.linear_cross_entropy(x, w, t, b, **options), x, w, b, upstream)

    loss, grads = call_flce()
    names = launched(call_flce)
    record = records[-1]
    assert f"planned as this GPU, running on an {torch.cuda.get_device_name()}" in record.device, record.device
    ran, named, _ = launches_against_record(names, record)
    assert ran == named, f"{gpu} {call}: ran {sorted(ran)}, the record named {sorted(named)}\n{record}"
    assert "_ws_gemm_kernel" not in ran
    if gpu != "NVIDIA B200":
        assert "TMA on" not in str(record) and "_gemm_grad_persistent_kernel" not in ran, record

    # The float64 oracle, and materialised eager bf16 as the yardstick of the gradients' error.
    def reference(dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        xr, wr = x.detach().to(dtype).requires_grad_(training), w.detach().to(dtype).requires_grad_(training)
        br = None if b is None else b.detach().to(dtype).requires_grad_(training)
        with torch.set_grad_enabled(training):
            out = flce.testing.reference_loss(xr, wr, t, br, **options)
            return _outputs_and_grads(out if upstream is not None else out.loss, xr, wr, br, upstream)

    ref_loss, ref_grads = reference(torch.float64)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=2e-2, atol=2e-2)
    if training:
        eager_grads = _eager_bf16_grads(x, w, b, t, options, upstream)
        for got, eager, want, what in zip(grads, eager_grads, ref_grads, ("hidden", "weight", "bias"), strict=False):
            assert relative_error(got, want) <= 1.5 * relative_error(eager, want) + 1e-6, (gpu, call, what)


def _eager_bf16_grads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor, options: dict,
                      upstream: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The gradients of materialised bf16 logits through torch's own loss (fp32 softmax), the eager yardstick."""
    xe, we = x.detach().requires_grad_(), w.detach().requires_grad_()
    be = None if b is None else b.detach().requires_grad_()
    logits = xe @ we.t() if be is None else torch.addmm(be, xe, we.t())
    softcap, temperature = options.get("softcap"), options.get("temperature", 1.0)
    z = logits.float()
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    z = z / temperature
    valid = t != -100
    logp = torch.log_softmax(z, -1)
    if options.get("reduction") == "none":
        lp = torch.where(valid, logp.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
        entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
        total = (-lp * upstream).sum() + lp.sum() + 0.5 * entropy.sum()
    else:
        total = torch.nn.functional.cross_entropy(z, t, ignore_index=-100,
                                                  label_smoothing=options.get("label_smoothing", 0.0))
    return torch.autograd.grad(total, tuple(v for v in (xe, we, be) if v is not None))
