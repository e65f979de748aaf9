"""Shared pieces of the linear distillation tests: random inputs of a case, flce's loss and gradients beside
the float64 oracle's (flce.testing.reference_distillation_loss), and the comparison at docs/design.md's
fp32 tolerance (1e-4 relative; the gradients by relative norm)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import flce
from flce.testing.distillation import reference_distillation_loss

NAMES = ("student_hidden", "student_weight", "student_bias", "teacher_hidden", "teacher_weight", "teacher_bias")


@dataclass
class Pair:
    """One case's tensors (leaves), in the order of NAMES, and the target."""

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    teacher_bias: torch.Tensor | None
    target: torch.Tensor | None

    @property
    def leaves(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, name) for name in NAMES)

    def detached(self, device: torch.device | str | None = None) -> Pair:
        """The same values as new leaves (requires_grad kept), optionally on another device."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.detach().to(device or t.device).requires_grad_(t.requires_grad)

        return Pair(*(copy(t) for t in self.leaves), None if self.target is None else self.target.to(device or "cpu"))


def make_pair(generator: torch.Generator, n: int = 13, student_size: int = 8, teacher_size: int = 12,
              vocab: int = 40, *, dtype: torch.dtype = torch.float32, bias: bool = False, target: bool = True,
              ignore_fraction: float = 0.25, ignore_index: int = -100, token_shape: tuple[int, ...] | None = None,
              teacher_requires_grad: bool = True, scale: float = 1.0) -> Pair:
    """Random inputs whose logits are O(scale) (the weights scaled by 1 / sqrt(H)), every tensor a leaf that
    requires grad (the teacher's too, unless told otherwise: the tests check it gets none unless asked)."""
    shape = token_shape or (n,)

    def leaf(*size: int, grad: bool = True, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * std).to(dtype).requires_grad_(grad)

    teacher_grad = teacher_requires_grad
    student_bias = leaf(vocab) if bias else None
    teacher_bias = leaf(vocab, grad=teacher_grad) if bias else None
    labels = None
    if target:
        labels = torch.randint(0, vocab, shape, generator=generator)
        labels[torch.rand(shape, generator=generator) < ignore_fraction] = ignore_index
    return Pair(leaf(*shape, student_size), leaf(vocab, student_size, std=scale / student_size**0.5), student_bias,
                leaf(*shape, teacher_size, grad=teacher_grad),
                leaf(vocab, teacher_size, grad=teacher_grad, std=scale / teacher_size**0.5), teacher_bias, labels)


def upstream_of(loss: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random upstream gradient of the loss's shape (not 1: the scaling paths are exercised)."""
    return (torch.rand(loss.shape, generator=generator, dtype=torch.float64) + 0.5).to(loss.device)


def gradients(loss: torch.Tensor, upstream: torch.Tensor, pair: Pair) -> list[torch.Tensor | None]:
    """d (loss * upstream).sum() / d each leaf that requires grad (None for the others and those unreached)."""
    leaves = [t for t in pair.leaves if t is not None and t.requires_grad]
    found = torch.autograd.grad((loss.double() * upstream).sum(), leaves, allow_unused=True)
    by_id = {id(t): g for t, g in zip(leaves, found, strict=True)}
    return [None if t is None else by_id.get(id(t)) for t in pair.leaves]


def oracle(pair: Pair, **options: object) -> torch.Tensor:
    """The float64 oracle of the case (options: the public keywords but backend / memory_budget / teacher_grad)."""
    math = {k: v for k, v in options.items() if k not in ("backend", "memory_budget", "teacher_grad",
                                                            "process_group")}
    return reference_distillation_loss(pair.student_hidden, pair.student_weight, pair.teacher_hidden,
                                       pair.teacher_weight, pair.target, student_bias=pair.student_bias,
                                       teacher_bias=pair.teacher_bias, **math)


def flce_loss(pair: Pair, **options: object) -> torch.Tensor:
    return flce.linear_distillation_loss(pair.student_hidden, pair.student_weight, pair.teacher_hidden,
                                         pair.teacher_weight, pair.target, student_bias=pair.student_bias,
                                         teacher_bias=pair.teacher_bias, **options)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 / 0 counts as 0)."""
    a, e = actual.double().cpu(), expected.double().cpu()
    denominator = e.norm().item()
    difference = (a - e).norm().item()
    return difference if denominator == 0 else difference / denominator


def assert_matches_oracle(pair: Pair, generator: torch.Generator, *, rtol: float = 1e-4,
                          run: Callable[..., torch.Tensor] = flce_loss, **options: object) -> None:
    """flce's loss and every gradient equal the oracle's (the teacher's only with teacher_grad=True; none
    reaches it otherwise)."""
    got = run(pair, **options)
    reference_pair = pair.detached("cpu")
    expected = oracle(reference_pair, **options)
    assert got.shape == expected.shape, f"loss shape {tuple(got.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (got.double().cpu() - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= rtol * max(scale, 1e-6), f"loss: max error {error:.3g} against a scale of {scale:.3g}"
    upstream = upstream_of(expected, generator)
    got_grads = gradients(got, upstream.to(got.device), pair)
    want = gradients(expected, upstream, reference_pair)
    teacher_grad = bool(options.get("teacher_grad"))
    for name, g, w, leaf in zip(NAMES, got_grads, want, pair.leaves, strict=True):
        if leaf is None or not leaf.requires_grad:
            continue
        if name.startswith("teacher") and not teacher_grad:
            assert g is None, f"{name}: took a gradient without teacher_grad=True"
            continue
        assert g is not None, f"{name}: no gradient"
        assert relative(g, w) <= rtol, f"{name}: relative error {relative(g, w):.3g} > {rtol}"


def eager_loss(pair: Pair, dtype: torch.dtype, loss: str,
               temperature: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The materialised formula in ``dtype`` (its log-softmax too; JSD at beta 0.5), as a user's eager PyTorch would
    run it: the error flce must stay within; the mean over the counted rows, and its gradients of the student's
    hidden states and weight."""
    xs = pair.student_hidden.detach().to(dtype).requires_grad_()
    ws = pair.student_weight.detach().to(dtype).requires_grad_()
    xt, wt = pair.teacher_hidden.detach().to(dtype), pair.teacher_weight.detach().to(dtype)
    log_q = torch.log_softmax(xs @ ws.T / temperature, dim=-1)
    log_p = torch.log_softmax(xt @ wt.T / temperature, dim=-1)
    if loss == "forward_kl":
        rows = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif loss == "reverse_kl":
        rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        half = torch.tensor(0.5, dtype=dtype, device=xs.device).log()
        log_m = torch.logaddexp(log_p + half, log_q + half)
        rows = 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)
    valid = pair.target != -100
    mean = torch.where(valid, rows.float(), 0.0).sum() / valid.sum()
    return mean, torch.autograd.grad(mean, (xs, ws))
