"""Linear distillation on the reference backend against the float64 oracle: every loss, beta, temperature,
hard-label weight, ignored rows, no target, every reduction, a teacher of another hidden size, biases,
memory budgets that force many chunks, the teacher's gradient only when asked; the checks on bad input;
the module form; and the statistics' merge across vocabulary tiles."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from distillation_helpers import assert_matches_oracle, flce_loss, make_pair, oracle, relative

import flce
from flce.distillation.config import DistillationConfig
from flce.distillation.semantics import PairStats, merge_pair_stats
from flce.distillation.tiles import tile_statistics

LOSSES = ("forward_kl", "reverse_kl", "jsd")
# 13 rows of 2 x 40 fp32 logits (plus the temporaries off the CPU): a chunk of a few rows.
MANY_CHUNKS = 1000


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("hard_label_weight", [0.0, 0.3, 1.0])
def test_every_loss_reduction_and_hard_weight(loss: str, reduction: str, hard_label_weight: float,
                                              generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True)
    assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, hard_label_weight=hard_label_weight,
                          temperature=0.7, backend="reference", memory_budget=MANY_CHUNKS)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperatures(loss: str, temperature: float, generator: torch.Generator) -> None:
    pair = make_pair(generator, scale=3.0)
    assert_matches_oracle(pair, generator, loss=loss, temperature=temperature, hard_label_weight=0.2,
                          backend="reference")


@pytest.mark.parametrize("beta", [0.05, 0.5, 0.9])
def test_jsd_betas(beta: float, generator: torch.Generator) -> None:
    pair = make_pair(generator, scale=2.0)
    assert_matches_oracle(pair, generator, loss="jsd", beta=beta, backend="reference")


@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.0), ("reverse_kl", 1.0), ("forward_kl", 0.7)])
def test_kl_divergences_take_a_beta_they_do_not_read(loss: str, beta: float, generator: torch.Generator) -> None:
    """A trainer that names the KL divergences by beta (TRL's GKD: 0 forward, 1 reverse) can pass it along."""
    pair = make_pair(generator)
    got = flce_loss(pair, loss=loss, beta=beta, backend="reference")
    torch.testing.assert_close(got, flce_loss(pair, loss=loss, backend="reference"), rtol=0, atol=0)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_teacher_gradient_when_asked(loss: str, reduction: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True)
    assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, hard_label_weight=0.4,
                          temperature=1.3, teacher_grad=True, backend="reference", memory_budget=MANY_CHUNKS)


def test_teacher_takes_no_gradient_unless_asked(generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True)
    flce_loss(pair, backend="reference").backward()
    assert pair.student_hidden.grad is not None and pair.student_weight.grad is not None
    assert pair.student_bias.grad is not None
    assert all(t.grad is None for t in (pair.teacher_hidden, pair.teacher_weight, pair.teacher_bias))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_without_target(loss: str, reduction: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, target=False, token_shape=(3, 5))
    assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, backend="reference",
                          memory_budget=MANY_CHUNKS)


def test_token_shape_and_other_ignore_index(generator: torch.Generator) -> None:
    pair = make_pair(generator, token_shape=(2, 3, 4), ignore_index=5, ignore_fraction=0.4)
    assert_matches_oracle(pair, generator, loss="reverse_kl", reduction="none", ignore_index=5, hard_label_weight=0.5,
                          backend="reference")


def test_every_row_ignored_gives_zero_and_zero_gradients(generator: torch.Generator) -> None:
    pair = make_pair(generator, ignore_fraction=1.0)
    loss = flce_loss(pair, hard_label_weight=0.5, backend="reference")
    loss.backward()
    assert loss.item() == 0.0
    assert pair.student_hidden.grad.abs().max().item() == 0.0
    assert pair.student_weight.grad.abs().max().item() == 0.0


def test_no_tokens(generator: torch.Generator) -> None:
    pair = make_pair(generator, n=0)
    loss = flce_loss(pair, backend="reference")
    loss.backward()
    assert loss.item() == 0.0 and pair.student_weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("budget", [1, 700, 5000, None])
def test_memory_budgets(budget: int | None, generator: torch.Generator) -> None:
    pair = make_pair(generator, n=29, bias=True)
    assert_matches_oracle(pair, generator, loss="jsd", hard_label_weight=0.1, backend="reference",
                          memory_budget=budget, teacher_grad=True)


def test_teacher_of_the_same_hidden_size(generator: torch.Generator) -> None:
    pair = make_pair(generator, student_size=16, teacher_size=16)
    assert_matches_oracle(pair, generator, loss="forward_kl", backend="reference")


def test_float64_is_exact(generator: torch.Generator) -> None:
    pair = make_pair(generator, dtype=torch.float64, bias=True)
    assert_matches_oracle(pair, generator, rtol=1e-10, loss="jsd", hard_label_weight=0.3, temperature=0.8,
                          backend="reference", teacher_grad=True, memory_budget=MANY_CHUNKS)


def _eager_bfloat16(pair, **options) -> torch.Tensor:
    """The materialised formula run in bfloat16, as a user's eager PyTorch would: the error flce must stay within."""
    to16 = [None if t is None else t.detach().bfloat16().requires_grad_(t.requires_grad) for t in pair.leaves]
    xs, ws, _, xt, wt, _ = to16
    temperature = options.get("temperature", 1.0)
    log_q = torch.log_softmax(xs @ ws.T / temperature, dim=-1)
    log_p = torch.log_softmax(xt @ wt.T / temperature, dim=-1)
    beta = options.get("beta", 0.5)
    log_m = torch.logaddexp(log_p + torch.tensor(beta).log(), log_q + torch.tensor(1 - beta).log())
    rows = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
    return rows.mean(), (xs, ws)


def test_bfloat16_within_eager_bfloat16_error(generator: torch.Generator) -> None:
    pair = make_pair(generator, n=64, student_size=32, teacher_size=48, vocab=256, target=False, scale=3.0)
    reference = pair.detached()
    expected = oracle(reference)
    want = torch.autograd.grad(expected, (reference.student_hidden, reference.student_weight))
    eager, leaves = _eager_bfloat16(pair)
    eager_grads = torch.autograd.grad(eager.float(), leaves)
    ours = pair.detached()
    ours = type(ours)(*(None if t is None else t.detach().bfloat16().requires_grad_(t.requires_grad)
                        for t in ours.leaves), None)
    loss = flce_loss(ours, backend="reference")
    grads = torch.autograd.grad(loss, (ours.student_hidden, ours.student_weight))
    assert abs(loss.item() - expected.item()) <= 1.5 * max(abs(eager.item() - expected.item()), 1e-3 * expected.item())
    for got, ref, w in zip(grads, eager_grads, want, strict=True):
        assert relative(got, w) <= 1.5 * relative(ref, w), (relative(got, w), relative(ref, w))


def test_merge_across_vocabulary_tiles_equals_one_scan(generator: torch.Generator) -> None:
    """The statistics are mergeable: three tiles' merged equal the whole row's (module semantics' claim)."""
    for loss in LOSSES:
        cfg = DistillationConfig(loss=loss, hard_label_weight=0.5, temperature=0.6)
        u_t, u_s = torch.randn(5, 30, generator=generator, dtype=torch.float64) * 4, torch.randn(
            5, 30, generator=generator, dtype=torch.float64) * 4
        target = torch.randint(0, 30, (5,), generator=generator)
        whole = PairStats.from_partial(tile_statistics(u_t, u_s, target, cfg), cfg)
        merged = None
        for start, stop in ((0, 7), (7, 19), (19, 30)):
            cols = torch.where((target >= start) & (target < stop), target - start, -1)
            part = tile_statistics(u_t[:, start:stop], u_s[:, start:stop], cols, cfg)
            merged = part if merged is None else merge_pair_stats(merged, part, cfg)
        merged = PairStats.from_partial(merged, cfg)
        for name in ("teacher_max", "teacher_log_sum", "student_max", "student_log_sum", "cross_mean", "hard_lse",
                     "target_logit"):
            a, b = getattr(whole, name), getattr(merged, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=f"{loss} {name}")


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"loss": "kl"}, ValueError, "loss='kl': expected one of"),
    ({"beta": 0.0}, ValueError, r"beta=0.0: expected a value in the open interval \(0, 1\)"),
    ({"beta": 1.0}, ValueError, "beta=1.0"),
    ({"loss": "forward_kl", "beta": 1.5}, ValueError,
     r"beta=1.5: expected a value in \[0, 1\] \(loss='forward_kl' does not use it\)"),
    ({"temperature": 0.0}, ValueError, "temperature=0.0: expected a value > 0"),
    ({"temperature": -1.0}, ValueError, "temperature=-1.0"),
    ({"hard_label_weight": 1.5}, ValueError, r"hard_label_weight=1.5: expected a value in \[0, 1\]"),
    ({"reduction": "avg"}, ValueError, "reduction='avg'"),
    ({"memory_budget": 0}, ValueError, "memory_budget=0"),
    ({"teacher_grad": 1}, TypeError, "teacher_grad=1: expected a bool"),
    ({"beta": "half"}, TypeError, "beta='half': expected a finite real number"),
])
def test_bad_options_fail_before_compute(options: dict, error: type, match: str, generator: torch.Generator,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pair = make_pair(generator)
    _no_kernel_may_run(monkeypatch)
    with pytest.raises(error, match=match) as raised:
        flce_loss(pair, backend="reference", **options)
    assert isinstance(raised.value, RuntimeError), "flce's input errors are RuntimeErrors too (docs/usage.md)"


def _no_kernel_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran before the input check")

    from flce.backends.reference.distillation import ReferencePairKernels

    monkeypatch.setattr(ReferencePairKernels, "pair_stats", refuse)
    monkeypatch.setattr(torch, "mm", refuse)


@pytest.mark.parametrize(("change", "error", "match"), [
    ("vocab", ValueError, "teacher_weight: has vocabulary 41 but student_weight has 40"),
    ("tokens", ValueError, "teacher_hidden: has 12 tokens"),
    ("teacher_size", ValueError, r"teacher_hidden: last dimension is 11 but teacher_weight is \[V=40, H=12\]"),
    ("target_shape", ValueError, "target: has shape"),
    ("target_dtype", TypeError, "target: expected an integer tensor"),
    ("target_range", ValueError, "target contains 40, outside"),
    ("hard_without_target", ValueError, "hard_label_weight=0.5: the hard-label term needs target"),
    ("dtype", TypeError, "teacher_hidden has dtype torch.float64 but student_hidden has dtype torch.float32"),
    ("bias", ValueError, r"teacher_bias: expected shape \[V=40\]"),
])
def test_bad_inputs_fail_before_compute(change: str, error: type, match: str, generator: torch.Generator,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pair = make_pair(generator, bias=True)
    options = {}
    if change == "vocab":
        pair.teacher_weight = torch.randn(41, 12)
        pair.teacher_bias = None
    elif change == "tokens":
        pair.teacher_hidden = torch.randn(12, 12)
    elif change == "teacher_size":
        pair.teacher_hidden = torch.randn(13, 11)
    elif change == "target_shape":
        pair.target = pair.target[:5]
    elif change == "target_dtype":
        pair.target = pair.target.float()
    elif change == "target_range":
        pair.target[3] = 40
    elif change == "hard_without_target":
        pair.target = None
        options["hard_label_weight"] = 0.5
    elif change == "dtype":
        pair.teacher_hidden = pair.teacher_hidden.detach().double()
    elif change == "bias":
        pair.teacher_bias = torch.randn(39)
    _no_kernel_may_run(monkeypatch)
    with pytest.raises(error, match=match) as raised:
        flce_loss(pair, backend="reference", **options)
    assert isinstance(raised.value, RuntimeError), "flce's input errors are RuntimeErrors too (docs/usage.md)"


def test_module_form_and_pickle(generator: torch.Generator) -> None:
    cls = flce.get_distillation_impl("cpu", backend="reference")
    assert cls is flce.get_distillation_impl("cpu", backend="reference")
    module = cls(loss="reverse_kl", temperature=1.5, hard_label_weight=0.25)
    pair = make_pair(generator, bias=True)
    got = module(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight, pair.target,
                 student_bias=pair.student_bias, teacher_bias=pair.teacher_bias)
    want = oracle(pair, loss="reverse_kl", temperature=1.5, hard_label_weight=0.25)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    again = pickle.loads(pickle.dumps(module))
    assert type(again) is cls and again.config == module.config
    with pytest.raises(TypeError, match="got an unexpected option 'betta'; did you mean 'beta'"):
        cls(betta=0.2)


def test_retained_graph_backward_twice(generator: torch.Generator) -> None:
    pair = make_pair(generator)
    loss = flce_loss(pair, backend="reference")
    first = torch.autograd.grad(loss, pair.student_weight, retain_graph=True)[0]
    second = torch.autograd.grad(loss, pair.student_weight)[0]
    torch.testing.assert_close(first, second)
    with pytest.raises(RuntimeError, match="a second time"):
        loss2 = flce_loss(pair, backend="reference")
        loss2.backward()
        loss2.backward()


def test_no_grad_forward_equals_training_forward(generator: torch.Generator) -> None:
    pair = make_pair(generator)
    with torch.no_grad():
        inferred = flce_loss(pair, loss="jsd", backend="reference", reduction="none")
    trained = flce_loss(pair, loss="jsd", backend="reference", reduction="none")
    torch.testing.assert_close(inferred, trained.detach())


def test_backend_without_distillation_kernels_is_refused(isolated_registry: None, generator: torch.Generator) -> None:
    from flce.backends.reference import BACKEND
    from flce.registry import Backend, register_backend

    register_backend(Backend(name="ce-only", device_types=("any",), priority=-1, is_available=BACKEND.is_available,
                             supports=BACKEND.supports, plan_call=BACKEND.plan_call, choose=BACKEND.choose))
    pair = make_pair(generator)
    with pytest.raises(ValueError, match="backend 'ce-only' has no linear distillation kernels"):
        flce_loss(pair, backend="ce-only")
    with pytest.raises(ValueError, match="backend='ce-only': has no linear distillation kernels"):
        flce.get_distillation_impl("cpu", backend="ce-only")


def test_a_better_backend_without_distillation_kernels_is_passed_over_with_one_warning(
        isolated_registry: None, generator: torch.Generator) -> None:
    """Selection skips a higher-priority backend that has no distillation kernels, says so once (as the
    cross-entropy's selection does), and refuses it by name with flce's input error (a ValueError and a
    RuntimeError, as torch's own errors are caught)."""
    from flce.backends.reference import BACKEND
    from flce.registry import Backend, register_backend

    register_backend(Backend(name="ce-first", device_types=("any",), priority=1_000, is_available=BACKEND.is_available,
                             supports=BACKEND.supports, plan_call=BACKEND.plan_call, choose=BACKEND.choose))
    pair = make_pair(generator)
    with pytest.warns(RuntimeWarning, match="linear distillation using the 'reference' backend because a better one "
                                            r"was passed over \(ce-first: no linear distillation kernels\)"):
        flce_loss(pair)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flce_loss(pair)  # warned once
    with pytest.raises(RuntimeError, match="backend 'ce-first' has no linear distillation kernels"):
        flce_loss(pair, backend="ce-first")
