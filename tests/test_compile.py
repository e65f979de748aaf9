"""flce under torch.compile, on the CPU.

The custom ops pass ``torch.library.opcheck``; a step that calls flce (module or functional
form) compiles with ``fullgraph=True`` into one graph, and its loss, extras and gradients
(backward included) equal eager flce's and the float64 materialised oracle's.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    # The CUDA backend's kernels run under the Triton interpreter here; set before triton loads
    # (torch._dynamo.testing imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch._dynamo.testing
from helpers import assert_close_per_design, backward_surrogate, random_upstream, reference_loss

import flce
from flce.backends.reference.plan import plan_call
from flce.config import LCEConfig, primitive_options
from flce.engine import custom_ops
from flce.engine.custom_ops import apply_op
from flce.engine.function import apply_eager
from flce.engine.plans import PlanRequest
from flce.inputs import prepare_inputs
from flce.registry import Backend, HardwareProbe, register_backend
from flce.registry import probes as probe_module

N, H, V = 13, 8, 24
# Small enough that the reference plan splits 13 rows into chunks of 3 (multi-chunk paths).
SMALL_BUDGET = 1000


def _inputs(generator: torch.Generator, *, bias: bool = True, grads: tuple[bool, bool, bool] = (True, True, True),
            n: int = N):
    x = torch.randn(n, H, generator=generator).requires_grad_(grads[0])
    w = (torch.randn(V, H, generator=generator) / H**0.25).requires_grad_(grads[1])
    b = torch.randn(V, generator=generator).requires_grad_(grads[2]) if bias else None
    t = torch.randint(0, V, (n,), generator=generator)
    t[torch.rand(n, generator=generator) < 0.25] = -100
    return x, w, b, t


def _class_weight(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(V, generator=generator) + 0.5


# (variant, options, has bias, which inputs require grad)
OPCHECK_CASES = {
    "plain-mean": ("plain", {}, True, (True, True, True)),
    "plain-none-deferred": ("plain", {"reduction": "none", "memory_budget": SMALL_BUDGET}, True, (True, True, True)),
    "full-none-logprobs-entropy": (
        "full", {"reduction": "none", "return_logprobs": True, "return_entropy": True, "temperature": 0.7,
                 "softcap": 3.0, "label_smoothing": 0.1, "class_weight": "random"}, True, (True, True, True)),
    "full-sum-hidden-only": (
        "full", {"reduction": "sum", "lse_square_scale": 1e-3, "return_z_loss": True, "token_scaling": True,
                 "return_token_accuracy": True, "return_predicted_tokens": True}, False, (True, False, False)),
    "full-mean-deferred-chunks": (
        "full", {"return_logprobs": True, "return_entropy": True, "accum_dtype": torch.float32,
                 "memory_budget": SMALL_BUDGET}, True, (False, True, True)),
    "no-grad": ("plain", {}, True, (False, False, False)),
    "full-mean-token-weights-entropy": (
        "full", {"token_weights": "random", "entropy_weight": 0.05, "temperature": 0.7}, True, (True, True, True)),
    "full-none-token-weights-deferred": (
        "full", {"reduction": "none", "token_weights": "random", "entropy_weight": -0.1, "return_entropy": True,
                 "memory_budget": SMALL_BUDGET}, False, (True, True, False)),
    "full-mean-detached-extras": (
        "full", {"token_weights": "random", "entropy_weight": 0.05, "return_logprobs": True, "return_entropy": True,
                 "detach_extras": True, "memory_budget": SMALL_BUDGET}, True, (True, True, True)),
    "full-mean-token-weights-temperature": (
        "full", {"token_weights": "random", "temperature": 0.7}, False, (True, True, False)),
}


def _options(options: dict, generator: torch.Generator, n: int = N) -> dict:
    options = dict(options)
    if options.get("class_weight") == "random":
        options["class_weight"] = _class_weight(generator)
    if options.get("token_weights") == "random":  # advantages: either sign
        options["token_weights"] = torch.randn(n, generator=generator)
    return options


def _config_and_token_weights(options: dict, generator: torch.Generator) -> tuple[LCEConfig, torch.Tensor | None]:
    options = _options(options, generator)
    token_weights = options.pop("token_weights", None)
    return LCEConfig(**options), token_weights


def _op_kwargs(variant: str, cfg: LCEConfig, bias: torch.Tensor | None, grads: tuple[bool, bool, bool]) -> dict:
    return dict(backend="reference", variant=variant, group_name=None, grad_hidden=grads[0], grad_weight=grads[1],
                grad_bias=grads[2] and bias is not None, **primitive_options(cfg))


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_forward(case: str, generator: torch.Generator) -> None:
    variant, options, has_bias, grads = OPCHECK_CASES[case]
    cfg, token_weights = _config_and_token_weights(options, generator)
    x, w, b, t = _inputs(generator, bias=has_bias, grads=grads)
    torch.library.opcheck(torch.ops.flce.chunked_forward.default, (x, w, b, t, cfg.class_weight, token_weights),
                          _op_kwargs(variant, cfg, b, grads))


@pytest.mark.parametrize("case", ["plain-none-deferred", "full-none-logprobs-entropy", "full-mean-deferred-chunks",
                                  "full-none-token-weights-deferred"])
def test_opcheck_backward(case: str, generator: torch.Generator) -> None:
    variant, options, has_bias, grads = OPCHECK_CASES[case]
    cfg, token_weights = _config_and_token_weights(options, generator)
    x, w, b, t = _inputs(generator, bias=has_bias, grads=(False, False, False))
    kwargs = _op_kwargs(variant, cfg, b, grads)
    outputs = torch.ops.flce.chunked_forward(x, w, b, t, cfg.class_weight, token_weights, **kwargs)
    lse, target_z, lse_minus_mean_z = outputs[9:12]
    assert lse.shape == (N,), "the deferred schedule must hand its row statistics to backward"
    grad_loss = torch.randn(outputs[0].shape, generator=generator)
    grad_logprobs = torch.randn(N, generator=generator) if cfg.return_logprobs else None
    grad_entropy = torch.randn(N, generator=generator) if cfg.return_entropy else None
    torch.library.opcheck(
        torch.ops.flce.chunked_backward.default,
        (x, w, b, t, cfg.class_weight, token_weights, lse, target_z, lse_minus_mean_z, grad_loss, grad_logprobs,
         grad_entropy), kwargs,
    )


# Option sets of the compiled-step tests: the in-forward schedule, the deferred one with
# differentiable extras, and the full variant's math options together.
STEP_OPTIONS = {
    "plain-mean": {},
    "none-logprobs-entropy": {"reduction": "none", "return_logprobs": True, "return_entropy": True,
                              "temperature": 0.7, "memory_budget": SMALL_BUDGET},
    "full-math": {"softcap": 2.5, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "class_weight": "random",
                  "token_scaling": True, "return_z_loss": True, "return_token_accuracy": True,
                  "return_predicted_tokens": True},
    "rl-objective": {"token_weights": "random", "entropy_weight": 0.05, "temperature": 0.7,
                     "memory_budget": SMALL_BUDGET},
    "rl-objective-deferred": {"reduction": "none", "token_weights": "random", "entropy_weight": 0.05,
                              "return_logprobs": True, "temperature": 0.7},
    "rl-objective-detached-extras": {"token_weights": "random", "entropy_weight": 0.05, "temperature": 0.7,
                                     "return_logprobs": True, "return_entropy": True, "detach_extras": True,
                                     "memory_budget": SMALL_BUDGET},
    # no entropy term: on the CUDA backend the chunks keep exponentials (tests/test_exp_grad.py)
    "rl-objective-without-entropy": {"token_weights": "random", "temperature": 0.7, "memory_budget": SMALL_BUDGET},
}


@pytest.fixture(params=["cpu", "claims-accelerators"])
def machine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compile tests run twice on the CPU: as they are, and on a machine that claims CUDA, an
    NPU and Triton (FLCE_PROBE_OVERRIDE), where the hardware probe and a registered backend's
    availability and support checks each call torch._dynamo.graph_break(). That call does
    nothing when run, and breaks any graph it is traced into: under fullgraph=True a probe, a
    find_spec, a device query or any selection logic that leaks into the trace fails the test,
    as it fails on a GPU machine, where the real probes take the branches a CPU machine skips."""
    if request.param == "cpu":
        return request.param
    request.getfixturevalue("isolated_registry")
    monkeypatch.setenv(probe_module.PROBE_ENV, "cuda=1,npu=1,triton=1")
    real_probe = probe_module._real_probe

    def tripwire_probe() -> HardwareProbe:
        torch._dynamo.graph_break()
        return real_probe()

    def tripwire_available(_probe: HardwareProbe) -> tuple[bool, str]:
        torch._dynamo.graph_break()
        return True, "tripwire"

    def tripwire_supports(_cfg: LCEConfig, _dtype: torch.dtype, _hidden: int, _vocab: int) -> tuple[bool, str]:
        torch._dynamo.graph_break()
        return False, "the tripwire backend declines every call"

    def never_runs(*_args: object) -> torch.Tensor:
        raise AssertionError("the tripwire backend declines every call; it must never run")

    monkeypatch.setattr(probe_module, "_real_probe", tripwire_probe)
    register_backend(Backend(name="tripwire", device_types=("cpu",), priority=1000,
                             is_available=tripwire_available, supports=tripwire_supports, run=never_runs))
    # Selection warns (once) that the reference backend serves the calls the tripwire declines.
    warnings.filterwarnings("ignore", message="flce: using the 'reference' backend", category=RuntimeWarning)
    return request.param


def _make_step(form: str, options: dict):
    if form == "module":
        options = dict(options)
        token_weights = options.pop("token_weights", None)  # a keyword of the call, not of the constructor
        loss_fn = flce.get_impl("cpu")(**options)

        def step(x, w, t, b):
            return loss_fn(x, w, t, b, token_weights=token_weights)
    else:
        def step(x, w, t, b):
            return flce.linear_cross_entropy(x, w, t, b, **options)
    return step


def _differentiable(out, name: str) -> bool:
    """Whether the call returned output ``name`` differentiable (detach_extras=True returns the extras detached)."""
    value = None if isinstance(out, torch.Tensor) else getattr(out, name)
    return value is not None and value.requires_grad


def _run(step, inputs, upstream_seed: int):
    """Outputs and the gradients of x, w, b under random upstream gradients (to the differentiable outputs)."""
    x, w, b, t = (None if a is None else a.detach().requires_grad_(a.requires_grad) for a in inputs)
    out = step(x, w, t, b)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    upstream = random_upstream(loss.shape, t.shape, logprobs=_differentiable(out, "logprobs"),
                               entropy=_differentiable(out, "entropy"),
                               generator=torch.Generator().manual_seed(upstream_seed))
    backward_surrogate(out, upstream).backward()
    return out, (x.grad, w.grad, None if b is None else b.grad)


def _fields(out) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"loss": out}
    return {name: value for name, value in out._asdict().items() if value is not None}


@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("case", sorted(STEP_OPTIONS))
def test_compiled_step_matches_eager_and_oracle(form: str, case: str, machine: str,
                                                generator: torch.Generator) -> None:
    options = _options(STEP_OPTIONS[case], generator)
    inputs = _inputs(generator)
    step = _make_step(form, options)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out_c, grads_c = _run(compiled, inputs, upstream_seed=7)
    out_e, grads_e = _run(step, inputs, upstream_seed=7)

    fields_c, fields_e = _fields(out_c), _fields(out_e)
    assert fields_c.keys() == fields_e.keys()
    assert type(out_c) is type(out_e), "the compiled call must return what the eager one returns"
    for name in fields_e:
        torch.testing.assert_close(fields_c[name], fields_e[name], rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for name, gc, ge in zip(("hidden", "weight", "bias"), grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"grad {name}: {m}")

    # And both against the float64 oracle.
    x, w, b, t = (a.detach().double().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in inputs)
    oracle = reference_loss(x, w, t, b, **options)
    for name in ("logprobs", "entropy"):
        assert _differentiable(out_c, name) == _differentiable(out_e, name), f"{name}: compiled and eager differ"
    upstream = random_upstream(oracle.loss.shape, t.shape, logprobs=_differentiable(out_c, "logprobs"),
                               entropy=_differentiable(out_c, "entropy"), generator=torch.Generator().manual_seed(7))
    backward_surrogate(oracle, upstream).backward()
    for name, value in fields_c.items():
        assert_close_per_design(value, getattr(oracle, name).detach(), kind="forward", dtype=torch.float32, name=name)
    for name, got, want in zip(("hidden", "weight", "bias"), grads_c, (x.grad, w.grad, b.grad), strict=True):
        assert_close_per_design(got, want, kind=f"grad_{'hidden' if name == 'hidden' else 'weight'}",
                                dtype=torch.float32, name=f"grad {name}")


@pytest.mark.parametrize("case", ["plain-mean", "none-logprobs-entropy"])
def test_inductor_compiled_step_matches_eager(case: str, generator: torch.Generator) -> None:
    """Inductor too (it is what torch.compile uses by default); one schedule each."""
    options = _options(STEP_OPTIONS[case], generator)
    inputs = _inputs(generator)
    step = _make_step("module", options)
    torch._dynamo.reset()
    out_c, grads_c = _run(torch.compile(step, fullgraph=True), inputs, upstream_seed=3)
    out_e, grads_e = _run(step, inputs, upstream_seed=3)
    for name, value in _fields(out_e).items():
        torch.testing.assert_close(_fields(out_c)[name], value, rtol=1e-5, atol=1e-6)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)


def test_inductor_backward_scales_in_forward_gradients_over_their_own_buffers(
        monkeypatch: pytest.MonkeyPatch, generator: torch.Generator) -> None:
    """The in-forward schedule under Inductor: forward's op computes the unscaled gradients, and
    the backward graph writes grad_output times them over those very buffers (AOTAutograd donates
    them to it), so no V x H gradient is allocated a second time. Checked with grad_output 3 and
    exactly 1, against eager flce and the float64 oracle."""
    produced = []
    real_run_forward = custom_ops.run_forward

    def recording_run_forward(*args, **kwargs):
        state = real_run_forward(*args, **kwargs)
        if state.grads is not None:
            produced.append(state.grads)
        return state

    monkeypatch.setattr(custom_ops, "run_forward", recording_run_forward)
    x, w, b, t = _inputs(generator)
    loss_fn = flce.get_impl("cpu")(label_smoothing=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    for scale in (3.0, 1.0):
        produced.clear()
        grads_c = torch.autograd.grad(compiled(x, w, t, b), (x, w, b), torch.tensor(scale))
        assert len(produced) == 1, "the compiled call should run the in-forward schedule once"
        for name, got, buffer in zip(("hidden", "weight", "bias"), grads_c, produced[0], strict=True):
            assert got.data_ptr() == buffer.data_ptr(), (
                f"grad {name} (grad_output {scale}): the compiled backward wrote the scaled gradient into "
                "a new buffer instead of over the one forward produced")

        grads_e = torch.autograd.grad(loss_fn(x, w, t, b), (x, w, b), torch.tensor(scale))
        xs, ws, bs = (a.detach().double().requires_grad_() for a in (x, w, b))
        oracle = reference_loss(xs, ws, t, bs, label_smoothing=0.1).loss
        grads_o = torch.autograd.grad(oracle, (xs, ws, bs), torch.tensor(scale, dtype=torch.float64))
        for name, gc, ge, go in zip(("hidden", "weight", "bias"), grads_c, grads_e, grads_o, strict=True):
            torch.testing.assert_close(gc, ge, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"grad {name}: {m}")
            assert_close_per_design(gc, go, kind=f"grad_{'hidden' if name == 'hidden' else 'weight'}",
                                    dtype=torch.float32, name=f"grad {name} (grad_output {scale})")


@contextlib.contextmanager
def _no_donated_buffers():
    """Inductor's donated buffers off, and the compile caches with them (see below)."""
    with (torch._functorch.config.patch(donated_buffer=False, enable_autograd_cache=False),
          torch._inductor.config.patch(fx_graph_cache=False)):
        yield


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_retained_compiled_graph_backward_twice_matches_the_oracle(reduction: str, backend: str,
                                                                   generator: torch.Generator) -> None:
    """A second backward through a retained compiled graph, with another grad_output: the compile
    path scales the in-forward gradients out of place (mean) and recomputes deferred ones (none),
    so each backward equals float64 autograd through the oracle.

    Inductor's donated buffers refuse a retained graph whose backward was compiled before (torch's
    own compiled cross_entropy too; say from the on-disk cache), and torch's message says to switch
    them off, as here. With them off, torch 2.13's caches still hand out a backward compiled with
    them on (the cache key leaves donated_buffer out), one that writes over the saved gradients: a
    torch bug that turns the second backward silently wrong, hence the caches off too."""
    x, w, b, t = _inputs(generator)
    loss_fn = flce.get_impl("cpu")(reduction=reduction, label_smoothing=0.1)
    torch._dynamo.reset()
    with _no_donated_buffers():
        loss = torch.compile(loss_fn, backend=backend, fullgraph=True)(x, w, t, b)
    upstreams = [torch.randn(loss.shape, generator=generator) + 0.5 for _ in range(2)]
    with _no_donated_buffers():
        first = torch.autograd.grad(loss, (x, w, b), upstreams[0], retain_graph=True)
        second = torch.autograd.grad(loss, (x, w, b), upstreams[1])
    leaves = [a.detach().double().requires_grad_() for a in (x, w, b)]
    oracle = reference_loss(leaves[0], leaves[1], t, leaves[2], reduction=reduction, label_smoothing=0.1).loss
    for upstream, got in ((upstreams[0], first), (upstreams[1], second)):
        want = torch.autograd.grad(oracle, leaves, upstream.double(), retain_graph=True)
        for name, g, o in zip(("hidden", "weight", "bias"), got, want, strict=True):
            assert_close_per_design(g, o, kind=f"grad_{'hidden' if name == 'hidden' else 'weight'}",
                                    dtype=torch.float32, name=f"grad {name}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batched_gradients_through_a_compiled_call_equal_a_loop(reduction: str, generator: torch.Generator) -> None:
    """is_grads_batched=True through the custom ops (aot_eager: Inductor's compiled backward takes
    no batched tensors, for torch's own compiled cross_entropy either): each batch entry equals
    its own backward."""
    x, w, b, t = _inputs(generator)
    torch._dynamo.reset()
    compiled = torch.compile(flce.get_impl("cpu")(reduction=reduction, label_smoothing=0.1), backend="aot_eager",
                             fullgraph=True)
    loss = compiled(x, w, t, b)
    upstreams = torch.randn(3, *loss.shape, generator=generator)
    with _no_donated_buffers():
        batched = torch.autograd.grad(loss, (x, w, b), upstreams, retain_graph=True, is_grads_batched=True)
        for i, upstream in enumerate(upstreams):
            one = torch.autograd.grad(loss, (x, w, b), upstream, retain_graph=True)
            for name, got, want in zip(("hidden", "weight", "bias"), batched, one, strict=True):
                torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, name=name, i=i: f"batch entry {i}, grad {name}: {m}")


@pytest.mark.parametrize("form", ["module", "functional"])
def test_explain_shows_one_graph(form: str, machine: str, generator: torch.Generator) -> None:
    step = _make_step(form, {"label_smoothing": 0.1, "return_logprobs": True})
    x, w, b, t = _inputs(generator)

    def train_step(x, w, t, b):
        out = step(x, w, t, b)
        return out.loss + 0.1 * out.logprobs.sum()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(train_step)(x, w, t, b)
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("form", ["module", "functional"])
def test_unavailable_backend_fails_with_flce_error_under_compile(form: str, monkeypatch: pytest.MonkeyPatch,
                                                                 generator: torch.Generator) -> None:
    """With the probes claiming an NPU but no triton-ascend installed, the Ascend backend is not
    available: the compiled call stops with selection's own error (Dynamo wraps it, message intact),
    not with Dynamo refusing to trace the availability check's file-system probe."""
    monkeypatch.setenv(probe_module.PROBE_ENV, "cuda=1,npu=1,triton=1")
    x, w, b, t = _inputs(generator)
    if form == "module":
        with pytest.raises(RuntimeError, match="backend is not available"):
            flce.get_impl("cpu", backend="ascend")
        return
    with pytest.raises(RuntimeError, match="backend is not available"):
        flce.linear_cross_entropy(x, w, t, b, backend="ascend")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t, b: flce.linear_cross_entropy(x, w, t, b, backend="ascend"),
                             backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="backend='ascend': backend is not available"):
        compiled(x, w, t, b)


def test_frozen_weight_and_grad_accumulation(generator: torch.Generator) -> None:
    """Only hidden trains (weight frozen): the op skips grad_weight; two compiled steps accumulate."""
    x, w, _, t = _inputs(generator, bias=False, grads=(True, False, False))
    loss_fn = flce.get_impl("cpu")(reduction="sum")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: loss_fn(x, w, t), backend="aot_eager", fullgraph=True)
    for _ in range(2):
        compiled(x, w, t).backward()
    assert w.grad is None
    xs = x.detach().double().requires_grad_()
    reference_loss(xs, w.double(), t, reduction="sum").loss.backward()
    assert_close_per_design(x.grad, 2 * xs.grad, kind="grad_hidden", dtype=torch.float32, name="grad hidden")


def test_compiled_inference_without_grad(generator: torch.Generator) -> None:
    x, w, b, t = _inputs(generator)
    loss_fn = flce.get_impl("cpu")(return_entropy=True)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(x, w, t, b)
    assert not out.loss.requires_grad
    oracle = reference_loss(x.double(), w.double(), t, b.double())
    assert_close_per_design(out.loss, oracle.loss, kind="forward", dtype=torch.float32, name="loss")
    assert_close_per_design(out.entropy, oracle.entropy, kind="forward", dtype=torch.float32, name="entropy")


def test_autocast_region_compiles(generator: torch.Generator) -> None:
    """Under autocast the inputs are cast before the op; compiled and eager agree."""
    x, w, _, t = _inputs(generator, bias=False)
    loss_fn = flce.get_impl("cpu")(reduction="none", return_logprobs=True)

    def step(x, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = loss_fn(x, w, t)
        return 2 * out.loss.sum() + out.logprobs.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, w, t), step(x, w, t)
    torch.testing.assert_close(got, want)
    for g_got, g_want in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w)), strict=True):
        assert g_want.abs().sum() > 0
        torch.testing.assert_close(g_got, g_want)


def test_dynamic_token_count_compiles_once(generator: torch.Generator) -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss_fn = flce.get_impl("cpu")(reduction="none", return_logprobs=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: loss_fn(x, w, t), backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for n in (11, 17, 20):
        x, w, _, t = _inputs(generator, bias=False, n=n)
        out = compiled(x, w, t)
        oracle = reference_loss(x.double(), w.double(), t, reduction="none")
        assert_close_per_design(out.loss, oracle.loss, kind="forward", dtype=torch.float32, name=f"loss n={n}")
        assert_close_per_design(out.logprobs, oracle.logprobs, kind="forward", dtype=torch.float32, name="logprobs")
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], f"recompiled for a new token count: frames compiled after each call {frames}"


def test_target_out_of_range_is_checked_inside_the_op(generator: torch.Generator) -> None:
    x, w, b, t = _inputs(generator)
    t[4] = V + 3
    loss_fn = flce.get_impl("cpu")()
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=f"target contains {V + 3}, outside \\[0, {V}\\)"):
        compiled(x, w, t, b)


def test_op_path_equals_function_path_in_eager(generator: torch.Generator) -> None:
    """The op (recomputing logits in backward) and the Function (which may keep them) agree."""
    options = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "softcap": 4.0}
    cfg = LCEConfig(**options)
    x, w, b, t = _inputs(generator)
    results = []
    for use_op in (False, True):
        xs, ws, bs = (a.detach().requires_grad_() for a in (x, w, b))
        flat = prepare_inputs(xs, ws, t, bs, cfg)
        call = plan_call(flat, cfg, "full", PlanRequest(training=True))
        assert call.plan.saved_rows == t.numel(), "the Function should keep the logits at this size"
        out = apply_op("reference", flat, cfg, "full") if use_op else apply_eager(flat, call)
        upstream = random_upstream(out.loss.shape, t.shape, logprobs=True, entropy=True,
                                   generator=torch.Generator().manual_seed(5))
        backward_surrogate(out, upstream).backward()
        results.append((out.loss, out.logprobs, out.entropy, xs.grad, ws.grad, bs.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_op_rejects_unknown_backend(generator: torch.Generator) -> None:
    x, w, b, t = _inputs(generator, grads=(False, False, False))
    kwargs = _op_kwargs("plain", LCEConfig(), b, (False, False, False))
    kwargs["backend"] = "no-such-backend"
    with pytest.raises(ValueError, match="backend='no-such-backend': expected a registered engine backend"):
        torch.ops.flce.chunked_forward(x, w, b, t, None, None, **kwargs)


@pytest.mark.triton
def test_cuda_backend_kernels_compile_under_the_interpreter(generator: torch.Generator) -> None:
    """The CUDA backend's entry point through the op: here its Triton kernels run interpreted on CPU
    tensors (on a GPU machine they run for real on CUDA tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = {"label_smoothing": 0.1, "return_logprobs": True, "return_entropy": True}
    loss_fn = flce.get_impl(device, backend="cuda")(**options)
    inputs = tuple(None if a is None else a.detach().to(device).requires_grad_(a.requires_grad)
                   for a in _inputs(generator, bias=False))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    out_c, grads_c = _run(lambda x, w, t, b: compiled(x, w, t, b), inputs, upstream_seed=11)
    out_e, grads_e = _run(lambda x, w, t, b: loss_fn(x, w, t, b), inputs, upstream_seed=11)
    for name, value in _fields(out_e).items():
        torch.testing.assert_close(_fields(out_c)[name], value, rtol=1e-5, atol=1e-5)
    for gc, ge in zip(grads_c[:2], grads_e[:2], strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_cuda_backend_kept_exponentials_compile_under_the_interpreter(generator: torch.Generator,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The RL objective without an entropy term through the op on the CUDA backend, its chunks keeping exponentials
    (counted): one compiled graph (aot_eager, fullgraph) equal to eager and to the float64 oracle. Triton kernels
    interpreted on CPU tensors; on a GPU machine they run for real."""
    from flce.autotune import override_params
    from flce.backends.cuda import ops
    from flce.testing import reference_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    real = ops.TritonChunkKernels.gemm_exp_grad
    monkeypatch.setattr(ops.TritonChunkKernels, "gemm_exp_grad",
                        lambda self, hidden, *a, **k: calls.append(hidden.shape[0]) or real(self, hidden, *a, **k))
    x, w, _, t = (None if a is None else a.detach().to(device).requires_grad_(a.requires_grad)
                  for a in _inputs(generator, bias=False))
    adv = torch.randn(N, generator=generator).to(device)
    loss_fn = flce.get_impl(device, backend="cuda")(temperature=0.7)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: loss_fn(x, w, t, token_weights=adv), backend="aot_eager", fullgraph=True)
    with override_params({"tokens_per_chunk": 8, "grad_schedule": "token_chunks", "chunk_grad": "exponentials"},
                         backend="cuda"):
        losses = (compiled(x, w, t), loss_fn(x, w, t, token_weights=adv))
        got = [(loss, *torch.autograd.grad(loss, (x, w))) for loss in losses]
    assert calls == [8, 5, 8, 5], "two chunks each, compiled and eager, from kept exponentials"
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_loss(xd, wd, t, temperature=0.7, token_weights=adv)
    want = (ref.loss, *torch.autograd.grad(ref.loss, (xd, wd)))
    for compiled_value, eager_value, oracle in zip(*got, want, strict=True):
        torch.testing.assert_close(compiled_value, eager_value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled_value.double(), oracle, rtol=1e-4, atol=1e-5)
