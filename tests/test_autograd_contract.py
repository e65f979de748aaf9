"""Autograd beyond one backward, on the reference backend (CPU) against the float64 oracle: a
retained graph's second backward with torch's semantics, torch.autograd.gradcheck in float64 for
every reduction and option (batched gradients included), batched gradients (is_grads_batched) and
torch.func's jacrev and grad."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from helpers import lm_head_inputs, make_inputs, nested_second_derivatives, random_class_weight, reference_loss

import flce
from flce.backends.reference.kernels import ReferenceKernels
from flce.config import LCEConfig
from flce.engine import function as eager_function
from flce.engine.call import EngineCall
from flce.engine.function import apply_eager
from flce.engine.plans import CUBLAS, AllRows, TokenChunks, VocabBlocks
from flce.inputs import prepare_inputs

REDUCTIONS = ("mean", "sum", "none")
# Every plan shape of the engine: gradients in forward by token chunks or by vocabulary blocks
# (mean, sum), deferred with recomputed or kept logits (none).
PLANS = {
    "token-chunks": TokenChunks(4),
    "token-chunks-kept-logits": TokenChunks(4, saved_rows=8),
    "vocab-blocks": VocabBlocks(grad_vocab_block=5, stats=AllRows(forward_stats=CUBLAS, scan_block=5)),
}
FULL_OPTIONS = {"label_smoothing": 0.1, "lse_square_scale": 0.02, "softcap": 4.0, "temperature": 0.8,
                "class_weight": "random"}


def _options(case: dict[str, Any], vocab: int, generator: torch.Generator, **extra: Any) -> dict[str, Any]:
    options = dict(case, **extra)
    if options.get("class_weight") == "random":
        options["class_weight"] = random_class_weight(vocab, generator, torch.float64)
    return options


def _eager_loss(plan: object, leaves: list[torch.Tensor], target: torch.Tensor, options: dict[str, Any]):
    """The eager Function over reference kernels with the given plan (the public API always plans
    token chunks on the CPU; this reaches the other schedules too)."""
    hidden, weight, bias = leaves
    cfg = LCEConfig(**options)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    call = EngineCall(kernels=ReferenceKernels(), cfg=cfg, plan=plan, plain=False, token_shape=flat.token_shape)
    return apply_eager(flat, call)


def _oracle_grads(leaves: list[torch.Tensor], target: torch.Tensor, options: dict[str, Any],
                  upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    loss = reference_loss(fresh[0], fresh[1], target, fresh[2], **options).loss
    return torch.autograd.grad(loss, fresh, upstream)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_retained_graph_backward_twice_matches_the_oracle(plan: object, reduction: str,
                                                          generator: torch.Generator) -> None:
    """backward(retain_graph=True), then a second backward with another grad_output, then
    .backward() accumulating into .grad: each equals float64 autograd through the oracle."""
    hidden, weight, target, bias = make_inputs((3, 4), 6, 17, dtype=torch.float64, bias=True, generator=generator)
    options = _options(FULL_OPTIONS, 17, generator, reduction=reduction)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    loss = _eager_loss(plan, leaves, target, options)
    upstreams = [torch.randn(loss.shape, generator=generator, dtype=torch.float64) + 0.5 for _ in range(2)]
    first = torch.autograd.grad(loss, leaves, upstreams[0], retain_graph=True)
    second = torch.autograd.grad(loss, leaves, upstreams[1], retain_graph=True)
    for upstream, got in ((upstreams[0], first), (upstreams[1], second)):
        want = _oracle_grads(leaves, target, options, upstream)
        for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"grad {name}: {m}")
    loss.backward(upstreams[0], retain_graph=True)
    loss.backward(upstreams[0])
    for name, leaf, w in zip(("hidden", "weight", "bias"), leaves, first, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * w, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, name=name: f"accumulated grad {name}: {m}")
    with pytest.raises(RuntimeError, match="(?i)backward through .* a second time"):
        loss.backward(upstreams[0])


def _flce_cycles_left_by(step) -> list[str]:
    """The flce objects (and autograd nodes of flce's Functions) the step leaves that only Python's cycle
    collector can free. Other libraries' garbage (a compiler's, another thread's) is not counted."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return [type(o).__qualname__ for o in gc.garbage
                if type(o).__module__.startswith("flce") or type(o).__name__.startswith("LCEFunction")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "no-backward"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_a_call_leaves_no_reference_cycle(plan: object, reduction: str, backward: bool,
                                          generator: torch.Generator) -> None:
    """A call's state (kept logits, in-forward gradients, row statistics) is freed by reference
    counting as soon as the loss and its graph go, with or without a backward: nothing waits for the
    cycle collector (an output kept on its own ctx did, and held a chunk of logits or the gradients
    into the next step at random)."""
    hidden, weight, target, bias = make_inputs((3, 4), 6, 17, dtype=torch.float64, bias=True, generator=generator)
    options = _options(FULL_OPTIONS, 17, generator, reduction=reduction,
                       return_logprobs=reduction == "none", return_entropy=reduction == "none")
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]

    def step():
        out = _eager_loss(plan, leaves, target, options)
        loss = out.loss if isinstance(out, flce.LCEOutput) else out
        if backward:
            torch.autograd.grad(loss.sum(), leaves)

    assert _flce_cycles_left_by(step) == []


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_single_backward_scales_the_in_forward_gradients_in_place(reduction: str, monkeypatch: pytest.MonkeyPatch,
                                                                  generator: torch.Generator) -> None:
    """The common call keeps no input for backward and hands out the buffers forward computed,
    scaled in place (no V x H allocation); a retaining backward leaves them unscaled for the next."""
    produced = []
    real_run_forward = eager_function.run_forward

    def recording_run_forward(*args, **kwargs):
        state = real_run_forward(*args, **kwargs)
        produced.append((state.grads[:2], tuple(g.clone() for g in state.grads[:2])))  # no bias here
        return state

    monkeypatch.setattr(eager_function, "run_forward", recording_run_forward)
    hidden, weight, target, _ = make_inputs((7,), 6, 17, generator=generator)
    leaves = [hidden.requires_grad_(), weight.requires_grad_()]
    for retain in (False, True):
        produced.clear()
        loss = flce.linear_cross_entropy(*leaves, target, reduction=reduction)
        assert loss.grad_fn.saved_tensors == (), "the in-forward schedule should keep no input for backward"
        grads = torch.autograd.grad(loss, leaves, torch.tensor(2.5), retain_graph=retain)
        (buffers, unscaled), = produced
        for name, got, buffer, before in zip(("hidden", "weight"), grads, buffers, unscaled, strict=True):
            if retain:
                assert got.data_ptr() != buffer.data_ptr(), f"grad {name}: a retained graph's gradients were handed out"
                torch.testing.assert_close(buffer, before, rtol=0, atol=0)
            else:
                assert got.data_ptr() == buffer.data_ptr(), f"grad {name}: scaled into a new buffer"
            torch.testing.assert_close(got, 2.5 * before, rtol=1e-6, atol=1e-7)


# gradcheck differentiates numerically: every option whose gradient is the true derivative. Token
# scaling multiplies by a detached probability (docs/design.md), so its gradient is not the derivative
# of the loss; test_token_scaling_jacobian_matches_the_oracle checks it instead.
GRADCHECK_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ignore_index_inside_vocab": {"ignore_index": 2},
    "label_smoothing": {"label_smoothing": 0.1},
    "lse_square_scale": {"lse_square_scale": 0.05},
    "softcap": {"softcap": 2.0},
    "class_weight": {"class_weight": "random"},
    "smoothing_with_class_weight": {"label_smoothing": 0.2, "class_weight": "random"},
    "temperature": {"temperature": 0.7},
    "logprobs": {"return_logprobs": True},
    "entropy": {"return_entropy": True},
    "everything": {"label_smoothing": 0.1, "lse_square_scale": 0.02, "softcap": 3.0, "class_weight": "random",
                   "temperature": 1.3, "ignore_index": 2, "return_logprobs": True, "return_entropy": True,
                   "return_z_loss": True, "return_token_accuracy": True, "return_predicted_tokens": True},
}


def _differentiable_outputs(target: torch.Tensor, options: dict[str, Any]):
    """hidden, weight, bias -> the loss and, where asked, the log-probs and entropy."""
    def outputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        out = flce.linear_cross_entropy(hidden, weight, target, bias, **options)
        if isinstance(out, torch.Tensor):
            return out
        return tuple(t for t in (out.loss, out.logprobs, out.entropy) if t is not None)
    return outputs


# Every case with a bias; without one (a plain GEMM instead of addmm) the first and the last.
GRADCHECK_PARAMS = [pytest.param(case, True, id=name) for name, case in GRADCHECK_CASES.items()] + [
    pytest.param(GRADCHECK_CASES[name], False, id=f"{name}-no-bias") for name in ("defaults", "everything")]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("case", "bias"), GRADCHECK_PARAMS)
def test_gradcheck_float64(case: dict[str, Any], bias: bool, reduction: str, generator: torch.Generator) -> None:
    """torch.autograd.gradcheck (its analytical jacobian is one retained backward per output
    element, and check_batched_grad runs them batched) against finite differences."""
    options = _options(case, 7, generator, reduction=reduction)
    hidden, weight, target, b = make_inputs((2, 2), 3, 7, dtype=torch.float64, bias=bias, generator=generator,
                                            ignore_index=options.get("ignore_index", -100))
    inputs = tuple(None if t is None else t.requires_grad_() for t in (hidden, weight, b))
    assert torch.autograd.gradcheck(_differentiable_outputs(target, options), inputs, check_batched_grad=True)


def _jacobian_rows(outputs: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """d outputs / d inputs by one retained backward per output element."""
    flat = outputs.reshape(-1)
    rows = [torch.autograd.grad(flat[i], inputs, retain_graph=True) for i in range(flat.numel())]
    return [torch.stack([r[k] for r in rows]) for k in range(len(inputs))]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_token_scaling_jacobian_matches_the_oracle(reduction: str, generator: torch.Generator) -> None:
    hidden, weight, target, bias = make_inputs((5,), 4, 11, dtype=torch.float64, bias=True, generator=generator)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    options = {"token_scaling": True, "label_smoothing": 0.1, "reduction": reduction}
    got = _jacobian_rows(flce.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], **options), leaves)
    want = _jacobian_rows(reference_loss(leaves[0], leaves[1], target, leaves[2], **options).loss, leaves)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"d loss / d {name}: {m}")


@pytest.mark.parametrize("extras", [False, True], ids=["loss", "loss-logprobs-entropy"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_batched_gradients_equal_a_loop_and_the_oracle(plan: object, reduction: str, extras: bool,
                                                       generator: torch.Generator) -> None:
    """torch.autograd.grad(..., is_grads_batched=True) over a batch of grad_outputs equals one
    backward per batch entry, and each equals float64 autograd through the oracle."""
    hidden, weight, target, bias = make_inputs((3, 4), 6, 17, dtype=torch.float64, bias=True, generator=generator)
    options = _options(FULL_OPTIONS, 17, generator, reduction=reduction, return_logprobs=extras,
                       return_entropy=extras)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    out = _eager_loss(plan, leaves, target, options)
    outputs = (out.loss, out.logprobs, out.entropy) if extras else (out,)
    batch = 3
    upstreams = [torch.randn(batch, *o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    batched = torch.autograd.grad(outputs, leaves, upstreams, retain_graph=True, is_grads_batched=True)
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    oracle = reference_loss(fresh[0], fresh[1], target, fresh[2], **options)
    oracle_outputs = (oracle.loss, oracle.logprobs, oracle.entropy) if extras else (oracle.loss,)
    for i in range(batch):
        one = torch.autograd.grad(outputs, leaves, [u[i] for u in upstreams], retain_graph=True)
        want = torch.autograd.grad(oracle_outputs, fresh, [u[i] for u in upstreams], retain_graph=True)
        for name, b, o, w in zip(("hidden", "weight", "bias"), batched, one, want, strict=True):
            torch.testing.assert_close(b[i], o, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, name=name, i=i: f"batch entry {i}, grad {name} vs a loop: {m}")
            torch.testing.assert_close(b[i], w, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, name=name, i=i: f"batch entry {i}, grad {name} vs the oracle: {m}")


@pytest.mark.parametrize("options", [{}, FULL_OPTIONS], ids=["defaults", "full"])
def test_jacrev_of_per_token_losses_matches_the_oracle(options: dict[str, Any], generator: torch.Generator) -> None:
    hidden, weight, target, bias = make_inputs((5,), 4, 11, dtype=torch.float64, bias=True, generator=generator)
    options = _options(options, 11, generator, reduction="none")

    def per_token(fn):
        return lambda h, w: fn(h, w, target, bias, **options)

    got = torch.func.jacrev(per_token(flce.linear_cross_entropy), argnums=(0, 1))(hidden, weight)
    want = torch.func.jacrev(lambda h, w: per_token(reference_loss)(h, w).loss, argnums=(0, 1))(hidden, weight)
    for name, g, w in zip(("hidden", "weight"), got, want, strict=True):
        assert g.shape == (5, *w.shape[1:]) and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"d losses / d {name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_func_grad_of_the_loss_matches_the_oracle(reduction: str, generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((6,), 4, 11, dtype=torch.float64, generator=generator)
    options = _options(FULL_OPTIONS, 11, generator, reduction=reduction)
    got = torch.func.grad(lambda w: flce.linear_cross_entropy(hidden, w, target, **options))(weight)
    want = torch.func.grad(lambda w: reference_loss(hidden, w, target, **options).loss)(weight)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("nesting", ["hessian", "jacrev-of-jacrev", "grad-of-grad"])
def test_second_derivatives_by_nested_transforms_are_refused(nesting: str, generator: torch.Generator) -> None:
    """flce's gradients are first-order only: nested transforms raise instead of returning zeros."""
    hidden, weight, target, _ = make_inputs((4,), 3, 7, dtype=torch.float64, generator=generator)

    def loss(h: torch.Tensor) -> torch.Tensor:
        return flce.linear_cross_entropy(h, weight, target)

    nested = nested_second_derivatives(loss)[nesting]
    with pytest.raises(RuntimeError, match="first-order only"):
        nested(hidden)


@pytest.mark.triton
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_backend_retained_and_batched_backward_match_the_oracle(reduction: str, monkeypatch: pytest.MonkeyPatch,
                                                                     generator: torch.Generator) -> None:
    """The CUDA backend (its Triton kernels on a GPU; without one, interpreted on CPU tensors with
    small vocabulary blocks): a batched backward, then two retained backwards with different
    grad_outputs, each against float64 autograd through the oracle."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 64)
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=generator)))  # lm_head_inputs draws from it
    x, w, b, t = lm_head_inputs(12, 16, 203, torch.float32, device, with_bias=True)
    options = {"label_smoothing": 0.1, "softcap": 3.0, "reduction": reduction}
    loss = flce.linear_cross_entropy(x, w, t, b, backend="cuda", **options)
    upstreams = torch.randn(3, *loss.shape, device=device) + 0.5
    batched = torch.autograd.grad(loss, (x, w, b), upstreams, retain_graph=True, is_grads_batched=True)
    first = torch.autograd.grad(loss, (x, w, b), upstreams[0], retain_graph=True)
    second = torch.autograd.grad(loss, (x, w, b), upstreams[1])
    leaves = [a.detach().double().requires_grad_() for a in (x, w, b)]
    oracle = reference_loss(leaves[0], leaves[1], t, leaves[2], **options).loss
    checks = [(f"batch entry {i}", [g[i] for g in batched], upstreams[i]) for i in range(3)]
    checks += [("first retained backward", first, upstreams[0]), ("second retained backward", second, upstreams[1])]
    for what, got, upstream in checks:
        want = torch.autograd.grad(oracle, leaves, upstream.double(), retain_graph=True)
        for name, g, o in zip(("hidden", "weight", "bias"), got, want, strict=True):
            torch.testing.assert_close(g.double(), o, rtol=5e-5, atol=5e-5,
                                       msg=lambda m, what=what, name=name: f"{what}, grad {name}: {m}")



def _second_derivative_calls(loss_of: Any, point: torch.Tensor, generator: torch.Generator) -> dict[str, Any]:
    """torch.autograd's ways to a second derivative of ``loss_of`` (a scalar function) at ``point``: each
    gave zeros or None with no error while flce's first-order gradients carried no graph back to the inputs."""
    direction = torch.randn(point.shape, generator=generator, dtype=point.dtype).to(point.device)

    def grad_of_grad(**options: Any):
        leaf = point.detach().clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss_of(leaf), leaf, create_graph=True)
        return torch.autograd.grad(grad, leaf, direction, allow_unused=True, **options)

    return {
        "hessian": lambda: torch.autograd.functional.hessian(loss_of, point),
        "hvp": lambda: torch.autograd.functional.hvp(loss_of, point, direction),
        "vhp": lambda: torch.autograd.functional.vhp(loss_of, point, direction),
        "grad-of-grad": grad_of_grad,
        "grad-of-grad-materialized": lambda: grad_of_grad(materialize_grads=True),
    }


SECOND_DERIVATIVES = ("hessian", "hvp", "vhp", "grad-of-grad", "grad-of-grad-materialized")


@pytest.mark.parametrize("how", SECOND_DERIVATIVES)
@pytest.mark.parametrize("wrt", ["hidden", "weight"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_second_derivatives_by_autograd_are_refused(plan: object, reduction: str, wrt: str, how: str,
                                                    generator: torch.Generator) -> None:
    """The eager Function, every schedule (gradients in forward, deferred, kept logits, vocabulary blocks):
    a second derivative raises flce's first-order message instead of returning zeros."""
    hidden, weight, target, bias = make_inputs((5,), 3, 7, dtype=torch.float64, bias=True, generator=generator)
    options = _options(FULL_OPTIONS, 7, generator, reduction=reduction)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        leaves = [x, weight, bias] if wrt == "hidden" else [hidden, x, bias]
        return _eager_loss(plan, leaves, target, options).sum()

    point = hidden if wrt == "hidden" else weight
    with pytest.raises(RuntimeError, match="first-order only"):
        _second_derivative_calls(loss_of, point, generator)[how]()


@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.triton)])
@pytest.mark.parametrize("how", SECOND_DERIVATIVES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_derivatives_through_the_public_api_are_refused(reduction: str, how: str, backend: str,
                                                               generator: torch.Generator) -> None:
    """The reference backend and the CUDA backend's kernels (interpreted on CPU tensors without a GPU)."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    device = "cuda" if backend == "cuda" and torch.cuda.is_available() else "cpu"
    hidden, weight, target, _ = make_inputs((5,), 3, 7, dtype=dtype, generator=generator, device=device)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return flce.linear_cross_entropy(x, weight, target, reduction=reduction, backend=backend).sum()

    with pytest.raises(RuntimeError, match="first-order only"):
        _second_derivative_calls(loss_of, hidden, generator)[how]()


@pytest.mark.parametrize("how", ["hessian", "grad-of-grad"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_derivatives_through_the_custom_ops_called_eagerly_are_refused(reduction: str, how: str,
                                                                              generator: torch.Generator) -> None:
    """The compile path's ops (``flce::chunked_forward``) run outside torch.compile: their autograd formula."""
    from flce.engine.custom_ops import apply_op

    hidden, weight, target, _ = make_inputs((5,), 3, 7, dtype=torch.float64, generator=generator)
    cfg = LCEConfig(reduction=reduction)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return apply_op("reference", prepare_inputs(x, weight, target, None, cfg), cfg, "full").sum()

    with pytest.raises(RuntimeError, match="first-order only"):
        _second_derivative_calls(loss_of, hidden, generator)[how]()


def test_create_graph_first_order_gradients_still_match_the_oracle(generator: torch.Generator) -> None:
    """What the guard must not break: create_graph=True gives the first-order gradients (a gradient penalty
    on something else, torch.func.grad's own create_graph)."""
    hidden, weight, target, bias = make_inputs((5,), 3, 7, dtype=torch.float64, bias=True, generator=generator)
    options = _options(FULL_OPTIONS, 7, generator)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    for plan in PLANS.values():
        got = torch.autograd.grad(_eager_loss(plan, leaves, target, options), leaves, create_graph=True)
        want = _oracle_grads(leaves, target, options, torch.ones((), dtype=torch.float64))
        for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
            assert g.requires_grad, f"grad {name} under create_graph=True must carry the first-order guard"
            torch.testing.assert_close(g.detach(), w, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, n=name, p=plan: f"{p} {n}: {m}")
