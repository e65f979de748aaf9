"""``detach_extras=True``: the log-probs, the entropy and the selected log-probs come back detached, so that a
mean or sum loss keeps the schedules that compute its gradients in forward (no deferred backward, no kept logits)
while a trainer still logs them. Against the float64 oracle through both in-forward schedules; the public call
runs no deferred backward with the option and does without it; the compiled call; explain's ``gradients:`` line;
the CUDA backend in the interpreter and, marked ``cuda``, on a GPU."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from helpers import OPTION_CASES, lm_head_inputs, make_inputs, materialise_options, random_class_weight, reference_loss

import flce
from flce.backends.reference.kernels import ReferenceKernels
from flce.config import LCEConfig
from flce.engine import token_chunks, vocab_blocks
from flce.engine.call import EngineCall
from flce.engine.function import apply_eager
from flce.engine.plans import CUBLAS, AllRows, TokenChunks, VocabBlocks
from flce.inputs import check_token_weights, prepare_inputs

# The two schedules that compute the gradients in forward: token chunks (several of them) and vocabulary blocks.
IN_FORWARD_PLANS = {
    "token-chunks": TokenChunks(4),
    "vocab-blocks": VocabBlocks(grad_vocab_block=5, stats=AllRows(forward_stats=CUBLAS, scan_block=5)),
}
EXTRAS = {"return_logprobs": True, "return_entropy": True, "detach_extras": True}
OPTION_SETS = {
    "extras-only": {},
    "rl-objective": {"entropy_weight": 0.01, "temperature": 0.7, "token_weights": "random"},
    "every-loss-term": {"entropy_weight": -0.05, "label_smoothing": 0.1, "lse_square_scale": 0.02,
                        "class_weight": "random", "token_scaling": True, "softcap": 3.0},
}


def _leaves(generator: torch.Generator, vocab: int = 17):
    hidden, weight, target, bias = make_inputs((3, 5), 6, vocab, dtype=torch.float64, bias=True,
                                               generator=generator)
    return [t.requires_grad_() for t in (hidden, weight, bias)], target


def _options(name: str, shape: torch.Size, vocab: int, generator: torch.Generator, **extra: Any) -> dict[str, Any]:
    options = dict(OPTION_SETS[name], **extra)
    if options.get("class_weight") == "random":
        options["class_weight"] = random_class_weight(vocab, generator, torch.float64)
    if options.get("token_weights") == "random":  # advantages: either sign
        options["token_weights"] = torch.randn(shape, generator=generator, dtype=torch.float64)
    return options


def _oracle(leaves: list[torch.Tensor], target: torch.Tensor, options: dict[str, Any]):
    """The float64 oracle's outputs and the gradients of its loss alone."""
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    out = reference_loss(fresh[0], fresh[1], target, fresh[2], **options)
    return out, torch.autograd.grad(out.loss, fresh)


def _assert_close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def _refuse_deferred_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any deferred backward: what the option promises is that the gradients were computed in forward."""
    def refuse(*_args: object, **_kwargs: object):
        raise AssertionError("a deferred backward ran: the gradients were not computed in forward")

    for module in (token_chunks, vocab_blocks):
        monkeypatch.setattr(module, "backward", refuse)


@pytest.fixture
def no_deferred_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_deferred_backward(monkeypatch)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options_name", sorted(OPTION_SETS))
@pytest.mark.parametrize("plan", IN_FORWARD_PLANS.values(), ids=IN_FORWARD_PLANS.keys())
def test_in_forward_schedules_match_the_oracle(plan: object, options_name: str, reduction: str,
                                               generator: torch.Generator, no_deferred_backward: None) -> None:
    leaves, target = _leaves(generator)
    options = _options(options_name, target.shape, 17, generator, reduction=reduction)
    token_weights = options.pop("token_weights", None)
    hidden, weight, bias = leaves
    cfg = LCEConfig(**options, **EXTRAS)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    if token_weights is not None:
        flat = dataclasses.replace(flat, token_weight=check_token_weights(token_weights, flat))
    call = EngineCall(kernels=ReferenceKernels(), cfg=cfg, plan=plan, plain=False, token_shape=flat.token_shape)
    out = apply_eager(flat, call)
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    upstream = torch.rand((), generator=generator, dtype=torch.float64) + 0.5
    got = torch.autograd.grad(out.loss, leaves, upstream)

    want_out, want = _oracle(leaves, target, dict(options, token_weights=token_weights))
    for name in ("loss", "logprobs", "entropy"):
        _assert_close(getattr(out, name), getattr(want_out, name).detach(), name)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, upstream * w, f"grad {name}")


def _public_call(form: str, leaves: list[torch.Tensor], target: torch.Tensor, options: dict[str, Any]):
    options = dict(options)
    token_weights = options.pop("token_weights", None)
    hidden, weight, bias = leaves
    if form == "functional":
        return flce.linear_cross_entropy(hidden, weight, target, bias, token_weights=token_weights, **options)
    return flce.get_impl("cpu")(**options)(hidden, weight, target, bias, token_weights=token_weights)


@pytest.mark.parametrize("form", ["functional", "module"])
def test_the_public_call_computes_the_gradients_in_forward(form: str, generator: torch.Generator,
                                                           no_deferred_backward: None) -> None:
    """Several chunks (a small memory budget) and the RL objective: values, detached extras, the loss's
    gradients; the fixture fails the test if backward recomputes anything."""
    leaves, target = _leaves(generator)
    options = _options("rl-objective", target.shape, 17, generator, memory_budget=300, **EXTRAS)
    out = _public_call(form, leaves, target, options)
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    assert out.logprobs.grad_fn is None and out.entropy.grad_fn is None
    got = torch.autograd.grad(out.loss, leaves)
    want_out, want = _oracle(leaves, target, options)
    for name in ("loss", "logprobs", "entropy"):
        _assert_close(getattr(out, name), getattr(want_out, name).detach(), f"{form} {name}")
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, w, f"{form} grad {name}")


def test_without_the_option_the_extras_keep_the_gradients_in_backward(generator: torch.Generator,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast: differentiable log-probs make the same call defer its gradients to backward."""
    deferred = []
    real_backward = token_chunks.backward

    def counted(*args: object):
        deferred.append(1)
        return real_backward(*args)

    monkeypatch.setattr(token_chunks, "backward", counted)
    leaves, target = _leaves(generator)
    out = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], return_logprobs=True, return_entropy=True)
    assert out.logprobs.requires_grad and out.entropy.requires_grad
    torch.autograd.grad(out.loss, leaves)
    assert deferred == [1]


def test_reduction_none_detaches_the_extras_and_defers(generator: torch.Generator) -> None:
    """Per-token losses have per-token upstream gradients: still computed in backward, the extras detached."""
    leaves, target = _leaves(generator)
    options = {"reduction": "none", "temperature": 0.8}
    out = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], **options, **EXTRAS)
    assert out.loss.requires_grad
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    upstream = torch.randn(target.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(out.loss, leaves, upstream)
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    want_out = reference_loss(fresh[0], fresh[1], target, fresh[2], **options)
    want = torch.autograd.grad(want_out.loss, fresh, upstream)
    _assert_close(out.loss, want_out.loss.detach(), "loss")
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, w, f"grad {name}")


def test_selected_logprobs_come_back_detached(generator: torch.Generator, no_deferred_backward: None) -> None:
    """Selected log-probs composed from detached log-probs are detached whole (with grad on they would carry the
    dot products' gradient without the lse's); their values are those of a call without the option."""
    leaves, target = _leaves(generator)
    ids = torch.randint(0, 17, (*target.shape, 4), generator=generator)
    detached = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], selected_ids=ids, detach_extras=True)
    assert not detached.selected_logprobs.requires_grad and detached.logprobs is None
    with torch.no_grad():
        plain = flce.linear_cross_entropy(*leaves[:2], target, leaves[2], selected_ids=ids)
    _assert_close(detached.selected_logprobs, plain.selected_logprobs, "selected log-probs")
    _assert_close(detached.loss, plain.loss, "loss")
    torch.autograd.grad(detached.loss, leaves)  # in forward: the fixture fails a deferred backward


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(o) or "plain")
def test_the_option_changes_no_value(options: dict[str, Any], reduction: str, generator: torch.Generator) -> None:
    """Every option case of the contract tests, every reduction, float64: the same outputs and the same gradients
    of the loss (to rounding: with the option they may be computed in forward, without it in backward)."""
    leaves, target = _leaves(generator)
    options = materialise_options(dict(options, reduction=reduction, return_logprobs=True), 17, "cpu")
    upstream = torch.randn(target.shape if reduction == "none" else (), generator=generator, dtype=torch.float64)
    results = {}
    for detach in (False, True):
        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        out = flce.linear_cross_entropy(*fresh[:2], target, fresh[2], detach_extras=detach, **options)
        results[detach] = out, torch.autograd.grad(out.loss, fresh, upstream)
    (kept, kept_grads), (detached, detached_grads) = results[False], results[True]
    for name in flce.LCEOutput._fields:
        got, want = getattr(detached, name), getattr(kept, name)
        assert (got is None) == (want is None), f"{name}: present/absent differs"
        if got is not None:
            _assert_close(got, want.detach(), name)
            differentiable = want.requires_grad and name not in ("logprobs", "entropy", "selected_logprobs")
            assert got.requires_grad == differentiable, f"{name}: requires_grad {got.requires_grad}"
    for name, g, w in zip(("hidden", "weight", "bias"), detached_grads, kept_grads, strict=True):
        _assert_close(g, w, f"grad {name}")


def test_the_option_is_a_bool() -> None:
    with pytest.raises(TypeError, match="detach_extras=1: expected a bool"):
        LCEConfig(detach_extras=1)


def test_the_compiled_call_runs_one_forward_op_and_returns_detached_extras(generator: torch.Generator) -> None:
    leaves, target = _leaves(generator)
    options = {"entropy_weight": 0.01, "temperature": 0.7, **EXTRAS}

    def step(hidden, weight, target, bias):
        return flce.linear_cross_entropy(hidden, weight, target, bias, **options)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in leaves)
    out = torch.compile(step, backend=counter, fullgraph=True)(hidden, weight, target, bias)
    assert counter.frame_count == 1
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    got = torch.autograd.grad(out.loss, (hidden, weight, bias))
    want_out, want = _oracle(leaves, target, options)
    for name in ("loss", "logprobs", "entropy"):
        _assert_close(getattr(out, name), getattr(want_out, name).detach(), f"compiled {name}")
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        _assert_close(g, w, f"compiled grad {name}")


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_explain_says_when_the_gradients_are_computed(device: str) -> None:
    def gradients(**options: Any) -> str:
        record = flce.explain(device, shape="4096x1024x32000", dtype="float32" if device == "cpu" else "bfloat16",
                              **options)
        (line,) = [line for line in record.lines() if line.startswith("gradients:")]
        return line

    assert gradients().startswith("gradients: in forward")
    assert gradients(training=False) == "gradients: none (no gradient follows)"
    assert gradients(reduction="none").startswith("gradients: in backward (reduction='none'")
    extras = gradients(return_logprobs=True, return_entropy=True)
    assert extras.startswith("gradients: in backward") and "detach_extras=True" in extras
    assert gradients(return_logprobs=True, return_entropy=True, detach_extras=True).startswith("gradients: in forward")


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_detached_extras_plan_the_objectives_own_work(gpu: str) -> None:
    """On Hopper at an RL shape, the objective with detached log-probs and entropy plans exactly the kernels,
    schedule and memory of the objective alone (the extras come from the row statistics its chunks compute)."""
    objective = {"temperature": 0.7, "entropy_weight": 0.01}
    alone = flce.explain("cuda", gpu=gpu, shape="16384x4096x151936", **objective)
    logged = flce.explain("cuda", gpu=gpu, shape="16384x4096x151936", **objective, **EXTRAS)
    assert (logged.plan, logged.gradients, logged.memory, logged.steps) == (
        alone.plan, alone.gradients, alone.memory, alone.steps)
    assert logged.gradients.startswith("in forward")


def _check_cuda_backend(device: str, n: int, h: int, v: int, budget: int | None = None) -> None:
    """The CUDA backend in fp32 with the RL objective and detached extras against the float64 oracle."""
    x, w, _, t = lm_head_inputs(n, h, v, torch.float32, device, with_bias=False)
    advantages = torch.randn(n, device=device)
    options = {"entropy_weight": 0.01, "temperature": 0.7, "memory_budget": budget, **EXTRAS}
    out = flce.linear_cross_entropy(x, w, t, backend="cuda", token_weights=advantages, **options)
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    got = torch.autograd.grad(out.loss, (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want_out = reference_loss(xd, wd, t, token_weights=advantages.double(), **options)
    want = torch.autograd.grad(want_out.loss, (xd, wd))
    for name in ("loss", "logprobs", "entropy"):
        torch.testing.assert_close(getattr(out, name).double(), getattr(want_out, name).detach(), rtol=1e-5,
                                   atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    for name, g, r in zip(("hidden", "weight"), got, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=5e-5, atol=5e-5, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreter test: runs where there is no GPU")
def test_cuda_backend_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 64)  # several blocks and a ragged tail
    _refuse_deferred_backward(monkeypatch)
    _check_cuda_backend("cpu", 12, 16, 203)


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, 64 << 20], ids=["default", "64MiB"])
def test_gpu_detached_extras_match_the_oracle(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 at V = 32001 (no multiple of any block): the in-forward chunk loop and, in 64 MiB, the vocabulary
    blocks; a deferred backward fails the test."""
    _refuse_deferred_backward(monkeypatch)
    _check_cuda_backend("cuda", 257, 128, 32001, budget)
