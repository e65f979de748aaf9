"""An RL objective handed to the call: ``token_weights`` (per-token multipliers of the cross-entropy, e.g.
advantages) and ``entropy_weight`` (an entropy term in the loss), on the reference backend against the float64
oracle, through every schedule of the engine; the same numbers as the objective composed from the call's
log-probs and entropy; the input checks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers import lm_head_inputs, make_inputs, random_class_weight, reference_loss

import flce
from flce.backends.reference.kernels import ReferenceKernels
from flce.config import LCEConfig
from flce.engine.call import EngineCall
from flce.engine.function import apply_eager
from flce.engine.plans import CUBLAS, AllRows, TokenChunks, VocabBlocks
from flce.inputs import check_token_weights, prepare_inputs
from flce.testing.measure import relative_difference

REDUCTIONS = ("mean", "sum", "none")
# Gradients in forward by token chunks (several chunks) or by vocabulary blocks (mean, sum); deferred with
# recomputed or kept logits (none).
PLANS = {
    "token-chunks": TokenChunks(4),
    "token-chunks-kept-logits": TokenChunks(4, saved_rows=8),
    "vocab-blocks": VocabBlocks(grad_vocab_block=5, stats=AllRows(forward_stats=CUBLAS, scan_block=5)),
}
OPTION_SETS = {
    "weights": {},
    "weights-entropy": {"entropy_weight": 0.1},
    "rl": {"entropy_weight": 0.01, "temperature": 0.7},
    "entropy-penalty-softcap": {"entropy_weight": -0.2, "softcap": 3.0},
    "with-every-loss-term": {"entropy_weight": 0.05, "label_smoothing": 0.1, "lse_square_scale": 0.02,
                             "class_weight": "random", "token_scaling": True},
}


def _options(name: str, vocab: int, generator: torch.Generator, **extra: Any) -> dict[str, Any]:
    options = dict(OPTION_SETS[name], **extra)
    if options.get("class_weight") == "random":
        options["class_weight"] = random_class_weight(vocab, generator, torch.float64)
    return options


def _leaves(generator: torch.Generator, vocab: int = 17):
    hidden, weight, target, bias = make_inputs((3, 5), 6, vocab, dtype=torch.float64, bias=True,
                                               generator=generator)
    advantages = torch.randn(target.shape, generator=generator, dtype=torch.float64)  # either sign
    return [t.requires_grad_() for t in (hidden, weight, bias)], target, advantages


def _planned_loss(plan: object, leaves: list[torch.Tensor], target: torch.Tensor, token_weights: torch.Tensor,
                  options: dict[str, Any]):
    """The eager Function over the reference kernels with ``plan`` (the public API plans token chunks on the
    CPU; this reaches the other schedules too)."""
    hidden, weight, bias = leaves
    cfg = LCEConfig(**options)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    flat = dataclasses.replace(flat, token_weight=check_token_weights(token_weights, flat))
    call = EngineCall(kernels=ReferenceKernels(), cfg=cfg, plan=plan, plain=False, token_shape=flat.token_shape)
    return apply_eager(flat, call)


def _oracle(leaves: list[torch.Tensor], target: torch.Tensor, token_weights: torch.Tensor,
            options: dict[str, Any], upstream: torch.Tensor | None = None):
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    out = reference_loss(fresh[0], fresh[1], target, fresh[2], token_weights=token_weights, **options)
    grads = torch.autograd.grad(out.loss, fresh, upstream)
    return out, grads


def _assert_close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options_name", sorted(OPTION_SETS))
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_every_schedule_matches_the_oracle(plan: object, options_name: str, reduction: str,
                                           generator: torch.Generator) -> None:
    leaves, target, advantages = _leaves(generator)
    options = _options(options_name, 17, generator, reduction=reduction)
    loss = _planned_loss(plan, leaves, target, advantages, options)
    upstream = torch.randn(loss.shape, generator=generator, dtype=torch.float64) + 0.5
    got = torch.autograd.grad(loss, leaves, upstream)
    want_out, want = _oracle(leaves, target, advantages, options, upstream)
    _assert_close(loss, want_out.loss.detach(), "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, w, f"grad {name}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_public_call_matches_the_oracle_with_extras(reduction: str, generator: torch.Generator) -> None:
    """Through flce.linear_cross_entropy and the module, with differentiable log-probs and entropy beside the
    loss (the deferred path): each output and the gradients of a mix of them."""
    leaves, target, advantages = _leaves(generator)
    options = _options("rl", 17, generator, reduction=reduction)
    for form in ("functional", "module"):
        hidden, weight, bias = (t.detach().clone().requires_grad_() for t in leaves)
        if form == "functional":
            out = flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=advantages,
                                            return_logprobs=True, return_entropy=True, **options)
        else:
            module = flce.get_impl("cpu")(return_logprobs=True, return_entropy=True, **options)
            out = module(hidden, weight, target, bias, token_weights=advantages)
        upstream = [torch.randn(t.shape, generator=generator, dtype=torch.float64) + 0.5
                    for t in (out.loss, out.logprobs, out.entropy)]
        surrogate = sum((t * u).sum() for t, u in zip((out.loss, out.logprobs, out.entropy), upstream, strict=True))
        got = torch.autograd.grad(surrogate, (hidden, weight, bias))

        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        want_out = reference_loss(fresh[0], fresh[1], target, fresh[2], token_weights=advantages, **options)
        for name in ("loss", "logprobs", "entropy"):
            _assert_close(getattr(out, name), getattr(want_out, name).detach(), f"{form} {name}")
        want_surrogate = sum((t * u).sum() for t, u in zip(
            (want_out.loss, want_out.logprobs, want_out.entropy), upstream, strict=True))
        want = torch.autograd.grad(want_surrogate, fresh)
        for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
            _assert_close(g, w, f"{form} grad {name}")


def test_the_objective_equals_its_composition_from_logprobs_and_entropy(generator: torch.Generator) -> None:
    """``-(adv * logp).mean() - beta * entropy.mean()`` over the counted tokens, as RL trainers write it from the
    call's log-probs and entropy, is the call with token_weights=adv, entropy_weight=beta: loss and gradients."""
    leaves, target, advantages = _leaves(generator, vocab=29)
    beta, temperature = 0.01, 0.7
    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in leaves)
    out = flce.linear_cross_entropy(hidden, weight, target, bias, reduction="none", temperature=temperature,
                                    return_logprobs=True, return_entropy=True)
    counted = (target != -100).sum()
    composed = (-(advantages * out.logprobs).sum() - beta * out.entropy.sum()) / counted
    composed_grads = torch.autograd.grad(composed, (hidden, weight, bias))

    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in leaves)
    loss = flce.linear_cross_entropy(hidden, weight, target, bias, temperature=temperature,
                                     token_weights=advantages, entropy_weight=beta)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    _assert_close(loss, composed, "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), grads, composed_grads, strict=True):
        _assert_close(g, w, f"grad {name}")


def test_gradcheck_in_float64(generator: torch.Generator) -> None:
    leaves, target, advantages = _leaves(generator, vocab=7)

    def loss(hidden, weight, bias):
        return flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=advantages,
                                         entropy_weight=0.3, temperature=0.9, memory_budget=300)

    assert torch.autograd.gradcheck(loss, tuple(leaves))


def test_batch_invariant_calls_pad_the_weights(generator: torch.Generator) -> None:
    leaves, target, advantages = _leaves(generator)
    options = {"entropy_weight": 0.1, "reduction": "sum"}
    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in leaves)
    loss = flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=advantages, batch_invariant=True,
                                     **options)
    got = torch.autograd.grad(loss, (hidden, weight, bias))
    want_out, want = _oracle(leaves, target, advantages, options)
    _assert_close(loss, want_out.loss.detach(), "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, w, f"grad {name}")


def test_unit_weights_and_no_entropy_term_are_the_plain_loss(generator: torch.Generator) -> None:
    leaves, target, _ = _leaves(generator)
    hidden, weight, bias = (t.detach() for t in leaves)
    plain = flce.linear_cross_entropy(hidden, weight, target, bias)
    weighted = flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=torch.ones(target.shape,
                                                                                                 dtype=torch.float64))
    _assert_close(weighted, plain, "loss")


def test_token_weights_are_checked(generator: torch.Generator) -> None:
    leaves, target, advantages = _leaves(generator)
    hidden, weight, bias = (t.detach() for t in leaves)

    def call(token_weights, **options):
        return flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=token_weights, **options)

    with pytest.raises(ValueError, match=r"token_weights: has shape \(15,\); expected the target's shape \(3, 5\)"):
        call(advantages.reshape(-1))
    with pytest.raises(TypeError, match="token_weights: expected a floating-point tensor, got dtype torch.int64"):
        call(torch.ones(target.shape, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_weights: expected a torch.Tensor or None, got list"):
        call([1.0] * 15)
    with pytest.raises(ValueError, match=r"token_weights requires grad.*pass token_weights.detach\(\)"):
        call(advantages.clone().requires_grad_())
    with pytest.raises(ValueError, match="token_weights is on meta but target is on cpu"):
        call(torch.empty(target.shape, device="meta"))
    with pytest.raises(ValueError, match="variant='plain' cannot serve token_weights"):
        call(advantages, variant="plain")
    with pytest.raises(ValueError, match="variant='plain' cannot serve entropy_weight"):
        flce.linear_cross_entropy(hidden, weight, target, bias, variant="plain", entropy_weight=0.1)
    with pytest.raises(TypeError, match="entropy_weight=nan: expected a finite real number"):
        flce.linear_cross_entropy(hidden, weight, target, bias, entropy_weight=float("nan"))


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_objective_case(n: int, h: int, v: int, dtype: torch.dtype, **options: Any):
    x, w, b, t = lm_head_inputs(n, h, v, dtype, "cuda", with_bias=dtype == torch.float32)
    advantages = torch.randn(n, device="cuda")  # either sign, as RL advantages
    return [a for a in (x, w, b) if a is not None], t, advantages


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, 64 << 20], ids=["default", "64MiB"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_objective_fp32_matches_the_oracle(reduction: str, budget: int | None) -> None:
    """The CUDA backend's chunk loop (gradients in forward) and, in 64 MiB, its vocabulary blocks; V = 32001 is no
    multiple of any block."""
    options = {"entropy_weight": 0.01, "temperature": 0.7, "reduction": reduction, "memory_budget": budget}
    leaves, target, advantages = _gpu_objective_case(257, 128, 32001, torch.float32)
    loss = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], backend="cuda", token_weights=advantages,
                                     **options)
    upstream = torch.randn(loss.shape, device="cuda", dtype=torch.float64) + 0.5
    got = torch.autograd.grad(loss, leaves, upstream.float())
    fresh = [a.detach().double().requires_grad_() for a in leaves]
    want = reference_loss(fresh[0], fresh[1], target, fresh[2], token_weights=advantages.double(), **options).loss
    want_grads = torch.autograd.grad(want, fresh, upstream)
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want_grads, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=5e-5, atol=5e-5, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_gpu_bf16_objective_within_eager_error(vocab: int) -> None:
    """bf16 gradients of the objective in the call within 1.5x of eager PyTorch's (bf16 logits, the objective
    composed in fp32) against float64."""
    beta, temperature = 0.01, 0.7
    (x, w), target, advantages = _gpu_objective_case(2048, 1024, vocab, torch.bfloat16)
    loss = flce.linear_cross_entropy(x, w, target, token_weights=advantages, entropy_weight=beta,
                                     temperature=temperature)
    gx, gw = torch.autograd.grad(loss, (x, w))

    def composed(hidden, weight):
        logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
        logp = torch.log_softmax(logits, dim=-1)
        counted = target != -100
        safe = torch.where(counted, target, 0)
        token_logp = logp.gather(1, safe[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return (-(advantages.to(logp.dtype) * token_logp + beta * entropy) * counted).sum() / counted.sum()

    ex, ew = torch.autograd.grad(composed(x, w), (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = composed(xd, wd)
    rx, rw = torch.autograd.grad(ref, (xd, wd))
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-2, atol=2e-2)
    assert relative_difference(gx, rx) <= 1.5 * relative_difference(ex, rx) + 1e-6
    assert relative_difference(gw, rw) <= 1.5 * relative_difference(ew, rw) + 1e-6


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_token_ignored_gives_zeros(reduction: str, generator: torch.Generator) -> None:
    """As for the plain loss: a call whose tokens are all ignored returns 0 and gives zero gradients (torch's mean
    would be nan), the entropy term and the token weights included."""
    leaves, target, advantages = _leaves(generator)
    target = torch.full_like(target, -100)
    loss = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], token_weights=advantages, entropy_weight=0.1,
                                     temperature=0.7, reduction=reduction)
    grads = torch.autograd.grad(loss.sum(), leaves)
    assert not loss.detach().any()
    assert not any(g.any() for g in grads)


def test_logits_of_ten_thousand_match_the_oracle(generator: torch.Generator) -> None:
    """Logits of about +-1e4 (a peaked softmax, entropies near 0): the objective's loss and gradients stay finite
    and equal the float64 oracle's."""
    leaves, target, advantages = _leaves(generator)
    with torch.no_grad():
        leaves[0].mul_(2e3)  # |z| up to ~1e4
    options = {"entropy_weight": 0.05, "temperature": 0.9}
    loss = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], token_weights=advantages, **options)
    got = torch.autograd.grad(loss, leaves)
    want_out, want = _oracle(leaves, target, advantages, options)
    logits = leaves[0].detach() @ leaves[1].detach().t() + leaves[2].detach()
    assert float(logits.abs().max()) > 5e3, "the logits should reach thousands"
    torch.testing.assert_close(loss, want_out.loss.detach(), rtol=1e-9, atol=1e-7)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-7, msg=lambda m, name=name: f"grad {name}: {m}")
