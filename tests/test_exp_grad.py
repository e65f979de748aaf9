"""The chunk gradient from kept exponentials (chunk_grad="exponentials", cuda/exp_grad_ops.py): the plain loss,
and losses with a temperature and token weights, whose gradient is a row multiple of softmax - onehot too.

Under the Triton interpreter (CPU, fp32) the exponentials come from the logits (exponentials_from_logits_), and
the finishing, redo and row-scaling kernels and the engine's row-scaled gradient products run as on a GPU;
the warp-specialised GEMM that writes them on Hopper is checked by the ``cuda`` tests in test_ws_gemm.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import lm_head_inputs, relative_error

import flce
from flce.autotune import override_params
from flce.testing import reference_loss

pytest.importorskip("triton")
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: runs where there is no GPU")

KNOBS = {"tokens_per_chunk": 8, "grad_schedule": "token_chunks", "chunk_grad": "exponentials"}


@pytest.fixture
def exp_calls(monkeypatch):
    """(rows of each chunk, rows redone) of every gemm_exp_grad call, so a test fails if the call took
    the logits path instead."""
    from flce.backends.cuda import ops

    calls = []
    real_redo = ops.redo_exp_rows
    real_grad = ops.TritonChunkKernels.gemm_exp_grad

    def counting_grad(self, hidden, *args, **kwargs):
        calls.append([hidden.shape[0], None])
        return real_grad(self, hidden, *args, **kwargs)

    def counting_redo(hidden, weight, target, redo_rows, redo_count, exp, lse, temperature):
        calls[-1][1] = int(redo_count.item())
        return real_redo(hidden, weight, target, redo_rows, redo_count, exp, lse, temperature)

    monkeypatch.setattr(ops.TritonChunkKernels, "gemm_exp_grad", counting_grad)
    monkeypatch.setattr(ops, "redo_exp_rows", counting_redo)
    return calls


def _grads_against_float64(x, w, t, reduction: str = "mean", **options):
    with override_params(KNOBS, backend="cuda"):
        loss = flce.linear_cross_entropy(x, w, t, backend="cuda", reduction=reduction, **options)
    gx, gw = torch.autograd.grad(loss, (x, w))
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = reference_loss(xd, wd, t, reduction=reduction, **options).loss
    ref_gx, ref_gw = torch.autograd.grad(ref, (xd, wd))
    return (loss, ref), (gx, ref_gx), (gw, ref_gw)


@interpreter_only
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exponentials_match_float64(reduction, exp_calls):
    """Three chunks (the last partial), some rows ignored: loss and both gradients at fp32 accuracy."""
    x, w, _, t = lm_head_inputs(21, 24, 203, torch.float32, "cpu", with_bias=False)
    for got, want in _grads_against_float64(x, w, t, reduction):
        assert relative_error(got, want) < 1e-5
    assert exp_calls == [[8, 0], [8, 0], [5, 0]]


@interpreter_only
def test_exponentials_redo_rows_past_the_cap(exp_calls):
    """Logits of +-1e4: nearly every row's loss is far beyond the ~84 nats the offsets keep below the cap, so its
    exponentials are recomputed as its gradient, with the lse of the recomputed logits; a wrong row would be off
    by O(1), NaN or inf. Two logits of a row within a few nats of each other make its gradient as sensitive as
    fp32 logits of ~1e4 are (|z| 2^-23 a rounding; the recomputed ones are summed in another order than the
    GEMM's): the bound, |z| 2^-20, is two orders below what a wrong row costs."""
    n, h, v = 18, 16, 203
    x = (torch.randn(n, h) * 40).requires_grad_()
    w = (torch.randn(v, h) * 20).requires_grad_()
    t = torch.randint(0, v, (n,))
    t[5] = -100
    (loss, ref), *grads = _grads_against_float64(x, w, t)
    assert sum(redone for _, redone in exp_calls) >= n // 2
    largest = float((x.detach() @ w.detach().t()).abs().max())
    assert float(ref) > 1000 and largest > 5e3
    assert relative_error(loss, ref) < 1e-6
    for got, want in grads:
        assert torch.isfinite(got).all() and relative_error(got, want) < largest * 2**-20


@interpreter_only
def test_exponentials_mixed_rows_and_all_ignored(exp_calls):
    """One row past the cap beside ordinary rows (only it is redone); a batch whose every row is ignored
    gives a zero loss and zero gradients, without NaN."""
    n, h, v = 16, 16, 203
    x = torch.randn(n, h)
    w = torch.randn(v, h) / 4
    t = torch.randint(0, v, (n,))
    x[3] = w[t[3]] * -400  # the target's logit far below the rest: a loss of thousands of nats
    x.requires_grad_(True)
    w.requires_grad_(True)
    # the redone row's logits (~+-300) carry fp32's |z| 2^-23 a rounding (the test above says why)
    largest = float((x.detach() @ w.detach().t()).abs().max())
    for got, want in _grads_against_float64(x, w, t):
        assert relative_error(got, want) < max(1e-5, largest * 2**-20)
    assert [redone for _, redone in exp_calls] == [1, 0]
    ignored = torch.full_like(t, -100)
    with override_params(KNOBS, backend="cuda"):
        loss = flce.linear_cross_entropy(x, w, ignored, backend="cuda")
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert float(loss) == 0.0 and not gx.any() and not gw.any()


@interpreter_only
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", [{"temperature": 0.7}, {"token_weights": True},
                                     {"temperature": 1.6, "token_weights": True}], ids=["T", "weights", "T+weights"])
def test_exponentials_with_temperature_and_token_weights(reduction, options, exp_calls):
    """An RL objective without an entropy term (token weights of both signs, a temperature: the gradient is still
    a row multiple of softmax - onehot) takes the kept exponentials too: loss and both gradients at fp32
    accuracy against the float64 oracle, three chunks."""
    x, w, _, t = lm_head_inputs(21, 24, 203, torch.float32, "cpu", with_bias=False)
    if options.get("token_weights"):
        options = dict(options, token_weights=torch.randn(t.shape))
    for got, want in _grads_against_float64(x, w, t, reduction, **options):
        assert relative_error(got, want) < 1e-5
    assert exp_calls == [[8, 0], [8, 0], [5, 0]]


@interpreter_only
def test_exponentials_detached_logprobs_with_temperature(exp_calls):
    """Detached log-probs beside the objective come from the row statistics of the same path: the oracle's."""
    x, w, _, t = lm_head_inputs(21, 24, 203, torch.float32, "cpu", with_bias=False)
    adv = torch.randn(t.shape)
    options = {"temperature": 0.7, "token_weights": adv, "return_logprobs": True}
    with override_params(KNOBS, backend="cuda"):
        out = flce.linear_cross_entropy(x, w, t, backend="cuda", detach_extras=True, **options)
    ref = reference_loss(x.detach().double(), w.detach().double(), t, **options)
    valid = t != -100
    assert not out.logprobs.requires_grad
    assert relative_error(out.logprobs[valid], ref.logprobs[valid]) < 1e-5
    assert relative_error(out.loss, ref.loss) < 1e-5
    assert len(exp_calls) == 3


@interpreter_only
def test_exponentials_redo_rows_with_temperature(exp_calls):
    """Rows past the cap at a temperature of 0.5 (logits of ~+-1e3 become ~+-2e3): recomputed with z = u / T, and
    their gradient carries the 1 / T; a redo that forgot the temperature is off by O(1)."""
    n, h, v = 18, 16, 203
    x = (torch.randn(n, h) * 12).requires_grad_()
    w = (torch.randn(v, h) * 6).requires_grad_()
    t = torch.randint(0, v, (n,))
    (loss, ref), *grads = _grads_against_float64(x, w, t, temperature=0.5, token_weights=torch.rand(n) + 0.5)
    assert sum(redone for _, redone in exp_calls) >= n // 2
    largest = float((x.detach() @ w.detach().t()).abs().max()) / 0.5
    assert float(ref) > 200
    assert relative_error(loss, ref) < 1e-6
    for got, want in grads:
        assert torch.isfinite(got).all() and relative_error(got, want) < largest * 2**-20


@interpreter_only
def test_exponential_offsets_follow_the_temperature():
    """c = the target's base-2 logit z_t log2(e) + 58 with z = u / temperature (0 on ignored rows): the offset
    keeps the GEMM's exponentials under their cap only when it is on the same scale as they are."""
    from flce.backends.cuda.exp_grad_ops import exp_offsets

    x, w, _, t = lm_head_inputs(21, 24, 203, torch.float32, "cpu", with_bias=False)
    valid = t != -100
    u_t = (x.detach().double() * w.detach().double()[torch.where(valid, t, 0)]).sum(1)
    for temperature in (1.0, 0.5, 2.0):
        got = exp_offsets(x.detach(), w.detach(), t, -100, temperature).double()
        want = torch.where(valid, u_t / temperature * 1.4426950408889634 + 58.0, 0.0)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-4)


def test_exponentials_planned_where_they_apply():
    """The tuned knob takes effect for a bf16/fp32 training call with a scalar loss, no bias and a gradient that is
    a row multiple of softmax - onehot (no option but a temperature and detached log-probs); a bias, fp16, another
    option or reduction="none" keep the logits path, and so does a call the cache says nothing for off Hopper
    (here: a CPU tensor)."""
    from planning import cuda_plan

    from flce.config import LCEConfig
    from flce.engine.plans import EXPONENTIALS, LOGITS
    from flce.inputs import prepare_inputs

    def chunk_grad(dtype=torch.float32, bias=False, knobs=KNOBS, **options) -> str:
        x, w, b, t = lm_head_inputs(16, 8, 64, dtype, "cpu", with_bias=bias)
        cfg = LCEConfig(**options)
        return cuda_plan(prepare_inputs(x, w, t, b, cfg), cfg, params=knobs).chunk_grad

    assert chunk_grad() == EXPONENTIALS
    assert chunk_grad(torch.bfloat16) == EXPONENTIALS
    assert chunk_grad(torch.float16) == LOGITS
    assert chunk_grad(bias=True) == LOGITS
    assert chunk_grad(label_smoothing=0.1) == LOGITS
    assert chunk_grad(reduction="none") == LOGITS
    # A gradient that stays a row multiple of softmax - onehot: a temperature, detached log-probs.
    assert chunk_grad(temperature=0.7) == EXPONENTIALS
    assert chunk_grad(temperature=0.7, return_logprobs=True, detach_extras=True) == EXPONENTIALS
    assert chunk_grad(return_logprobs=True) == LOGITS  # differentiable log-probs: gradients in backward
    # Below 0.5 a wrong target's row crosses the exponentials' window (84.6 nats at the temperature) too easily.
    assert chunk_grad(temperature=0.5) == EXPONENTIALS
    assert chunk_grad(temperature=0.49) == LOGITS
    for other in ({"entropy_weight": 0.01}, {"return_entropy": True, "detach_extras": True}, {"softcap": 30.0},
                  {"class_weight": torch.ones(64)}, {"token_scaling": True}, {"lse_square_scale": 1e-4}):
        assert chunk_grad(temperature=0.7, **other) == LOGITS, other
    assert chunk_grad(knobs={"tokens_per_chunk": 8, "grad_schedule": "token_chunks"}) == LOGITS


def test_kept_exponentials_capability_required():
    from flce.engine.kernels import KEPT_EXPONENTIALS
    from flce.engine.plans import TokenChunks

    assert KEPT_EXPONENTIALS in TokenChunks(8, chunk_grad="exponentials").requires
    assert KEPT_EXPONENTIALS not in TokenChunks(8).requires
    with pytest.raises(ValueError, match="chunk_grad"):
        TokenChunks(8, chunk_grad="probabilities")
