"""Linear distillation on a GPU against the float64 oracle: fp32 to 1e-4 relative for every loss, the hard
term, a temperature, the teacher's gradient and memory budgets that force many chunks; bf16 within 1.5x of
eager bf16's error (materialised PyTorch in bf16, measured on the same inputs). The backend selection picks
(None: the CUDA backend's pair kernels, forward's passes in one kernel or, by the cache's knobs, one each and a
number of rows in flight) and the reference backend by name; the kernels that ran are the ones the call's record
names, and that record is explain's for this GPU. GPU only (marker ``cuda``)."""

from __future__ import annotations

import zlib

import pytest
import torch
from distillation_helpers import assert_matches_oracle, flce_loss, make_pair, oracle, relative
from helpers import TORCH_GEMMS, flce_kernel_names, launched, launches_against_record

import flce
from flce.autotune import override_params

pytestmark = pytest.mark.cuda

BACKENDS = [None, "reference"]


def _variants() -> dict[str, dict | None]:
    """The pair kernels' launches: the heuristic, one kernel a pass, one and two rows in flight a multiprocessor,
    the one kernel without its register cap; the statistics from the warp-specialised logits GEMMs (reverse KL's
    E_q[s - t] from the student's, reading the teacher's logits; for fp32, where that kernel does not fit, its
    fallback, the Triton statistics GEMM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"heuristic": None, "separate": {"pair_passes": "separate"}, "in-flight-1": {"rows_in_flight": sms},
            "in-flight-2": {"rows_in_flight": 2 * sms}, "no-register-cap": {"pair_registers": 255},
            "gemm-statistics": {"forward_logits": "fused", "logits_kernel": "warp_specialized"}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_matches_the_oracle(backend: str | None, loss: str, reduction: str,
                                    generator: torch.Generator) -> None:
    pair = make_pair(generator, n=384, student_size=128, teacher_size=192, vocab=5003, bias=True, scale=3.0,
                     ignore_fraction=0.1).detached("cuda")
    variants = _variants() if backend is None else {"": None}
    # 1 MiB: chunks of a few dozen rows of both fp32 logits; the default: one chunk.
    for budget in (1 << 20, None):
        for knobs in variants.values():
            with override_params(knobs, backend="cuda"):
                assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, hard_label_weight=0.25,
                                      temperature=0.8, teacher_grad=True, backend=backend, memory_budget=budget)


def _eager_bfloat16_errors(pair, expected: torch.Tensor, want: tuple[torch.Tensor, ...],
                           loss_name: str = "jsd") -> tuple[float, ...]:
    """Relative errors of materialised eager PyTorch run in bf16 (``loss_name``, JSD's beta 0.5): the bound flce
    must stay within."""
    xs = pair.student_hidden.detach().bfloat16().requires_grad_()
    ws = pair.student_weight.detach().bfloat16().requires_grad_()
    xt, wt = pair.teacher_hidden.detach().bfloat16(), pair.teacher_weight.detach().bfloat16()
    log_q = torch.log_softmax(xs @ ws.T, dim=-1)
    log_p = torch.log_softmax(xt @ wt.T, dim=-1)
    if loss_name == "forward_kl":
        rows = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif loss_name == "reverse_kl":
        rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        half = torch.tensor(0.5, device=xs.device).log()
        log_m = torch.logaddexp(log_p + half, log_q + half)
        rows = 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)
    valid = pair.target != -100
    loss = torch.where(valid, rows.float(), 0.0).sum() / valid.sum()
    grads = torch.autograd.grad(loss, (xs, ws))
    return (relative(loss.detach(), expected), *(relative(g, w) for g, w in zip(grads, want, strict=True)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("teacher_size", [1024, 2048])
def test_bfloat16_within_eager_bfloat16_error(backend: str | None, teacher_size: int,
                                              generator: torch.Generator) -> None:
    pair = make_pair(generator, n=2048, student_size=1024, teacher_size=teacher_size, vocab=32000,
                     ignore_fraction=0.06)
    reference = pair.detached()
    expected = oracle(reference).detach()
    want = torch.autograd.grad(oracle(reference), (reference.student_hidden, reference.student_weight))
    gpu = pair.detached("cuda")
    bounds = _eager_bfloat16_errors(gpu, expected, want)
    ours = type(gpu)(*(None if t is None else t.detach().bfloat16().requires_grad_(t.requires_grad)
                       for t in gpu.leaves), gpu.target)
    loss = flce_loss(ours, backend=backend, memory_budget=64 << 20)
    grads = torch.autograd.grad(loss, (ours.student_hidden, ours.student_weight))
    errors = (relative(loss.detach(), expected), *(relative(g, w) for g, w in zip(grads, want, strict=True)))
    for name, error, bound in zip(("loss", "grad student_hidden", "grad student_weight"), errors, bounds,
                                  strict=True):
        assert error <= 1.5 * max(bound, 1e-3 if name == "loss" else 0.0), (name, error, bound)


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_bfloat16_pair_kernel_variants(loss: str, generator: torch.Generator) -> None:
    """Every launch of the pair kernels within eager bf16's error, at a vocabulary of many blocks a row, in chunks."""
    pair = make_pair(generator, n=1024, student_size=512, teacher_size=768, vocab=50304, ignore_fraction=0.06)
    reference = pair.detached()
    expected = oracle(reference, loss=loss)
    want = torch.autograd.grad(expected, (reference.student_hidden, reference.student_weight))
    expected = expected.detach()
    gpu = pair.detached("cuda")
    bounds = _eager_bfloat16_errors(gpu, expected, want, loss)
    ours = type(gpu)(*(None if t is None else t.detach().bfloat16().requires_grad_(t.requires_grad)
                       for t in gpu.leaves), gpu.target)
    for name, knobs in _variants().items():
        with override_params(knobs, backend="cuda"):
            value = flce_loss(ours, loss=loss, memory_budget=32 << 20)
        grads = torch.autograd.grad(value, (ours.student_hidden, ours.student_weight))
        errors = (relative(value.detach(), expected), *(relative(g, w) for g, w in zip(grads, want, strict=True)))
        for what, error, bound in zip(("loss", "grad student_hidden", "grad student_weight"), errors, bounds,
                                      strict=True):
            assert error <= 1.5 * max(bound, 1e-3 if what == "loss" else 0.0), (name, what, error, bound)


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_register_cap_changes_no_bit(loss: str, generator: torch.Generator) -> None:
    """The one-kernel passes' register cap (plan.PAIR_REGISTERS) moves the register allocation only: the loss and
    every gradient, the teacher's and the hard term's included, are the same bits with and without it."""
    pair = make_pair(generator, n=600, student_size=256, teacher_size=384, vocab=50304, dtype=torch.bfloat16,
                     ignore_fraction=0.06).detached("cuda")
    results = []
    for knobs in (None, {"pair_registers": 255}):
        with override_params(knobs, backend="cuda"):
            value = flce_loss(pair, loss=loss, hard_label_weight=0.3, teacher_grad=True, memory_budget=32 << 20)
        leaves = (pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight)
        results.append((value.detach(), *torch.autograd.grad(value, leaves)))
    for capped, uncapped in zip(*results, strict=True):
        assert torch.equal(capped, uncapped)


# name: (tokens, student H, teacher H, V, dtype, bias, training, options, autotune knobs)
RECORD_CALLS = {
    "jsd": (4096, 1024, 2048, 32000, torch.bfloat16, False, True, {}, None),
    "jsd-separate-teacher-hard": (4096, 1024, 2048, 32000, torch.bfloat16, False, True,
                                  {"teacher_grad": True, "hard_label_weight": 0.3}, {"pair_passes": "separate"}),
    "forward-kl-none-bias": (4096, 1024, 2048, 32000, torch.bfloat16, True, True,
                             {"loss": "forward_kl", "reduction": "none"}, None),
    "reverse-kl-fp16-16MiB": (4096, 1024, 2048, 32000, torch.float16, False, True,
                              {"loss": "reverse_kl", "temperature": 2.0, "memory_budget": 16 << 20}, None),
    "fp32": (1024, 512, 512, 32000, torch.float32, False, True, {}, None),
    "ws-products": (4096, 1024, 2048, 32000, torch.bfloat16, False, True, {},
                    {"grad_gemm_kernel": "warp_specialized"}),
    "no-grad": (4096, 1024, 2048, 32000, torch.bfloat16, False, False, {"hard_label_weight": 0.5}, None),
}


@pytest.mark.parametrize("name", list(RECORD_CALLS))
def test_kernels_that_ran_are_the_ones_the_record_named(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.profiler's CUDA kernels of a call against its record (tests/test_explain_gpu.py's check): flce's by
    name both ways, cuBLAS by presence; with nothing cached the record is explain's for this GPU."""
    from flce.engine.distillation import run

    n, hs, ht, v, dtype, bias, training, options, knobs = RECORD_CALLS[name]
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))

    def leaf(*size: int, std: float = 1.0, grad: bool = training) -> torch.Tensor:
        return (torch.randn(*size, device="cuda", generator=g) * std).to(dtype).requires_grad_(grad)

    teacher = training and options.get("teacher_grad", False)
    xs, ws, xt, wt = leaf(n, hs), leaf(v, hs, std=hs**-0.5), leaf(n, ht, grad=teacher), leaf(v, ht, std=ht**-0.5,
                                                                                              grad=teacher)
    bs, bt = (leaf(v, std=0.1), leaf(v, std=0.1, grad=teacher)) if bias else (None, None)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    records = []
    real = run.apply_eager
    monkeypatch.setattr(run, "apply_eager", lambda pair, call: records.append(call.choice) or real(pair, call))

    def step() -> None:
        with override_params(knobs, backend="cuda"), torch.set_grad_enabled(training):
            loss = flce.linear_distillation_loss(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt, **options)
        if training:
            loss.sum().backward()

    step()  # compiles the kernels
    names = launched(step)
    record = records[-1]
    assert record.backend == "cuda"
    ran, named, cublas_ran = launches_against_record(names, record)
    flce_names = flce_kernel_names()
    assert named <= flce_names, f"the record names kernels that are not the backend's: {named - flce_names}"
    assert ran == named, f"{name}: ran {sorted(ran)}, the record named {sorted(named)}\n{record}"
    assert cublas_ran == bool(record.kernel_names() & TORCH_GEMMS), f"{name}: cuBLAS ran: {cublas_ran}\n{record}"
    if knobs is None:
        props = torch.cuda.get_device_properties(0)
        with override_params(knobs, backend="cuda"):  # the call's cache answer: the heuristics, as in step()
            explained = flce.explain_distillation(
                "cuda", gpu=torch.cuda.get_device_name(0), capability=(props.major, props.minor),
                multiprocessors=props.multi_processor_count, total_memory=props.total_memory, shape=(n, hs, ht, v),
                dtype=dtype, training=training, student_bias=bias, teacher_bias=bias, **options)
        assert explained == record
