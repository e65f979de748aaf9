"""The public surface: get_impl's module class, the functional form, LCEOutput, variants and
autograd behaviour (which inputs get gradients, repeated calls, repeated backward)."""

from __future__ import annotations

import copy
import io
import os
import re
import sys
import types

import pytest
import torch
from helpers import (
    Upstream,
    assert_close_per_design,
    flce_grads,
    make_inputs,
    random_class_weight,
    reference_grads,
    reference_loss,
)

import flce
from flce import LCEOutput
from flce.config import LCEConfig

H, V = 16, 57

FULL_FEATURE_VALUES = {
    "label_smoothing": 0.1,
    "lse_square_scale": 1e-4,
    "softcap": 30.0,
    "class_weight": torch.ones(V),
    "temperature": 0.5,
    "token_scaling": True,
    "return_z_loss": True,
    "return_token_accuracy": True,
    "return_predicted_tokens": True,
    "return_logprobs": True,
    "return_entropy": True,
    "return_logit_stats": True,
    "batch_invariant": True,
}


def test_public_surface() -> None:
    assert set(flce.__all__) == {"Backend", "LCEOutput", "LinearCrossEntropy", "available_backends", "explain",
                                 "get_impl", "linear_cross_entropy", "register_backend",
                                 # flce's input errors (docs/usage.md)
                                 "InputError", "InputTypeError",
                                 # linear distillation (docs/distillation.md)
                                 "LinearDistillation", "DistillationOutput", "explain_distillation",
                                 "get_distillation_impl", "linear_distillation_loss",
                                 # RL policy losses (docs/policy_loss.md)
                                 "LinearPolicyLoss", "PolicyLossOutput", "get_policy_impl", "linear_policy_loss"}
    assert LCEOutput._fields == ("loss", "z_loss", "token_accuracy", "predicted_tokens", "logprobs", "entropy",
                                 "selected_logprobs", "logit_stats")
    assert flce.DistillationOutput._fields == ("loss", "entropy")


@pytest.mark.parametrize("option", FULL_FEATURE_VALUES)
def test_plain_variant_rejects_full_feature_option(option: str, generator: torch.Generator) -> None:
    value = FULL_FEATURE_VALUES[option]
    with pytest.raises(ValueError, match=f"variant='plain' cannot serve {option}"):
        flce.get_impl("cpu", variant="plain")(**{option: value})
    hidden, weight, target, _ = make_inputs((4,), H, V, generator=generator)
    with pytest.raises(ValueError, match=f"variant='plain' cannot serve {option}"):
        flce.linear_cross_entropy(hidden, weight, target, variant="plain", **{option: value})


def test_plain_variant_names_every_offending_option() -> None:
    with pytest.raises(ValueError, match="cannot serve label_smoothing, softcap; use variant='full' or 'auto'"):
        flce.get_impl("cpu", variant="plain")(label_smoothing=0.1, softcap=5.0)


def test_full_feature_options_are_exactly_the_design_list() -> None:
    assert set(LCEConfig(**FULL_FEATURE_VALUES).full_feature_options()) == set(FULL_FEATURE_VALUES)
    assert LCEConfig(ignore_index=3, reduction="none", accum_dtype=torch.float32, memory_budget=1 << 20)\
        .full_feature_options() == [], "these options are served by the plain variant"


def test_outputs_without_and_with_extras(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((2, 5), H, V, generator=generator)
    plain = flce.linear_cross_entropy(hidden, weight, target)
    assert isinstance(plain, torch.Tensor) and plain.shape == () and plain.dtype == torch.float32
    out = flce.linear_cross_entropy(hidden, weight, target, return_logprobs=True, return_token_accuracy=True)
    assert isinstance(out, LCEOutput)
    assert out.z_loss is None and out.predicted_tokens is None and out.entropy is None
    assert out.logprobs.shape == (2, 5) and out.token_accuracy.shape == ()
    assert out.loss.requires_grad is False, "inputs without requires_grad give a loss without a graph"
    torch.testing.assert_close(out.loss, plain)


def test_module_is_reusable_with_fresh_inputs(generator: torch.Generator) -> None:
    """One module, several calls with fresh random inputs and shapes: nothing is cached between calls."""
    module = flce.get_impl("cpu")(reduction="sum", label_smoothing=0.05, return_entropy=True)
    for tokens in (7, 12, 3):
        hidden, weight, target, bias = make_inputs((tokens,), H, V, bias=True, generator=generator)
        upstream = Upstream(loss=torch.randn((), generator=generator, dtype=torch.float64),
                            entropy=torch.randn(tokens, generator=generator, dtype=torch.float64))
        out, grads = flce_grads(module, hidden, weight, target, bias, upstream)
        ref, ref_grads = reference_grads(hidden, weight, target, bias, upstream, reduction="sum",
                                         label_smoothing=0.05)
        assert_close_per_design(out.loss, ref.loss, kind="forward", dtype=torch.float32, name="loss")
        assert_close_per_design(out.entropy, ref.entropy, kind="forward", dtype=torch.float32, name="entropy")
        assert_close_per_design(grads.weight, ref_grads.weight, kind="grad_weight", dtype=torch.float32,
                                name="grad weight")


def test_functional_equals_module(generator: torch.Generator) -> None:
    hidden, weight, target, bias = make_inputs((9,), H, V, bias=True, generator=generator, ignore_index=1)
    options = {"reduction": "none", "softcap": 10.0, "ignore_index": 1}
    torch.testing.assert_close(flce.linear_cross_entropy(hidden, weight, target, bias, **options),
                               flce.get_impl(hidden)(**options)(hidden, weight, target, bias), rtol=0, atol=0)


def test_class_weight_is_a_buffer_that_moves_with_the_module(generator: torch.Generator) -> None:
    cw = random_class_weight(V, generator)
    module = flce.get_impl("cpu")(class_weight=cw)
    assert "class_weight" not in module.state_dict(), "class weights are configuration, not state"
    hidden, weight, target, _ = make_inputs((8,), H, V, dtype=torch.float64, generator=generator)
    module = module.double()
    assert module.class_weight.dtype == torch.float64
    loss = module(hidden, weight, target)
    expected = reference_loss(hidden, weight, target, class_weight=cw).loss
    assert_close_per_design(loss, expected, kind="forward", dtype=torch.float64, name="loss")
    assert "'reduction': 'mean'" in repr(module) and "backend=None" in repr(module)


def test_class_weight_assigned_on_the_module_takes_effect_as_torchs_weight(generator: torch.Generator) -> None:
    """The module's class_weight attribute is what its calls weigh by, as nn.CrossEntropyLoss.weight: a tensor
    assigned weighs, None assigned unweighs (before, None left the constructor's weights in force)."""
    cw, other = random_class_weight(V, generator), random_class_weight(V, generator)
    hidden, weight, target, _ = make_inputs((8,), H, V, generator=generator)
    module, torch_loss = flce.get_impl("cpu")(class_weight=cw), torch.nn.CrossEntropyLoss(weight=cw)
    for value in (None, other, cw, None):
        module.class_weight, torch_loss.weight = value, value
        want = reference_loss(hidden, weight, target, class_weight=value).loss
        torch.testing.assert_close(torch_loss(hidden @ weight.T, target), want.float(), rtol=1e-5, atol=1e-6)
        assert_close_per_design(module(hidden, weight, target), want, kind="forward", dtype=torch.float32,
                                name=f"loss with class_weight {None if value is None else 'set'}")
    unweighted = flce.get_impl("cpu")()
    unweighted.class_weight = cw
    assert_close_per_design(unweighted(hidden, weight, target), reference_loss(hidden, weight, target,
                                                                              class_weight=cw).loss,
                            kind="forward", dtype=torch.float32, name="class_weight assigned after construction")
    plain = flce.get_impl("cpu", variant="plain")()
    plain.class_weight = cw  # the plain variant has no class weights: refused, not ignored
    with pytest.raises(ValueError, match="variant='plain' cannot serve class_weight"):
        plain(hidden, weight, target)


@pytest.mark.parametrize("variant", ["auto", "full"])
def test_model_with_the_loss_as_a_submodule_saves_and_loads(variant: str, generator: torch.Generator) -> None:
    """torch.save(model) pickles get_impl's class, which is made at run time: it comes back as the
    same class, with its options and class weights, and computes the same loss."""
    cw = random_class_weight(V, generator)
    model = torch.nn.Module()
    model.head = torch.nn.Linear(H, V, bias=False)
    model.loss = flce.get_impl("cpu", backend="reference", variant=variant)(class_weight=cw, softcap=20.0,
                                                                           reduction="sum")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.loss) is type(model.loss)
    assert loaded.loss.config.softcap == 20.0 and loaded.loss.config.reduction == "sum"
    torch.testing.assert_close(loaded.loss.class_weight, cw, rtol=0, atol=0)
    hidden, _, target, _ = make_inputs((7,), H, V, generator=generator)
    torch.testing.assert_close(loaded.loss(hidden, loaded.head.weight, target),
                               model.loss(hidden, model.head.weight, target), rtol=0, atol=0)
    assert type(copy.deepcopy(model.loss)) is type(model.loss)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("wanted", ["hidden", "weight", "bias"])
def test_gradients_only_where_asked(wanted: str, reduction: str, generator: torch.Generator) -> None:
    hidden, weight, target, bias = make_inputs((6,), H, V, bias=True, generator=generator)
    tensors = {"hidden": hidden, "weight": weight, "bias": bias}
    tensors[wanted].requires_grad_()
    loss = flce.linear_cross_entropy(tensors["hidden"], tensors["weight"], target, tensors["bias"],
                                     reduction=reduction)
    loss.sum().backward()
    for name, t in tensors.items():
        assert (t.grad is not None) == (name == wanted), f"{name}.grad with only {wanted} requiring grad"
    upstream = Upstream(loss=torch.ones(() if reduction == "mean" else (6,), dtype=torch.float64))
    _, ref_grads = reference_grads(hidden, weight, target, bias, upstream, reduction=reduction)
    kind = "grad_hidden" if wanted == "hidden" else "grad_weight"
    assert_close_per_design(tensors[wanted].grad, getattr(ref_grads, wanted), kind=kind, dtype=torch.float32,
                            name=f"grad {wanted}")


def test_no_grad_forward_matches(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator)
    hidden.requires_grad_()
    with_graph = flce.linear_cross_entropy(hidden, weight, target)
    with torch.no_grad():
        without = flce.linear_cross_entropy(hidden, weight, target)
    assert not without.requires_grad and with_graph.requires_grad
    torch.testing.assert_close(with_graph.detach(), without, rtol=0, atol=0)


def test_gradients_accumulate_across_calls(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator)
    w = weight.clone().requires_grad_()
    flce.linear_cross_entropy(hidden, w, target).backward()
    once = w.grad.clone()
    flce.linear_cross_entropy(hidden, w, target).backward()
    torch.testing.assert_close(w.grad, 2 * once)


def test_second_backward_after_a_freed_graph_is_refused(generator: torch.Generator) -> None:
    """As torch refuses a second backward through a graph that the first one freed (the in-forward
    schedule saves no tensor, so torch cannot tell by itself); tests/test_autograd_contract.py
    checks the second backward of a retained graph."""
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator)
    loss = flce.linear_cross_entropy(hidden.requires_grad_(), weight, target)
    loss.backward()
    with pytest.raises(RuntimeError, match="a second time, after a backward that did not retain its graph"):
        loss.backward()


def test_second_backward_in_deferred_schedule_recomputes(generator: torch.Generator) -> None:
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator)
    w = weight.clone().requires_grad_()
    losses = flce.linear_cross_entropy(hidden, w, target, reduction="none")
    upstream = torch.randn(6, generator=generator)
    losses.backward(upstream, retain_graph=True)
    first = w.grad.clone()
    losses.backward(upstream)
    torch.testing.assert_close(w.grad, 2 * first, rtol=1e-6, atol=1e-7)


def test_scalar_upstream_gradient_scales(generator: torch.Generator) -> None:
    """backward(g) with a scalar g != 1 scales the gradients computed during forward."""
    hidden, weight, target, _ = make_inputs((6,), H, V, generator=generator)
    upstream = Upstream(loss=torch.tensor(-2.5, dtype=torch.float64))
    _, grads = flce_grads(flce.get_impl("cpu")(reduction="sum"), hidden, weight, target, None, upstream)
    _, ref = reference_grads(hidden, weight, target, None, upstream, reduction="sum")
    assert_close_per_design(grads.hidden, ref.hidden, kind="grad_hidden", dtype=torch.float32, name="grad hidden")
    assert_close_per_design(grads.weight, ref.weight, kind="grad_weight", dtype=torch.float32, name="grad weight")


def test_info_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from flce.__main__ import main

    fake_autotune = types.SimpleNamespace(info_lines=lambda device: [f"autotune for {device}: 3 entries"])
    monkeypatch.setitem(sys.modules, "flce.autotune", fake_autotune)
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu (" in out
    assert re.search(r"^\s+reference\s+any\s+0\s+yes\s+pure PyTorch", out, re.MULTILINE), out
    assert "selected for a default-options float32 call: reference" in out
    assert out.rstrip().endswith("autotune for cpu: 3 entries"), "the autotune helper's lines close the report"


@pytest.mark.parametrize("named", [True, False], ids=["--device cpu", "no --device"])
def test_info_command_resolves_the_device_once(named: bool, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The device is resolved once and handed on; why the CPU stands in is asked only where no device was named."""
    import flce.__main__ as cli

    calls = {"resolve": 0, "fallback": 0}

    def counted(name: str, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(cli, "resolve_device", counted("resolve", cli.resolve_device))
    monkeypatch.setattr(cli, "cpu_fallback_reason", counted("fallback", cli.cpu_fallback_reason))
    monkeypatch.setitem(sys.modules, "flce.autotune", types.SimpleNamespace())
    assert cli.main(["info", "--device", "cpu"] if named else ["info"]) == 0
    capsys.readouterr()
    assert calls["resolve"] == 1
    assert calls["fallback"] == (0 if named or torch.accelerator.is_available() else 1)


@pytest.mark.parametrize("command", [["info", "--device", "cpu"],
                                     ["explain", "--device", "cpu", "--shape", "64x32x300"]], ids=lambda c: c[0])
def test_commands_into_a_closed_pipe_stop_quietly(command: list[str]) -> None:
    """`python -m flce info | head -1`: the reader gone before the report is written ends the command with
    status 141 (as a shell reports a command a closed pipe stopped) and no BrokenPipeError traceback."""
    import subprocess
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(flce.__file__).parents[1])}
    shown = subprocess.Popen([sys.executable, "-m", "flce", *command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    shown.stdout.close()  # before any line is read: every write meets a pipe without a reader
    err = shown.stderr.read().decode()
    assert shown.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("device", ["garbage", "cuda:x"])
def test_info_command_with_a_bad_device_is_a_usage_error(capsys: pytest.CaptureFixture[str], device: str) -> None:
    from flce.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--device", device])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--device: device={device!r}" in err and "Traceback" not in err


def test_info_command_reports_passed_over_backends(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, isolated_registry: None) -> None:
    from flce.__main__ import main
    from flce.registry import Backend, register_backend

    register_backend(Backend(name="fakegpu", device_types=("cuda",), priority=999,
                             is_available=lambda probe: probe.cuda, supports=lambda cfg, dtype, h, v: (True, ""),
                             run=lambda flat, cfg, variant: torch.zeros(())))
    monkeypatch.setenv("FLCE_PROBE_OVERRIDE", "cuda=0")
    monkeypatch.setitem(sys.modules, "flce.autotune", types.SimpleNamespace())
    assert main(["info", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "passed over fakegpu: cuda forced absent by FLCE_PROBE_OVERRIDE" in out
    assert re.search(r"^\s+fakegpu\s+cuda\s+999\s+no\s+cuda forced absent", out, re.MULTILINE), out


def test_demo_runs_and_agrees() -> None:
    """tools/demo.py (what `make demo` runs) end to end at a tiny shape: both methods in their
    child processes, agreement checked, exit status 0."""
    import json
    import subprocess
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "tools" / "demo.py"
    done = subprocess.run([sys.executable, str(demo), "--device", "cpu", "--tokens", "64", "--hidden", "32",
                           "--vocab", "300"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "backend: reference" in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["agree"] and summary["grad_weight_rel_err"] < 1e-4
    assert summary["peak_mib"]["flce"] > 0 and summary["seconds"]["torch"] > 0
    # The speed verdict: the ratio of the medians of 3 interleaved rounds, the per-round ratios beside it.
    import statistics

    rounds = summary["seconds_per_round"]
    assert len(rounds["torch"]) == len(rounds["flce"]) == 3
    assert summary["seconds"]["flce"] == statistics.median(rounds["flce"])
    assert summary["speed"] == pytest.approx(statistics.median(rounds["torch"]) / statistics.median(rounds["flce"]))
    per_round = [a / b for a, b in zip(rounds["torch"], rounds["flce"], strict=True)]
    assert summary["speed_per_round"] == pytest.approx(per_round)
    assert "median of 3 interleaved rounds; per round" in done.stdout
