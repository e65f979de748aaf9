"""Property-based tests: random shapes and option combinations against the float64 oracle,
and invariances the loss must have whatever the inputs."""

from __future__ import annotations

from typing import Any

import torch
from helpers import (
    Upstream,
    assert_close_per_design,
    flce_grads,
    make_inputs,
    random_class_weight,
    random_upstream,
    reference_grads,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flce
from flce import LCEOutput

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    """A random call: shapes (empty included), option values and which extras to return."""
    token_shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    vocab = draw(st.integers(2, 70))
    hidden_size = draw(st.integers(1, 24))
    options: dict[str, Any] = {
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "ignore_index": draw(st.sampled_from([-100, 0, vocab - 1, vocab + 3])),
    }
    if draw(st.booleans()):
        options["label_smoothing"] = draw(st.floats(0.0, 1.0))
    if draw(st.booleans()):
        options["lse_square_scale"] = draw(st.floats(0.0, 0.1))
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(0.5, 50.0))
    if draw(st.booleans()):
        options["temperature"] = draw(st.floats(0.25, 4.0))
    if draw(st.booleans()):
        options["token_scaling"] = True
    for name in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens", "return_logprobs",
                 "return_entropy"):
        if draw(st.booleans()):
            options[name] = True
    if draw(st.booleans()):
        options["memory_budget"] = draw(st.integers(1, 64 * vocab * 12))
    return {
        "token_shape": token_shape,
        "vocab": vocab,
        "hidden_size": hidden_size,
        "options": options,
        "class_weight": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "ignore_fraction": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@SETTINGS
@given(call=calls())
def test_random_calls_match_oracle(call: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(call["seed"])
    options = dict(call["options"])
    if call["class_weight"]:
        options["class_weight"] = random_class_weight(call["vocab"], generator)
    shape = call["token_shape"]
    hidden, weight, target, bias = make_inputs(shape, call["hidden_size"], call["vocab"], bias=call["bias"],
                                               generator=generator, ignore_index=options["ignore_index"],
                                               ignore_fraction=call["ignore_fraction"])
    upstream = random_upstream(torch.Size(shape) if options["reduction"] == "none" else torch.Size(()),
                               torch.Size(shape), logprobs=options.get("return_logprobs", False),
                               entropy=options.get("return_entropy", False), generator=generator)
    out, grads = flce_grads(flce.get_impl("cpu")(**options), hidden, weight, target, bias, upstream)
    ref, ref_grads = reference_grads(hidden, weight, target, bias, upstream, **options)

    kind = "temperature" if options.get("temperature", 1.0) != 1.0 else "forward"
    out = out if isinstance(out, LCEOutput) else LCEOutput(loss=out)
    assert_close_per_design(out.loss, ref.loss, kind=kind, dtype=torch.float32, name="loss")
    for name in LCEOutput._fields[1:]:
        if options.get(f"return_{name}", False):
            got = getattr(out, name)
            if name == "predicted_tokens" and options.get("softcap") is None:
                torch.testing.assert_close(got, ref.predicted_tokens, rtol=0, atol=0)
            elif name == "predicted_tokens":
                # A small softcap saturates tanh: two fp32 logits can tie where float64 ones do not, so
                # the prediction must be a maximal logit up to fp32 rounding, not the oracle's exact index.
                assert_is_argmax_up_to_rounding(got, hidden, weight, target, bias, options)
            elif name == "token_accuracy" and options.get("softcap") is not None:
                continue  # inherits the saturated-argmax ties above
            else:
                assert_close_per_design(got, getattr(ref, name), kind=kind, dtype=torch.float32, name=name)
        else:
            assert getattr(out, name) is None
    assert_close_per_design(grads.hidden, ref_grads.hidden, kind="grad_hidden", dtype=torch.float32,
                            name="grad hidden")
    assert_close_per_design(grads.weight, ref_grads.weight, kind="grad_weight", dtype=torch.float32,
                            name="grad weight")
    if bias is not None:
        assert_close_per_design(grads.bias, ref_grads.bias, kind="grad_weight", dtype=torch.float32,
                                name="grad bias")


def assert_is_argmax_up_to_rounding(predicted: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                    target: torch.Tensor, bias: torch.Tensor | None, options: dict[str, Any]) -> None:
    u = hidden.double().reshape(-1, weight.shape[1]) @ weight.double().T
    if bias is not None:
        u = u + bias.double()
    z = options["softcap"] * torch.tanh(u / options["softcap"]) / options.get("temperature", 1.0)
    valid = target.reshape(-1) != options["ignore_index"]
    pred = predicted.reshape(-1)
    assert (pred[~valid] == -1).all()
    chosen = z[valid].gather(1, pred[valid].unsqueeze(1)).squeeze(1)
    best = z[valid].max(1).values
    assert (chosen >= best - 1e-5 * (1 + best.abs())).all(), "a predicted token is not a maximal logit"


@SETTINGS
@given(tokens=st.integers(1, 30), vocab=st.integers(2, 60), seed=st.integers(0, 2**31 - 1),
       smoothing=st.sampled_from([0.0, 0.2]))
def test_reductions_agree(tokens: int, vocab: int, seed: int, smoothing: float) -> None:
    """sum = sum of per-token losses; mean = sum / (non-ignored tokens), 0 when there are none."""
    generator = torch.Generator().manual_seed(seed)
    hidden, weight, target, _ = make_inputs((tokens,), 8, vocab, generator=generator)
    per_token = flce.linear_cross_entropy(hidden, weight, target, reduction="none", label_smoothing=smoothing)
    total = flce.linear_cross_entropy(hidden, weight, target, reduction="sum", label_smoothing=smoothing)
    mean = flce.linear_cross_entropy(hidden, weight, target, reduction="mean", label_smoothing=smoothing)
    count = int((target != -100).sum())
    torch.testing.assert_close(total, per_token.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, total / count if count else torch.zeros(()), rtol=1e-5, atol=1e-5)
    assert (per_token[target == -100] == 0).all()


@SETTINGS
@given(tokens=st.integers(2, 30), seed=st.integers(0, 2**31 - 1))
def test_token_order_does_not_matter(tokens: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    hidden, weight, target, bias = make_inputs((tokens,), 8, 23, bias=True, generator=generator)
    perm = torch.randperm(tokens, generator=generator)
    upstream = Upstream(loss=torch.tensor(1.0, dtype=torch.float64))
    fn = flce.get_impl("cpu")(reduction="sum", lse_square_scale=0.01)
    out, grads = flce_grads(fn, hidden, weight, target, bias, upstream)
    out_p, grads_p = flce_grads(fn, hidden[perm], weight, target[perm], bias, upstream)
    torch.testing.assert_close(out, out_p, rtol=1e-5, atol=1e-5)
    # Equal up to fp32 rounding: the permuted rows sit elsewhere in the GEMMs, whose sums then round in another
    # order. A gradient entry sums V (grad_hidden) or N (grad_weight) products of a logit gradient (|g| < 2 here:
    # softmax - onehot plus the z-loss's 0.02 lse p) with the other operand; such sums cancel, so the bound is
    # absolute (seed 124976 at 7 tokens differed by 1.6e-6 in an entry of 0.01).
    eps = torch.finfo(torch.float32).eps
    hidden_atol = 2 * weight.shape[0] * eps * float(weight.abs().max())
    weight_atol = 2 * tokens * eps * float(hidden.abs().max())
    torch.testing.assert_close(grads.hidden[perm], grads_p.hidden, rtol=1e-5, atol=hidden_atol)
    torch.testing.assert_close(grads.weight, grads_p.weight, rtol=1e-5, atol=weight_atol)


@SETTINGS
@given(tokens=st.integers(1, 20), vocab=st.integers(2, 40), seed=st.integers(0, 2**31 - 1),
       shift=st.floats(-20.0, 20.0))
def test_bias_shift_invariance(tokens: int, vocab: int, seed: int, shift: float) -> None:
    """Adding a constant to every logit changes neither the loss nor the logprobs (no z-loss)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, weight, target, bias = make_inputs((tokens,), 8, vocab, bias=True, generator=generator)
    a = flce.linear_cross_entropy(hidden, weight, target, bias, reduction="none", return_logprobs=True)
    b = flce.linear_cross_entropy(hidden, weight, target, bias + shift, reduction="none", return_logprobs=True)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
