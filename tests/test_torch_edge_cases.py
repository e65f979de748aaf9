"""Inputs at the edges of torch's cross_entropy semantics, where a fused kernel can silently differ:
class weights whose sum over the counted targets is negative, zero or NaN. flce, and the float64
oracle it ships, against ``F.cross_entropy`` on the materialised float64 logits, NaN for NaN, on
the reference backend and on the CUDA backend's Triton kernels (interpreted on CPU tensors without
a GPU; fp32, as the interpreter's bf16 dot is wrong).

The one documented difference: a ``mean`` over no counted token (every target ignored) is 0 with
zero gradients, where torch gives NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import make_inputs

import flce
from flce.testing import reference_loss

HIDDEN, VOCAB, TOKENS = 16, 37, 12
BACKENDS = ["reference", pytest.param("cuda", marks=pytest.mark.triton)]


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" and torch.cuda.is_available() else "cpu"


def _counted(target: torch.Tensor) -> torch.Tensor:
    return target[target != -100]


def _mixed_signs_negative_sum(target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Weights of both signs whose sum over the counted targets is negative."""
    weight = torch.rand(VOCAB, generator=generator, dtype=torch.float64) * 2 - 1
    if weight[_counted(target)].sum() > 0:
        weight = -weight
    return weight


def _zero_on_used_classes(target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    weight = torch.rand(VOCAB, generator=generator, dtype=torch.float64) + 0.5
    weight[_counted(target)] = 0.0
    return weight


def _nan_on_a_used_class(target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    weight = torch.rand(VOCAB, generator=generator, dtype=torch.float64) + 0.5
    weight[_counted(target)[0]] = float("nan")
    return weight


def _nan_on_an_unused_class(target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    weight = torch.rand(VOCAB, generator=generator, dtype=torch.float64) + 0.5
    unused = [c for c in range(VOCAB) if c not in set(_counted(target).tolist())]
    weight[unused[0]] = float("nan")
    return weight


WEIGHT_CASES: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "all-negative": lambda _t, g: -(torch.rand(VOCAB, generator=g, dtype=torch.float64) + 0.5),
    "mixed-signs-negative-sum": _mixed_signs_negative_sum,
    "zero-sum": _zero_on_used_classes,
    "nan-on-a-used-class": _nan_on_a_used_class,
    "nan-on-an-unused-class": _nan_on_an_unused_class,
}


def _torch_loss_and_grads(hidden, lm_head, bias, target, **options):
    """F.cross_entropy on the materialised float64 logits, and its gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, lm_head, bias)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    loss = F.cross_entropy(logits, target, **options)
    upstream = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    return loss.detach(), torch.autograd.grad(loss, leaves, upstream), upstream


def _flce_loss_and_grads(fn, hidden, weight, bias, target, upstream, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = fn(leaves[0], leaves[1], target, leaves[2], **options)
    grads = torch.autograd.grad(loss, leaves, upstream.to(loss.dtype).to(loss.device))
    return loss.detach().double().cpu(), [g.double().cpu() for g in grads]


def _assert_same(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_class_weight_sums_match_torch(case: str, reduction: str, smoothing: float, backend: str,
                                       generator: torch.Generator) -> None:
    """A class-weighted mean divides by the counted targets' weight sum as torch does: a negative sum
    flips the sign, a zero sum gives inf or NaN, a NaN weight on a counted target gives NaN; a NaN
    weight elsewhere only reaches the loss through label smoothing."""
    device = _device(backend)
    hidden, weight, target, bias = make_inputs((TOKENS,), HIDDEN, VOCAB, bias=True, ignore_fraction=0.25,
                                               generator=generator)
    target[0] = 3  # at least one counted token
    class_weight = WEIGHT_CASES[case](target, generator)
    options = {"reduction": reduction, "label_smoothing": smoothing}
    want_loss, want_grads, upstream = _torch_loss_and_grads(hidden, weight, bias, target, weight=class_weight,
                                                            **options)
    on_device = [t.to(device) for t in (hidden, weight, bias, target)]
    loss, grads = _flce_loss_and_grads(
        lambda *a, **o: flce.linear_cross_entropy(*a, backend=backend, **o), *on_device, upstream,
        class_weight=class_weight.float().to(device), **options)
    _assert_same(loss, want_loss, "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
        _assert_same(g, w, f"grad {name}")
    oracle = reference_loss(hidden.double(), weight.double(), target, bias.double(), class_weight=class_weight,
                            **options).loss
    _assert_same(oracle, want_loss, "the float64 oracle's loss")


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_cancelling_to_a_zero_sum_give_torchs_infinity(backend: str, generator: torch.Generator) -> None:
    """Counted targets whose weights cancel (+1, -1): torch divides a non-zero sum by 0."""
    device = _device(backend)
    hidden, weight, _, bias = make_inputs((2,), HIDDEN, VOCAB, bias=True, generator=generator)
    target = torch.tensor([3, 5])
    class_weight = torch.rand(VOCAB, generator=generator, dtype=torch.float64) + 0.5
    class_weight[3], class_weight[5] = 1.0, -1.0
    want = F.cross_entropy(hidden.double() @ weight.double().T + bias.double(), target, weight=class_weight)
    got = flce.linear_cross_entropy(hidden.to(device), weight.to(device), target.to(device), bias.to(device),
                                    backend=backend, class_weight=class_weight.float().to(device))
    assert torch.isinf(want), want
    assert float(got) == float(want), (got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["all-negative", "zero-sum", "nan-on-a-used-class"])
def test_no_counted_token_still_gives_zero(case: str, backend: str, generator: torch.Generator) -> None:
    """The documented difference from torch: every target ignored -> mean 0 and zero gradients, whatever
    the class weights. (No label smoothing: with it a NaN weight reaches every row's gradient, as in torch,
    for every reduction.)"""
    device = _device(backend)
    hidden, weight, target, bias = make_inputs((TOKENS,), HIDDEN, VOCAB, bias=True, ignore_fraction=0.0,
                                               generator=generator)
    class_weight = WEIGHT_CASES[case](target, generator).float()
    ignored = torch.full_like(target, -100)
    loss, grads = _flce_loss_and_grads(
        lambda *a, **o: flce.linear_cross_entropy(*a, backend=backend, **o),
        *(t.to(device) for t in (hidden, weight, bias, ignored)), torch.rand((), dtype=torch.float64) + 0.5,
        class_weight=class_weight.to(device))
    assert float(loss) == 0.0
    for name, g in zip(("hidden", "weight", "bias"), grads, strict=True):
        assert torch.count_nonzero(g) == 0 and torch.isfinite(g).all(), f"grad {name} must be exactly 0"


# Where an infinity enters: (what, which tensor, index, value). A +inf logit makes torch's log_softmax
# NaN on its whole row (inf - inf); a -inf logit is a class of probability 0 (an infinite loss where it
# is the target); an inf in hidden or weight makes a row or a column of infinite logits of both signs.
INFINITIES = {
    "bias+inf": ("bias", (4,), float("inf")),
    "bias-inf": ("bias", (4,), -float("inf")),
    "hidden+inf": ("hidden", (2, 3), float("inf")),
    "weight+inf": ("weight", (4, 0), float("inf")),
    "weight-inf": ("weight", (4, 0), -float("inf")),
}
INF_OPTIONS = {
    "plain": {},
    # Not return_entropy: with a -inf logit its terms are 0 * -inf (docs/design.md, "The contract").
    "logprobs+temperature": {"return_logprobs": True, "temperature": 0.7},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 3.0},
}


def _torch_per_token(hidden, lm_head, bias, target, options, *, grad: bool):
    """torch's per-token losses on the float64 logits (flce's option semantics), and their gradients."""
    leaves = [t.detach().double().requires_grad_(grad) for t in (hidden, lm_head, bias)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    if options.get("softcap"):
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    logits = logits / options.get("temperature", 1.0)
    loss = F.cross_entropy(logits, target, reduction="none", label_smoothing=options.get("label_smoothing", 0.0))
    return loss.detach(), (torch.autograd.grad(loss.sum(), leaves) if grad else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("options", INF_OPTIONS, ids=INF_OPTIONS)
@pytest.mark.parametrize("where", INFINITIES)
def test_infinite_inputs_give_torchs_per_token_losses(where: str, options: str, grad: bool, backend: str,
                                                      generator: torch.Generator) -> None:
    """reduction="none": NaN exactly where torch's cross_entropy gives NaN, inf where it gives inf, and
    the finite tokens' losses; with gradients, torch's gradients (NaN where torch's are)."""
    device = _device(backend)
    hidden, weight, target, bias = make_inputs((6,), 8, 13, bias=True, ignore_fraction=0.0, generator=generator)
    target[1] = 4  # a token whose target is the class the infinity touches
    tensor, index, value = INFINITIES[where]
    {"hidden": hidden, "weight": weight, "bias": bias}[tensor][index] = value
    opts = INF_OPTIONS[options]
    want, want_grads = _torch_per_token(hidden, weight, bias, target, opts, grad=grad)
    leaves = [t.to(device).requires_grad_(grad) for t in (hidden, weight, bias)]
    out = flce.linear_cross_entropy(leaves[0], leaves[1], target.to(device), leaves[2], reduction="none",
                                    backend=backend, **opts)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    _assert_same(loss.detach().double().cpu(), want, "per-token loss")
    if grad:
        grads = torch.autograd.grad(loss.sum(), leaves)
        for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
            _assert_same(g.double().cpu(), w, f"grad {name}")
