"""Every bad-input case of docs/design.md gets a clear error (type + the argument, value and what was
expected) before any kernel runs; the valid edge cases (empty, non-contiguous) are accepted."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import make_inputs

import flce
import flce.engine.run as engine_run

H, V = 8, 11


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fails the test if the reference backend starts computing: errors must come first."""
    launched: list[str] = []

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        launched.append("apply_eager")
        raise AssertionError("a kernel ran before the bad input was reported")

    monkeypatch.setattr(engine_run, "apply_eager", refuse)
    yield launched
    assert not launched


@pytest.fixture
def inputs(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator, ignore_fraction=0.3)
    return hidden, weight, target


def call(hidden, weight, target, bias=None, **options):
    return flce.linear_cross_entropy(hidden, weight, target, bias, **options)


def raises(error: type[Exception], *fragments: str):
    """pytest.raises that requires every fragment (a literal) somewhere in the message."""
    pattern = "".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments)
    return pytest.raises(error, match=pattern)


# --- tensors -------------------------------------------------------------------------------------


def test_mismatched_hidden_size(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "hidden", f"{H + 1}", f"H={H}"):
        call(torch.randn(6, H + 1), weight, target)


def test_mismatched_token_count(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "target", "5 elements", "6 tokens"):
        call(hidden, weight, target[:5])


@pytest.mark.parametrize(("hidden_shape", "target_shape"), [((4, 5), (5, 4)), ((4, 5), (20,)), ((20,), (4, 5))])
def test_target_with_as_many_tokens_but_another_shape(no_kernel, hidden_shape, target_shape) -> None:
    """Equal counts are not enough: flat-index pairing would give tokens the wrong targets."""
    hidden = torch.randn(*hidden_shape, H)
    target = torch.randint(0, V, target_shape)
    with raises(ValueError, "target", str(target_shape), str((*hidden_shape, H)), "hidden.shape[:-1]"):
        call(hidden, torch.randn(V, H), target, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_non_integer_target(inputs, no_kernel, dtype: torch.dtype) -> None:
    hidden, weight, target = inputs
    with raises(TypeError, "target", str(dtype)):
        call(hidden, weight, target.clamp(0).to(dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_target_is_accepted(inputs, dtype: torch.dtype) -> None:
    hidden, weight, target = inputs
    target = target.clamp(0)
    expected = call(hidden, weight, target)
    torch.testing.assert_close(call(hidden, weight, target.to(dtype)), expected)


@pytest.mark.parametrize("bad", [V, V + 7, -1, -101])
def test_target_out_of_range(inputs, no_kernel, bad: int) -> None:
    hidden, weight, target = inputs
    target = target.clone()
    target[3] = bad
    with raises(ValueError, "target", str(bad), f"[0, {V})", "ignore_index=-100"):
        call(hidden, weight, target)


def test_custom_ignore_index_outside_vocab_is_accepted(inputs) -> None:
    hidden, weight, target = inputs
    shifted = torch.where(target == -100, V + 5, target)
    torch.testing.assert_close(call(hidden, weight, shifted, ignore_index=V + 5), call(hidden, weight, target))


def test_dtype_mismatch_outside_autocast(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(TypeError, "hidden", "torch.bfloat16", "weight", "torch.float32", "autocast"):
        call(hidden.to(torch.bfloat16), weight, target)


def test_bias_dtype_mismatch(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(TypeError, "bias", "torch.float64", "torch.float32"):
        call(hidden, weight, target, torch.zeros(V, dtype=torch.float64) + 0.1)


@pytest.mark.parametrize("shape", [(V + 1,), (1, V), ()])
def test_bias_wrong_shape(inputs, no_kernel, shape) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "bias", f"[V={V}]", str(tuple(shape))):
        call(hidden, weight, target, torch.rand(shape) + 0.1)


def test_integer_hidden(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "hidden", "floating-point", "torch.int64"):
        call(hidden.long(), weight, target)


@pytest.mark.parametrize("weight_shape", [(V,), (V, H, 1)])
def test_weight_not_2d(inputs, no_kernel, weight_shape) -> None:
    hidden, _, target = inputs
    with raises(ValueError, "weight", "[V, H]", str(weight_shape)):
        call(hidden, torch.rand(weight_shape) + 0.1, target)


@pytest.mark.parametrize("position", ["hidden", "weight", "target", "bias"])
def test_not_a_tensor(inputs, no_kernel, position: str) -> None:
    hidden, weight, target = inputs
    args = {"hidden": hidden, "weight": weight, "target": target, "bias": None}
    args[position] = [1.0, 2.0]
    with raises(TypeError, position, "list"):
        call(**args)


def test_different_devices(inputs, no_kernel) -> None:
    """The meta device stands in for an accelerator: the check is about devices, not hardware."""
    hidden, weight, target = inputs
    with raises(ValueError, "weight", "meta", "hidden", "cpu", "one device"):
        call(hidden, weight.to("meta"), target)
    with raises(ValueError, "target", "meta", "cpu"):
        call(hidden, weight, target.to("meta"))


def test_class_weight_on_another_device(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "class_weight", "meta", "cpu"):
        call(hidden, weight, target, class_weight=torch.ones(V, device="meta"))


# --- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "fragments"),
    [
        ({"reduction": "avg"}, ValueError, ("reduction", "'avg'", "'mean'", "'sum'", "'none'")),
        ({"reduction": None}, ValueError, ("reduction", "None")),
        ({"label_smoothing": -0.1}, ValueError, ("label_smoothing", "-0.1", "[0, 1]")),
        ({"label_smoothing": 1.5}, ValueError, ("label_smoothing", "1.5", "[0, 1]")),
        ({"label_smoothing": "0.1"}, TypeError, ("label_smoothing", "'0.1'", "real number")),
        ({"label_smoothing": math.nan}, TypeError, ("label_smoothing", "nan", "finite")),
        ({"lse_square_scale": -1e-4}, ValueError, ("lse_square_scale", "-0.0001", ">= 0")),
        ({"softcap": 0.0}, ValueError, ("softcap", "0.0", "> 0")),
        ({"softcap": -30.0}, ValueError, ("softcap", "-30.0", "> 0")),
        ({"softcap": math.inf}, TypeError, ("softcap", "inf", "finite")),
        ({"temperature": 0.0}, ValueError, ("temperature", "0.0", "> 0")),
        ({"temperature": -1.0}, ValueError, ("temperature", "-1.0", "> 0")),
        ({"temperature": True}, TypeError, ("temperature", "True")),
        ({"ignore_index": 1.5}, TypeError, ("ignore_index", "1.5", "int")),
        ({"accum_dtype": torch.float16}, ValueError, ("accum_dtype", "torch.float16", "torch.float32")),
        ({"memory_budget": 0}, ValueError, ("memory_budget", "0", "positive")),
        ({"memory_budget": -5}, ValueError, ("memory_budget", "-5", "positive")),
        ({"memory_budget": 1.5e9}, TypeError, ("memory_budget", "int")),
        ({"memory_budget": 10**30}, ValueError, ("memory_budget", str(10**30), "int64")),
        ({"ignore_index": 2**70}, ValueError, ("ignore_index", str(2**70), "int64")),
        ({"class_weight": torch.ones(V, requires_grad=True)}, ValueError, ("class_weight", "requires grad", "detach")),
        ({"token_scaling": 1}, TypeError, ("token_scaling", "1", "bool")),
        ({"return_logprobs": "yes"}, TypeError, ("return_logprobs", "'yes'", "bool")),
        ({"class_weight": torch.ones(V, 2)}, ValueError, ("class_weight", "1-D", f"({V}, 2)")),
        ({"class_weight": torch.ones(V, dtype=torch.int64)}, ValueError, ("class_weight", "floating-point")),
        ({"class_weight": [1.0] * V}, ValueError, ("class_weight", "list")),
        ({"reductoin": "sum"}, TypeError, ("reductoin",)),
    ],
    ids=lambda v: None if isinstance(v, (dict, type, tuple)) else str(v),
)
def test_bad_option(inputs, no_kernel, options: dict, error: type[Exception], fragments: tuple) -> None:
    hidden, weight, target = inputs
    with raises(error, *fragments):
        flce.get_impl("cpu")(**options)
    with raises(error, *fragments):
        call(hidden, weight, target, **options)


def test_unknown_option_names_the_function_and_the_closest_option(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(TypeError, "linear_cross_entropy()", "'reductoin'", "did you mean 'reduction'?"):
        flce.linear_cross_entropy(hidden, weight, target, reductoin="sum")
    with raises(TypeError, "LinearCrossEntropy()", "'softcapp'", "did you mean 'softcap'?"):
        flce.get_impl("cpu")(softcapp=3.0)
    with raises(TypeError, "linear_cross_entropy()", "'xyzzy'", "Valid options: ignore_index"):
        flce.linear_cross_entropy(hidden, weight, target, xyzzy=1)


@pytest.mark.parametrize("reduction", ["mean", "none"])  # the in-forward and the deferred schedule
def test_double_backward_is_refused_with_a_clear_error(inputs, reduction: str) -> None:
    """create_graph=True works (first-order gradients, as without it); differentiating them raises."""
    hidden, weight, target = inputs
    hidden = hidden.detach().requires_grad_()
    loss = call(hidden, weight, target, reduction=reduction).sum()
    (grad,) = torch.autograd.grad(loss, hidden, create_graph=True)
    want = torch.autograd.grad(call(hidden, weight, target, reduction=reduction).sum(), hidden)[0]
    torch.testing.assert_close(grad, want)
    with raises(RuntimeError, "first-order only", "double backward"):
        grad.pow(2).sum().backward()


def test_torch_keyword_weight_names_class_weight(inputs, no_kernel) -> None:
    """torch's cross_entropy takes class weights as weight=; flce's positional weight is the LM head's."""
    hidden, weight, target = inputs
    with raises(TypeError, "linear_cross_entropy()", "weight=", "class_weight="):
        flce.linear_cross_entropy(hidden, weight, target, weight=torch.ones(V))
    with raises(TypeError, "LinearCrossEntropy()", "weight=", "class_weight="):
        flce.get_impl("cpu")(weight=torch.ones(V))


def test_huge_memory_budget_fails_alike_eager_and_compiled(inputs) -> None:
    """The compile path's custom ops take the budget as int64: eager must not accept what they refuse."""
    hidden, weight, target = inputs

    def loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return flce.linear_cross_entropy(h, w, t, memory_budget=10**30)

    with raises(ValueError, "memory_budget", "int64"):
        loss(hidden, weight, target)
    torch._dynamo.reset()
    with raises(ValueError, "memory_budget", "int64"):
        torch.compile(loss, backend="eager")(hidden, weight, target)
    torch._dynamo.reset()
    with raises(RuntimeError, "memory_budget", "int64"):  # fullgraph: Dynamo wraps the error, message intact
        torch.compile(loss, backend="eager", fullgraph=True)(hidden, weight, target)
    budget = 2**63 - 1  # the largest budget both accept, and it computes the same loss
    compiled = torch.compile(lambda h, w, t: flce.linear_cross_entropy(h, w, t, memory_budget=budget),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight, target), call(hidden, weight, target), rtol=0, atol=0)


def test_empty_vocabulary(inputs, no_kernel) -> None:
    hidden, _, target = inputs
    with raises(ValueError, "weight", f"(0, {H})", "V >= 1"):
        call(hidden, torch.randn(0, H), torch.full_like(target, -100))


def test_class_weight_wrong_length(inputs, no_kernel) -> None:
    hidden, weight, target = inputs
    with raises(ValueError, "class_weight", f"[V={V}]", f"({V + 3},)"):
        call(hidden, weight, target, class_weight=torch.ones(V + 3))


def test_bad_variant_and_device(no_kernel) -> None:
    with raises(ValueError, "variant", "'fast'", "'auto'"):
        flce.get_impl("cpu", variant="fast")
    with raises(ValueError, "device", "'not-a-device'"):
        flce.get_impl("not-a-device")
    with raises(TypeError, "device", "3.5"):
        flce.get_impl(3.5)


# --- valid edge cases ----------------------------------------------------------------------------


def test_empty_input_is_valid() -> None:
    loss = call(torch.randn(0, H), torch.randn(V, H), torch.zeros(0, dtype=torch.long))
    assert loss.shape == () and float(loss) == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_hidden_size(generator: torch.Generator, reduction: str) -> None:
    """H = 0: every logit is the bias, so the loss is the bias's cross-entropy; grads of hidden and
    weight are empty, the bias still gets one."""
    target = torch.randint(0, V, (2, 3), generator=generator)
    target[0, 1] = -100
    leaves = [torch.zeros(2, 3, 0, requires_grad=True), torch.zeros(V, 0, requires_grad=True),
              torch.randn(V, generator=generator, requires_grad=True)]
    loss = call(*leaves[:2], target, leaves[2], reduction=reduction)
    expected = torch.nn.functional.cross_entropy(leaves[2].double().expand(6, V), target.reshape(-1),
                                                 reduction=reduction).reshape(loss.shape)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(loss.sum(), leaves)
    expected_bias_grad = torch.autograd.grad(expected.sum(), leaves[2])[0]
    assert grads[0].shape == (2, 3, 0) and grads[1].shape == (V, 0)
    torch.testing.assert_close(grads[2], expected_bias_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_meta_tensors_give_shapes_as_torch_does(reduction: str) -> None:
    """Meta tensors (shape inference, models built on the meta device) carry shapes and dtypes only."""
    hidden = torch.empty(2, 3, H, device="meta", requires_grad=True)
    weight = torch.empty(V, H, device="meta", requires_grad=True)
    target = torch.empty(2, 3, dtype=torch.long, device="meta")
    out = call(hidden, weight, target, reduction=reduction, return_entropy=True)
    expected = torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(),
                                                 reduction=reduction)
    want_shape = (2, 3) if reduction == "none" else expected.shape
    assert out.loss.device.type == "meta" and out.loss.shape == want_shape and out.entropy.shape == (2, 3)
    (out.loss.sum() + out.entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape and hidden.grad.device.type == "meta"
    assert weight.grad.shape == weight.shape


def test_zero_dim_target_with_single_token(inputs) -> None:
    """hidden [H] (one token) with a 0-d target: a [..., H] input with no leading dimensions."""
    hidden, weight, target = inputs
    target = target.clamp(0)
    single = call(hidden[2], weight, target[2], reduction="none")
    assert single.shape == ()
    torch.testing.assert_close(single, call(hidden, weight, target, reduction="none")[2])
