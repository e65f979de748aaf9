"""The reference backend against the float64 materialised oracle (tests/helpers.py).

Every option of docs/design.md's table x every reduction x with and without bias, forward and
backward with random upstream gradients (through loss, logprobs and entropy), plus the
cases docs/design.md calls out: low precision, autocast, [..., H] and non-contiguous inputs,
empty and all-ignored input, accum_dtype, chunking and the deferred gradient schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    Grads,
    Upstream,
    assert_close_per_design,
    assert_same_argmax,
    flce_grads,
    make_inputs,
    random_class_weight,
    random_upstream,
    reference_grads,
    reference_loss,
    relative_error,
)
from planning import reference_bytes_per_row, reference_plan

import flce
from flce import LCEOutput
from flce.backends.reference.plan import plan_call
from flce.config import LCEConfig
from flce.engine.function import apply_eager
from flce.engine.plans import PlanRequest, TokenChunks
from flce.inputs import prepare_inputs

REDUCTIONS = ("mean", "sum", "none")
TOKENS = (3, 7)
HIDDEN = 16
VOCAB = 97
ALL_RETURNS = {"return_z_loss": True, "return_token_accuracy": True, "return_predicted_tokens": True,
               "return_logprobs": True, "return_entropy": True}

# "class_weight": "random" is replaced by fresh random weights of the call's vocabulary size.
OPTION_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ignore_index_inside_vocab": {"ignore_index": 5},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 0.05, "return_z_loss": True},
    "softcap": {"softcap": 3.0},
    "class_weight": {"class_weight": "random"},
    "temperature": {"temperature": 0.7},
    "token_scaling": {"token_scaling": True},
    "entropy_weight": {"entropy_weight": 0.1, "temperature": 0.7},
    "smoothing_with_class_weight": {"label_smoothing": 0.2, "class_weight": "random"},
    "returns": dict(ALL_RETURNS),
    "everything": {"label_smoothing": 0.1, "lse_square_scale": 0.02, "softcap": 4.0, "class_weight": "random",
                   "temperature": 1.3, "token_scaling": True, "ignore_index": 2, **ALL_RETURNS},
}


def build_options(case: dict[str, Any], vocab: int, generator: torch.Generator, **extra: Any) -> dict[str, Any]:
    options = dict(case, **extra)
    if options.get("class_weight") == "random":
        options["class_weight"] = random_class_weight(vocab, generator)
    return options


def forward_kind(options: dict[str, Any]) -> str:
    return "temperature" if options.get("temperature", 1.0) != 1.0 else "forward"


def upstream_for(options: dict[str, Any], token_shape: tuple[int, ...], generator: torch.Generator) -> Upstream:
    reduction = options.get("reduction", "mean")
    return random_upstream(torch.Size(token_shape) if reduction == "none" else torch.Size(()),
                           torch.Size(token_shape), logprobs=options.get("return_logprobs", False),
                           entropy=options.get("return_entropy", False), generator=generator)


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # hidden, weight, target, bias


def compare_outputs(out: torch.Tensor | LCEOutput, ref: LCEOutput, options: dict[str, Any], dtype: torch.dtype,
                    inputs: Inputs) -> None:
    """``out`` against the oracle's ``ref`` for the call on ``inputs``. Predicted tokens may differ
    where two logits tie closer than the kernel can order them (see assert_same_argmax); the token
    accuracy is then checked against flce's own (validated) predictions."""
    kind = forward_kind(options)
    returns = [name for name in LCEOutput._fields[1:] if options.get(f"return_{name}", False)]
    if not returns:
        assert isinstance(out, torch.Tensor), f"no return_* option set: expected a bare tensor, got {type(out)}"
        assert_close_per_design(out, ref.loss, kind=kind, dtype=dtype, name="loss")
        return
    assert isinstance(out, LCEOutput), f"return_* set: expected LCEOutput, got {type(out)}"
    assert_close_per_design(out.loss, ref.loss, kind=kind, dtype=dtype, name="loss")
    hidden, weight, target, bias = inputs
    expected_accuracy = ref.token_accuracy
    if "predicted_tokens" in returns:
        assert out.predicted_tokens.dtype == torch.int64
        assert out.predicted_tokens.shape == ref.predicted_tokens.shape
        assert_same_argmax(out.predicted_tokens, ref.predicted_tokens, hidden, weight, bias, options,
                           logits_dtype=dtype)
        expected_accuracy = accuracy_of(out.predicted_tokens, target, options)
    for name in LCEOutput._fields[1:]:
        got = getattr(out, name)
        if name not in returns:
            assert got is None, f"{name} was not asked for but is {got}"
        elif name == "token_accuracy":
            assert_close_per_design(got, expected_accuracy, kind=kind, dtype=dtype, name=name)
        elif name != "predicted_tokens":
            assert_close_per_design(got, getattr(ref, name), kind=kind, dtype=dtype, name=name)


def accuracy_of(predicted: torch.Tensor, target: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    """The token accuracy, reduced as the oracle reduces it, of given predictions."""
    valid = target != options.get("ignore_index", -100)
    correct = ((predicted == target) & valid).double()
    count = valid.sum().double()
    reduction = options.get("reduction", "mean")
    if reduction == "none":
        return correct
    if reduction == "sum":
        return correct.sum()
    return torch.where(count > 0, correct.sum() / count.clamp_min(1.0), 0.0)


def compare_grads(grads, ref_grads, *, large: bool = False) -> None:
    assert_close_per_design(grads.hidden, ref_grads.hidden, kind="grad_hidden", dtype=torch.float32,
                            name="grad hidden")
    weight_kind = "grad_weight_large" if large else "grad_weight"
    assert_close_per_design(grads.weight, ref_grads.weight, kind=weight_kind, dtype=torch.float32,
                            name="grad weight")
    if ref_grads.bias is not None:
        assert_close_per_design(grads.bias, ref_grads.bias, kind=weight_kind, dtype=torch.float32, name="grad bias")


def run_case(options: dict[str, Any], generator: torch.Generator, *, bias: bool, token_shape=TOKENS,
             vocab: int = VOCAB, variant: str = "auto") -> None:
    hidden, weight, target, b = make_inputs(token_shape, HIDDEN, vocab, bias=bias, generator=generator,
                                            ignore_index=options.get("ignore_index", -100))
    upstream = upstream_for(options, token_shape, generator)
    module = flce.get_impl("cpu", variant=variant)(**options)
    out, grads = flce_grads(module, hidden, weight, target, b, upstream)
    ref, ref_grads = reference_grads(hidden, weight, target, b, upstream, **options)
    compare_outputs(out, ref, options, torch.float32, (hidden, weight, target, b))
    compare_grads(grads, ref_grads)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", OPTION_CASES)
def test_matches_oracle_fp32(case: str, reduction: str, bias: bool, generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    run_case(options, generator, bias=bias)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_full_variant_serves_plain_options(reduction: str, generator: torch.Generator) -> None:
    run_case({"reduction": reduction}, generator, bias=True, variant="full")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_explicit_plain_variant(reduction: str, generator: torch.Generator) -> None:
    run_case({"reduction": reduction, "ignore_index": 0}, generator, bias=False, variant="plain")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["defaults", "label_smoothing", "softcap", "temperature", "everything"])
def test_low_precision_forward(case: str, reduction: str, dtype: torch.dtype, generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, dtype=dtype, bias=True, generator=generator,
                                            ignore_index=options.get("ignore_index", -100))
    out = flce.linear_cross_entropy(hidden, weight, target, b, **options)
    # The oracle sees exactly the rounded low-precision inputs, upcast to float64.
    ref = reference_loss(hidden, weight, target, b, **options)
    compare_outputs(out, ref, options, dtype, (hidden, weight, target, b))
    loss = out if isinstance(out, torch.Tensor) else out.loss
    assert loss.dtype == torch.float32, "low-precision inputs give float32 losses (softmax math is fp32)"


def test_bf16_gradients_within_eager_error(generator: torch.Generator) -> None:
    """docs/design.md: bf16 gradients within 1.5x of what materialised bf16 eager PyTorch achieves."""
    hidden, weight, target, _ = make_inputs((256,), 64, 1000, dtype=torch.bfloat16, generator=generator)
    upstream = Upstream(loss=torch.tensor(1.0, dtype=torch.float64))
    _, grads = flce_grads(flce.get_impl("cpu")(), hidden, weight, target, None, upstream)
    _, ref = reference_grads(hidden, weight, target, None, upstream)

    def eager(h, w, t, b):
        return F.cross_entropy(h @ w.T, t)

    _, eager_grads = flce_grads(eager, hidden, weight, target, None, upstream)
    for name in ("hidden", "weight"):
        ours, theirs = relative_error(getattr(grads, name), getattr(ref, name)), \
            relative_error(getattr(eager_grads, name), getattr(ref, name))
        assert getattr(grads, name).dtype == torch.bfloat16
        assert ours <= 1.5 * theirs, f"grad {name}: flce relative error {ours:.2e} > 1.5 x eager bf16 {theirs:.2e}"


def test_autocast_cpu_bf16(generator: torch.Generator) -> None:
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, bias=True, generator=generator)
    upstream = Upstream(loss=torch.tensor(0.7, dtype=torch.float64))

    def under_autocast(h, w, t, bias):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return flce.linear_cross_entropy(h, w, t, bias)

    out, grads = flce_grads(under_autocast, hidden, weight, target, b, upstream)
    rounded = [t.to(torch.bfloat16) for t in (hidden, weight, b)]
    ref, ref_grads = reference_grads(rounded[0], rounded[1], target, rounded[2], upstream)
    assert_close_per_design(out, ref.loss, kind="forward", dtype=torch.bfloat16, name="loss under autocast")
    for name in ("hidden", "weight", "bias"):
        got = getattr(grads, name)
        assert got.dtype == torch.float32, f"grad {name} should come back in the leaf's dtype"
        err = relative_error(got, getattr(ref_grads, name))
        assert err < 2e-2, f"grad {name} under bf16 autocast: relative error {err:.2e}"


def test_dtype_mismatch_is_fine_under_autocast(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs(TOKENS, HIDDEN, VOCAB, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = flce.linear_cross_entropy(hidden, weight.to(torch.bfloat16), target)
    ref = reference_loss(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), target)
    assert_close_per_design(loss, ref.loss, kind="forward", dtype=torch.bfloat16, name="loss")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_leading_dimensions(reduction: str, generator: torch.Generator) -> None:
    """hidden [..., H] with target [...]: per-token outputs and gradients keep those shapes."""
    shape = (2, 3, 4)
    options = {"reduction": reduction, "return_logprobs": True, "return_entropy": True,
               "return_predicted_tokens": True}
    hidden, weight, target, b = make_inputs(shape, HIDDEN, VOCAB, bias=True, generator=generator)
    upstream = upstream_for(options, shape, generator)
    out, grads = flce_grads(flce.get_impl("cpu")(**options), hidden, weight, target, b, upstream)
    ref, ref_grads = reference_grads(hidden, weight, target, b, upstream, **options)
    for name in ("logprobs", "entropy", "predicted_tokens"):
        assert getattr(out, name).shape == shape
    assert out.loss.shape == (shape if reduction == "none" else ())
    assert grads.hidden.shape == hidden.shape
    compare_outputs(out, ref, options, torch.float32, (hidden, weight, target, b))
    compare_grads(grads, ref_grads)


def test_non_contiguous_inputs(generator: torch.Generator) -> None:
    n, h, v = 21, HIDDEN, VOCAB
    hidden_base, weight_t_base, target_base, bias_base = make_inputs(
        (n,), 2 * h, v, bias=True, generator=generator)
    target_base = torch.stack([target_base, target_base.flip(0)], 1)
    bias_base = torch.stack([bias_base, bias_base.flip(0)], 1)
    weight_store = weight_t_base.T.contiguous()  # [2H, V]: its transposed slice is a strided weight
    leaves = [hidden_base.requires_grad_(), weight_store.requires_grad_(), bias_base.requires_grad_()]
    hidden, weight, target, bias = leaves[0][:, ::2], leaves[1][::2].T, target_base[:, 1], leaves[2][:, 0]
    assert not any(t.is_contiguous() for t in (hidden, weight, target, bias))
    options = {"reduction": "none", "label_smoothing": 0.1, "return_logprobs": True}
    upstream = upstream_for(options, (n,), generator)
    out = flce.linear_cross_entropy(hidden, weight, target, bias, **options)
    (out.loss.double() * upstream.loss).sum().add((out.logprobs.double() * upstream.logprobs).sum()).backward()
    ref, ref_grads = reference_grads(hidden, weight, target, bias, upstream, **options)
    compare_outputs(out, ref, options, torch.float32, (hidden, weight, target, bias))
    assert_close_per_design(leaves[0].grad[:, ::2], ref_grads.hidden, kind="grad_hidden", dtype=torch.float32,
                            name="grad hidden")
    assert_close_per_design(leaves[1].grad[::2].T, ref_grads.weight, kind="grad_weight", dtype=torch.float32,
                            name="grad weight")
    assert_close_per_design(leaves[2].grad[:, 0], ref_grads.bias, kind="grad_weight", dtype=torch.float32,
                            name="grad bias")
    assert float(leaves[0].grad[:, 1::2].abs().sum()) == 0.0, "columns outside the view got gradient"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_empty_input(case: str, reduction: str, generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    hidden, weight, target, b = make_inputs((0,), HIDDEN, VOCAB, bias=True, generator=generator)
    h, w, bias = (t.requires_grad_() for t in (hidden, weight, b))
    out = flce.linear_cross_entropy(h, w, target, bias, **options)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    assert loss.shape == ((0,) if reduction == "none" else ())
    if reduction != "none":
        assert float(loss.detach()) == 0.0
    if isinstance(out, LCEOutput):
        assert out.logprobs.shape == (0,) and out.entropy.shape == (0,) and out.predicted_tokens.shape == (0,)
    total = loss.sum() + (0 if isinstance(out, torch.Tensor) else out.logprobs.sum() + out.entropy.sum())
    total.backward()
    assert h.grad.shape == (0, HIDDEN)
    assert torch.count_nonzero(w.grad) == 0 and torch.count_nonzero(bias.grad) == 0


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_all_ignored_gives_zero_loss_and_zero_grads(case: str, reduction: str, generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, bias=True, generator=generator,
                                            ignore_index=options.get("ignore_index", -100), ignore_fraction=1.1)
    upstream = upstream_for(options, TOKENS, generator)
    out, grads = flce_grads(flce.get_impl("cpu")(**options), hidden, weight, target, b, upstream)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    assert torch.count_nonzero(loss) == 0, f"all tokens ignored: loss must be 0, got {loss}"
    for name in ("hidden", "weight", "bias"):
        g = getattr(grads, name)
        assert torch.isfinite(g).all() and torch.count_nonzero(g) == 0, f"grad {name} must be exactly 0"
    if isinstance(out, LCEOutput):
        assert torch.count_nonzero(out.z_loss) == 0 and torch.count_nonzero(out.token_accuracy) == 0
        assert (out.predicted_tokens == -1).all()


def test_accum_dtype_float32_is_more_exact_over_many_chunks(generator: torch.Generator) -> None:
    """bf16 inputs, one token per chunk: an fp32 grad_weight accumulator beats bf16 adds."""
    hidden, weight, target, _ = make_inputs((64,), HIDDEN, VOCAB, dtype=torch.bfloat16, generator=generator,
                                            ignore_fraction=0.0)
    upstream = Upstream(loss=torch.tensor(1.0, dtype=torch.float64))
    _, ref = reference_grads(hidden, weight, target, None, upstream, reduction="sum")
    errors = {}
    for accum in (None, torch.float32):
        fn = flce.get_impl("cpu")(reduction="sum", accum_dtype=accum, memory_budget=1)
        _, grads = flce_grads(fn, hidden, weight, target, None, upstream)
        assert grads.weight.dtype == torch.bfloat16
        errors[accum] = relative_error(grads.weight, ref.weight)
    assert errors[torch.float32] < 1e-2, errors
    assert errors[torch.float32] < errors[None], f"fp32 accumulation should be more exact: {errors}"


def test_accum_dtype_float32_with_fp32_inputs(generator: torch.Generator) -> None:
    run_case({"accum_dtype": torch.float32, "memory_budget": 1, "label_smoothing": 0.1}, generator, bias=True)


@pytest.mark.parametrize("case", ["defaults", "everything"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_small_memory_budget_equals_large(case: str, reduction: str, generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    hidden, weight, target, b = make_inputs((40,), HIDDEN, VOCAB, bias=True, generator=generator,
                                            ignore_index=options.get("ignore_index", -100))
    upstream = upstream_for(options, (40,), generator)
    per_row = reference_bytes_per_row(prepare_inputs(hidden, weight, target, b, LCEConfig()))
    results = {}
    for budget in (3 * per_row, 1 << 30):
        module = flce.get_impl("cpu")(memory_budget=budget, **options)
        results[budget] = flce_grads(module, hidden, weight, target, b, upstream)
    (small_out, small_grads), (large_out, large_grads) = results.values()
    small_loss = small_out if isinstance(small_out, torch.Tensor) else small_out.loss
    large_loss = large_out if isinstance(large_out, torch.Tensor) else large_out.loss
    torch.testing.assert_close(small_loss, large_loss, rtol=1e-6, atol=1e-6)
    for name in ("hidden", "weight", "bias"):
        want = getattr(large_grads, name)
        # The weight and bias gradients sum the same 40 products per entry in another order (14 chunks
        # against one GEMM): an entry that cancels is off by a few ulps of the largest terms, not of
        # itself (1.1e-6 and 1.5e-6 at entries of 0.006 and 0.02, drawn seeds 1017 and 1014, under a
        # fixed atol of 1e-6).
        atol = max(1e-6, 64 * torch.finfo(want.dtype).eps * float(want.abs().max()))
        torch.testing.assert_close(getattr(small_grads, name), want, rtol=1e-5, atol=atol)


def test_plan_respects_memory_budget(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((100,), HIDDEN, VOCAB, generator=generator)
    flat = prepare_inputs(hidden, weight, target, None, LCEConfig())
    per_row = reference_bytes_per_row(flat)
    for budget in (1, per_row, 7 * per_row + 1, 1000 * per_row):
        plan = reference_plan(flat, LCEConfig(memory_budget=budget))
        assert 1 <= plan.tokens_per_chunk <= 100
        assert plan.tokens_per_chunk * per_row <= max(budget, per_row), (budget, plan)
    assert reference_plan(flat, LCEConfig()).tokens_per_chunk == 100, "a tiny call fits in one chunk by default"
    assert reference_plan(flat, LCEConfig(memory_budget=per_row)).saved_rows == 0, "no room left to save logits"


@pytest.mark.parametrize("case", ["defaults", "everything"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_deferred_saved_logits_equal_recomputed(case: str, reduction: str, generator: torch.Generator) -> None:
    """The deferred schedule (reduction none, logprobs/entropy) gives the same answer whether
    backward reuses forward's logits or recomputes them."""
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction, return_logprobs=True)
    hidden, weight, target, b = make_inputs((30,), HIDDEN, VOCAB, bias=True, generator=generator,
                                            ignore_index=options.get("ignore_index", -100))
    upstream = upstream_for(options, (30,), generator)
    cfg = LCEConfig(**options)
    results = []
    # All 30 rows kept; the first two 7-row chunks kept (16 rounds down to whole chunks), the rest
    # recomputed; none kept.
    for saved_rows in (30, 16, 0):
        def run(h, w, t, bias, saved_rows=saved_rows):
            flat = prepare_inputs(h, w, t, bias, cfg)
            call = plan_call(flat, cfg, "full" if cfg.needs_full else "plain", PlanRequest(training=True))
            plan = TokenChunks(tokens_per_chunk=7, saved_rows=saved_rows)
            return apply_eager(flat, dataclasses.replace(call, plan=plan))
        results.append(flce_grads(run, hidden, weight, target, b, upstream))
    recomputed_out, recomputed_grads = results[-1]
    rounding = fp32_rounding_bounds(hidden, weight, target, b, upstream, options)
    for saved_out, saved_grads in results[:-1]:
        for name in ("loss", "logprobs"):
            torch.testing.assert_close(getattr(saved_out, name), getattr(recomputed_out, name), rtol=0, atol=0)
        for name in ("hidden", "weight", "bias"):
            difference = (getattr(saved_grads, name).double() - getattr(recomputed_grads, name).double()).abs()
            ratio = float((difference / getattr(rounding, name).clamp_min(1e-300)).max())
            assert ratio <= 1.0, f"grad {name}: saved and recomputed logits differ by {ratio:.2f} x the fp32 bound"
    ref, ref_grads = reference_grads(hidden, weight, target, b, upstream, **options)
    for saved_out, saved_grads in results:
        compare_outputs(saved_out, ref, options, torch.float32, (hidden, weight, target, b))
        compare_grads(saved_grads, ref_grads)


def fp32_rounding_bounds(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor,
                         upstream: Upstream, options: dict[str, Any]) -> Grads:
    """Per element, how far two float32 evaluations of each gradient may differ by rounding alone.

    Each gradient element is a sum of n products of the logit gradient ``G = dL/du`` with an input
    (grad hidden: n = V terms ``G[i, j] W[j, k]``; grad weight: n = N tokens ``G[i, j] x[i, k]``;
    grad bias: n = N terms ``G[i, j]``). Summed in float32 in any order, each result is off by at
    most ``n u S`` (u = 2**-24 and S the sum of the terms' magnitudes); each term carries the
    error of its logit (a length-H dot product: ``H u`` relative to the logit's scale, which the
    inputs keep below 4 here) and of a few roundings of the softmax, so two evaluations differ by
    at most ``2 (n + 4 H + 8) u S``."""
    hidden_size, vocab = weight.shape[1], weight.shape[0]
    x = hidden.detach().double().reshape(-1, hidden_size)
    w = weight.detach().double()
    u = x @ w.T + bias.detach().double()
    # The oracle on the logits themselves (hidden = u, weight = I) gives dL/du.
    _, logit_grads = reference_grads(u.reshape(*target.shape, vocab), torch.eye(vocab, dtype=torch.float64),
                                     target, None, upstream, **options)
    g = logit_grads.hidden.reshape(-1, vocab).abs()
    unit = 2.0**-24

    def bound(n_terms: int, magnitude: torch.Tensor) -> torch.Tensor:
        return 2 * (n_terms + 4 * hidden_size + 8) * unit * magnitude

    return Grads(hidden=bound(vocab, g @ w.abs()).reshape(hidden.shape), weight=bound(x.shape[0], g.T @ x.abs()),
                 bias=bound(x.shape[0], g.sum(0)))


def test_gradients_through_logprobs_and_entropy_only(generator: torch.Generator) -> None:
    """The loss unused: gradients come from logprobs and entropy alone (RL-style use)."""
    options = {"return_logprobs": True, "return_entropy": True, "temperature": 0.9}
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, bias=True, generator=generator)
    upstream = random_upstream(torch.Size(()), torch.Size(TOKENS), logprobs=True, entropy=True, generator=generator)
    upstream.loss = torch.zeros((), dtype=torch.float64)
    h, w, bias = (t.detach().clone().requires_grad_() for t in (hidden, weight, b))
    out = flce.linear_cross_entropy(h, w, target, bias, **options)
    ((out.logprobs.double() * upstream.logprobs).sum() + (out.entropy.double() * upstream.entropy).sum()).backward()
    _, ref_grads = reference_grads(hidden, weight, target, b, upstream, **options)
    compare_grads(type(ref_grads)(h.grad, w.grad, bias.grad), ref_grads)


def test_fp64_inputs_match_oracle_tightly(generator: torch.Generator) -> None:
    options = build_options(OPTION_CASES["everything"], VOCAB, generator, reduction="mean")
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, dtype=torch.float64, bias=True,
                                            generator=generator, ignore_index=options["ignore_index"])
    upstream = upstream_for(options, TOKENS, generator)
    out, grads = flce_grads(flce.get_impl("cpu")(**options), hidden, weight, target, b, upstream)
    ref, ref_grads = reference_grads(hidden, weight, target, b, upstream, **options)
    compare_outputs(out, ref, options, torch.float64, (hidden, weight, target, b))
    for name in ("hidden", "weight", "bias"):
        assert_close_per_design(getattr(grads, name), getattr(ref_grads, name), kind="grad", dtype=torch.float64,
                                name=f"grad {name}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_oracle_agrees_with_torch_cross_entropy(reduction: str, smoothing: float, weighted: bool,
                                                generator: torch.Generator) -> None:
    """The oracle itself: without flce-only options it is torch's cross_entropy on the logits."""
    hidden, weight, target, b = make_inputs((50,), HIDDEN, VOCAB, dtype=torch.float64, bias=True,
                                            generator=generator)
    cw = random_class_weight(VOCAB, generator, torch.float64) if weighted else None
    ours = reference_loss(hidden, weight, target, b, reduction=reduction, label_smoothing=smoothing,
                          class_weight=cw).loss
    theirs = F.cross_entropy(hidden @ weight.T + b, target, weight=cw, reduction=reduction,
                             label_smoothing=smoothing)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_oracle_accepts_every_option_of_flce_and_refuses_what_flce_refuses(generator: torch.Generator) -> None:
    """flce.testing.reference_loss takes any of flce's options (those that do not change the math are
    ignored: the result is the defaults'), and a value flce refuses it refuses with flce's message, rather
    than return NaN (temperature=0)."""
    hidden, weight, target, _ = make_inputs((9,), HIDDEN, VOCAB, dtype=torch.float64, generator=generator)
    plain = reference_loss(hidden, weight, target).loss
    ignored = {"precision": "accurate", "batch_invariant": True, "return_logit_stats": True, "accum_dtype": None,
               "memory_budget": 1 << 20, "detach_extras": True, "return_logprobs": True, "return_entropy": True,
               "return_z_loss": True, "return_token_accuracy": True, "return_predicted_tokens": True}
    assert set(ignored) | {"process_group"} >= set(LCEConfig.__dataclass_fields__) - set(_MATH_OPTION_NAMES)
    torch.testing.assert_close(reference_loss(hidden, weight, target, **ignored).loss, plain, rtol=0, atol=0)
    for options, message in (({"temperature": 0.0}, "temperature=0.0: expected a value > 0"),
                             ({"softcap": -1.0}, "softcap=-1.0: expected None or a value > 0"),
                             ({"label_smoothing": 1.5}, r"label_smoothing=1.5: expected a value in \[0, 1\]")):
        with pytest.raises(ValueError, match=message):
            reference_loss(hidden, weight, target, **options)


_MATH_OPTION_NAMES = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                      "class_weight", "temperature", "token_scaling", "entropy_weight")


@pytest.mark.parametrize("block_rows", [1, 5])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["defaults", "everything", "returns"])
def test_cpu_cache_blocks(case: str, reduction: str, block_rows: int, generator: torch.Generator,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernels walk each chunk in cache-sized row blocks: small blocks, the same answer."""
    from flce.backends.reference import kernels

    monkeypatch.setattr(kernels, "CPU_BLOCK_BYTES", block_rows * VOCAB * 4)
    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction)
    run_case(options, generator, bias=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_cpu_cache_blocks_bf16(case: str, reduction: str, generator: torch.Generator,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Low-precision logits go through an fp32 copy of each block and back."""
    from flce.backends.reference import kernels

    options = build_options(OPTION_CASES[case], VOCAB, generator, reduction=reduction, return_logprobs=True)
    hidden, weight, target, b = make_inputs(TOKENS, HIDDEN, VOCAB, dtype=torch.bfloat16, bias=True,
                                            generator=generator, ignore_index=options.get("ignore_index", -100))
    upstream = upstream_for(options, TOKENS, generator)
    module = flce.get_impl("cpu")(**options)
    whole = flce_grads(module, hidden, weight, target, b, upstream)
    monkeypatch.setattr(kernels, "CPU_BLOCK_BYTES", 2 * VOCAB * 4)
    blocked = flce_grads(module, hidden, weight, target, b, upstream)
    ref = reference_loss(hidden, weight, target, b, **options)
    compare_outputs(blocked[0], ref, options, torch.bfloat16, (hidden, weight, target, b))
    for name in ("loss", "logprobs"):
        torch.testing.assert_close(getattr(blocked[0], name), getattr(whole[0], name), rtol=0, atol=0)
    for name in ("hidden", "weight", "bias"):
        torch.testing.assert_close(getattr(blocked[1], name), getattr(whole[1], name), rtol=0, atol=0)
