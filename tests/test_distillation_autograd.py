"""Linear distillation's autograd beyond one backward, against the float64 oracle: batched gradients
(is_grads_batched), torch.func's jacrev and grad, and second derivatives refused (nested torch.func transforms,
a double backward) instead of returning zeros. On the reference backend, and on the CUDA backend (its Triton
kernels in the interpreter without a GPU, on the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch
from distillation_helpers import NAMES, Pair, flce_loss, make_pair, oracle
from helpers import nested_second_derivatives

from flce.autotune import override_params

LOSSES = ("forward_kl", "reverse_kl", "jsd")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Chunks of a few rows: the transformed backward runs chunk by chunk, as the schedules do.
MANY_CHUNKS = 1000
FULL = {"hard_label_weight": 0.3, "temperature": 1.7, "teacher_grad": True}


def _leaves(pair, options: dict) -> list[torch.Tensor]:
    """The leaves the call differentiates: the student's, the teacher's too with teacher_grad."""
    return [t for name, t in zip(NAMES, pair.leaves, strict=True)
            if t is not None and (options.get("teacher_grad") or not name.startswith("teacher"))]


@pytest.mark.parametrize("options", [{}, FULL], ids=["plain", "hard-temperature-teacher"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss", LOSSES)
def test_batched_gradients_equal_a_loop_and_the_oracle(loss: str, reduction: str, options: dict,
                                                       generator: torch.Generator) -> None:
    """torch.autograd.grad(..., is_grads_batched=True) over a batch of upstream gradients equals one backward
    per batch entry, and each equals float64 autograd through the oracle."""
    pair = make_pair(generator, dtype=torch.float64, bias=True)
    options = dict(options, loss=loss, reduction=reduction, memory_budget=MANY_CHUNKS)
    leaves = _leaves(pair, options)
    out = flce_loss(pair, **options)
    batch = 3
    upstream = torch.rand(batch, *out.shape, generator=generator, dtype=torch.float64) + 0.5
    batched = torch.autograd.grad(out, leaves, upstream, retain_graph=True, is_grads_batched=True)
    fresh = pair.detached()
    want_loss = oracle(fresh, **options)
    fresh_leaves = _leaves(fresh, options)
    for i in range(batch):
        one = torch.autograd.grad(out, leaves, upstream[i], retain_graph=True)
        want = torch.autograd.grad(want_loss, fresh_leaves, upstream[i], retain_graph=True)
        for b, o, w in zip(batched, one, want, strict=True):
            torch.testing.assert_close(b[i], o, rtol=1e-10, atol=1e-12, msg=lambda m, i=i: f"entry {i} vs a loop: {m}")
            torch.testing.assert_close(b[i], w, rtol=1e-8, atol=1e-10, msg=lambda m, i=i: f"entry {i} vs oracle: {m}")


@pytest.mark.parametrize("loss", LOSSES)
def test_jacrev_of_per_token_losses_matches_the_oracle(loss: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, dtype=torch.float64, n=7)
    options = {"loss": loss, "reduction": "none", "hard_label_weight": 0.2, "memory_budget": MANY_CHUNKS}
    xs, ws, xt, wt, y = (pair.student_hidden.detach(), pair.student_weight.detach(), pair.teacher_hidden.detach(),
                         pair.teacher_weight.detach(), pair.target)

    def per_token(fn):
        def losses(h, w):
            case = Pair(h, w, None, xt, wt, None, y)
            return fn(case, **options)
        return losses

    got = torch.func.jacrev(per_token(flce_loss), argnums=(0, 1))(xs, ws)
    want = torch.func.jacrev(per_token(oracle), argnums=(0, 1))(xs, ws)
    for name, g, w in zip(("student_hidden", "student_weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10, msg=lambda m, name=name: f"d losses / d {name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_func_grad_matches_the_oracle(reduction: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, dtype=torch.float64)
    options = {"loss": "jsd", "reduction": reduction, "temperature": 0.8, "hard_label_weight": 0.4}
    detached = pair.detached()

    def loss_of(fn):
        return lambda w: fn(Pair(detached.student_hidden.detach(), w, None,
                                                           detached.teacher_hidden.detach(),
                                                           detached.teacher_weight.detach(), None, pair.target),
                            **options)

    weight = pair.student_weight.detach()
    torch.testing.assert_close(torch.func.grad(loss_of(flce_loss))(weight), torch.func.grad(loss_of(oracle))(weight),
                               rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("nesting", ["hessian", "jacrev-of-jacrev", "grad-of-grad"])
def test_second_derivatives_by_nested_transforms_are_refused(nesting: str, reduction: str,
                                                             generator: torch.Generator) -> None:
    """Nested transforms would see flce's gradients as constants and return zeros: they raise instead."""
    pair = make_pair(generator, dtype=torch.float64, n=4)
    xt, wt, ws = pair.teacher_hidden.detach(), pair.teacher_weight.detach(), pair.student_weight.detach()
    y = pair.target

    def loss(h: torch.Tensor) -> torch.Tensor:
        out = flce_loss(Pair(h, ws, None, xt, wt, None, y), reduction=reduction)
        return out.sum()

    nested = nested_second_derivatives(loss)[nesting]
    with pytest.raises(RuntimeError, match="first-order only"):
        nested(pair.student_hidden.detach())


def test_double_backward_is_refused(generator: torch.Generator) -> None:
    pair = make_pair(generator, dtype=torch.float64)
    out = flce_loss(pair, loss="reverse_kl")
    grad, = torch.autograd.grad(out, pair.student_hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order only.*double backward"):
        grad.square().sum().backward()


@pytest.mark.triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_backend_batched_gradients_match_the_oracle(reduction: str, generator: torch.Generator) -> None:
    """The CUDA backend's in-forward gradients scaled per batch entry (mean), and the transformed deferred
    backward (none), against the oracle."""
    pair = make_pair(generator, bias=True).detached(DEVICE)
    options = {"loss": "jsd", "reduction": reduction, "hard_label_weight": 0.3, "memory_budget": MANY_CHUNKS}
    with override_params({"block_v": 16, "num_warps": 4}, backend="cuda"):
        out = flce_loss(pair, backend="cuda", **options)
    leaves = _leaves(pair, options)
    upstream = torch.rand(2, *out.shape, generator=generator, dtype=torch.float64).to(DEVICE) + 0.5
    batched = torch.autograd.grad(out, leaves, upstream.to(out.dtype), is_grads_batched=True)
    fresh = pair.detached("cpu")
    want_loss = oracle(fresh, **options)
    fresh_leaves = _leaves(fresh, options)
    for i in range(2):
        want = torch.autograd.grad(want_loss, fresh_leaves, upstream[i].cpu(), retain_graph=True)
        for b, w in zip(batched, want, strict=True):
            error = (b[i].double().cpu() - w).norm() / w.norm()
            assert error <= 1e-4, f"entry {i}: relative error {error:.3g}"
