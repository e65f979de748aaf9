"""Linear distillation on a GPU against the float64 oracle: fp32 to 1e-4 relative for every loss, the hard
term, a temperature, the teacher's gradient and memory budgets that force many chunks; bf16 within 1.5x of
eager bf16's error (materialised PyTorch in bf16, measured on the same inputs). The backend selection picks
(None) and the reference backend by name. GPU only (marker ``cuda``)."""

from __future__ import annotations

import pytest
import torch
from distillation_helpers import assert_matches_oracle, flce_loss, make_pair, oracle, relative

pytestmark = pytest.mark.cuda

BACKENDS = [None, "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_matches_the_oracle(backend: str | None, loss: str, reduction: str,
                                    generator: torch.Generator) -> None:
    pair = make_pair(generator, n=384, student_size=128, teacher_size=192, vocab=5003, bias=True, scale=3.0,
                     ignore_fraction=0.1).detached("cuda")
    # 1 MiB: chunks of a few dozen rows of both fp32 logits; the default: one chunk.
    for budget in (1 << 20, None):
        assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, hard_label_weight=0.25,
                              temperature=0.8, teacher_grad=True, backend=backend, memory_budget=budget)


def _eager_bfloat16_errors(pair, expected: torch.Tensor, want: tuple[torch.Tensor, ...]) -> tuple[float, ...]:
    """Relative errors of materialised eager PyTorch run in bf16 (JSD, beta 0.5): the bound flce must stay within."""
    xs = pair.student_hidden.detach().bfloat16().requires_grad_()
    ws = pair.student_weight.detach().bfloat16().requires_grad_()
    xt, wt = pair.teacher_hidden.detach().bfloat16(), pair.teacher_weight.detach().bfloat16()
    log_q = torch.log_softmax(xs @ ws.T, dim=-1)
    log_p = torch.log_softmax(xt @ wt.T, dim=-1)
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
