"""Backend selection with injected hardware probes: no GPU or NPU needed.

Fake backends are registered under the ``isolated_registry`` fixture (conftest.py), which
restores the registry afterwards.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from helpers import make_inputs

import flce
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.registry import (
    BACKEND_ENV,
    Backend,
    HardwareProbe,
    available_backends,
    candidates_for,
    choose_for_call,
    register_backend,
    resolve_device,
    system_probe,
)
from flce.registry.probes import PROBE_ENV

CUDA_MACHINE = HardwareProbe.fake(cuda=True, triton=True)
CPU_MACHINE = HardwareProbe.fake()


@pytest.fixture(autouse=True)
def _only_reference_and_fakes(isolated_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real GPU backends stay out of the way (isolated_registry puts them back), and the
    environment variables under test start unset."""
    from flce.registry import selection

    for name in [n for n in selection._registry if n != "reference"]:
        del selection._registry[name]
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv(PROBE_ENV, raising=False)


def fake_backend(name: str, device_types: tuple[str, ...], priority: int, *, needs: str | None = None,
                 supports: Callable[[LCEConfig, torch.dtype, int, int], tuple[bool, str]] | None = None,
                 calls: list | None = None) -> Backend:
    """A backend available when probe field ``needs`` is present; its run records the call and
    returns a recognisable loss (its priority)."""

    def is_available(probe: HardwareProbe) -> tuple[bool, str]:
        if needs is None:
            return True, "always"
        return getattr(probe, needs)

    def run(flat: FlatInputs, cfg: LCEConfig, variant: str) -> torch.Tensor:
        if calls is not None:
            calls.append((name, variant))
        return torch.tensor(float(priority))

    backend = Backend(name=name, device_types=device_types, priority=priority, is_available=is_available,
                      supports=supports or (lambda cfg, dtype, h, v: (True, "everything")), run=run)
    register_backend(backend)
    return backend


def small_call(generator: torch.Generator, **options: object) -> tuple[LCEConfig, torch.dtype, int, int]:
    """What choose_for_call takes for a small call: its config, dtype, H and V."""
    _, weight, _, _ = make_inputs((4,), 8, 13, generator=generator)
    return LCEConfig(**options), weight.dtype, weight.shape[1], weight.shape[0]


def names(backends: tuple[Backend, ...]) -> list[str]:
    return [b.name for b in backends]


# --- the table -----------------------------------------------------------------------------------


def test_reference_is_registered_and_available_everywhere() -> None:
    for probe in (CPU_MACHINE, CUDA_MACHINE, None):
        rows = {row["name"]: row for row in available_backends(probe)}
        assert rows["reference"]["available"] is True
        assert rows["reference"]["device_types"] == ("any",)
        assert set(rows["reference"]) == {"name", "device_types", "priority", "available", "reason"}


def test_available_backends_reports_reason_from_probe() -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    rows = {row["name"]: row for row in available_backends(CPU_MACHINE)}
    assert rows["fakegpu"]["available"] is False and rows["fakegpu"]["reason"] == "cuda faked absent"
    assert {row["name"]: row for row in available_backends(CUDA_MACHINE)}["fakegpu"]["available"] is True
    assert flce.available_backends() == available_backends(), "the public function is the registry's"


def test_register_twice_needs_replace() -> None:
    fake_backend("dup", ("cpu",), 1)
    with pytest.raises(ValueError, match="'dup' is already registered.*replace=True"):
        fake_backend("dup", ("cpu",), 2)
    replacement = Backend(name="dup", device_types=("cpu",), priority=3, is_available=lambda p: (True, ""),
                          supports=lambda c, d, h, v: (True, ""), run=lambda f, c, v: torch.tensor(3.0))
    register_backend(replacement, replace=True)
    assert [b.priority for b in candidates_for("cpu", probe=CPU_MACHINE).backends if b.name == "dup"] == [3]


# --- automatic selection -------------------------------------------------------------------------


def test_priority_order_among_available() -> None:
    fake_backend("low", ("cpu",), 10)
    fake_backend("high", ("cpu",), 20)
    cands = candidates_for("cpu", probe=CPU_MACHINE)
    assert names(cands.backends)[:2] == ["high", "low"] and names(cands.backends)[-1] == "reference"
    assert not cands.explicit and cands.passed_over == ()


def test_gpu_backend_chosen_on_a_gpu_machine(generator: torch.Generator) -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    cands = candidates_for("cuda", probe=CUDA_MACHINE)
    assert names(cands.backends) == ["fakegpu", "reference"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_for_call(cands, *small_call(generator)).name == "fakegpu"


def test_gpu_backend_ignored_for_cpu_tensors() -> None:
    """A CUDA backend is not "passed over" for a CPU call: it never served the CPU."""
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    cands = candidates_for("cpu", probe=CUDA_MACHINE)
    assert names(cands.backends) == ["reference"] and cands.passed_over == ()


def test_unavailable_better_backend_warns_once(generator: torch.Generator) -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    no_gpu = HardwareProbe(cuda=(False, "driver too old"), npu=(False, ""), triton=(True, ""),
                           triton_interpret=(False, ""))
    cands = candidates_for("cuda", probe=no_gpu)
    assert cands.passed_over == (("fakegpu", "driver too old"),)
    call = small_call(generator)
    with pytest.warns(RuntimeWarning, match="'reference'.*fakegpu: driver too old"):
        assert choose_for_call(cands, *call).name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_for_call(cands, *call).name == "reference", "the warning comes once"


def test_unsupported_call_falls_back_with_reason(generator: torch.Generator) -> None:
    def no_softcap(cfg: LCEConfig, dtype: torch.dtype, hidden: int, vocab: int) -> tuple[bool, str]:
        return (cfg.softcap is None, "softcap is not implemented here")

    fake_backend("fakegpu", ("cuda",), 50, needs="cuda", supports=no_softcap)
    cands = candidates_for("cuda", probe=CUDA_MACHINE)
    assert choose_for_call(cands, *small_call(generator)).name == "fakegpu"
    with pytest.warns(RuntimeWarning, match="fakegpu: softcap is not implemented here"):
        assert choose_for_call(cands, *small_call(generator, softcap=5.0)).name == "reference"


def test_no_backend_at_all_raises(generator: torch.Generator) -> None:
    from flce.registry import Candidates

    with pytest.raises(RuntimeError, match="no backend supports this call"):
        choose_for_call(Candidates((), explicit=False, passed_over=(("x", "absent"),)), *small_call(generator))


def test_module_dispatches_to_selected_backend(generator: torch.Generator) -> None:
    calls: list = []
    fake_backend("fakecpu", ("cpu",), 30, calls=calls)
    hidden, weight, target, _ = make_inputs((4,), 8, 13, generator=generator)
    impl = flce.get_impl("cpu", probe=CPU_MACHINE)
    assert float(impl()(hidden, weight, target)) == 30.0
    assert float(impl(label_smoothing=0.1)(hidden, weight, target)) == 30.0
    assert calls == [("fakecpu", "plain"), ("fakecpu", "full")], "auto picks plain unless an option needs full"
    assert float(flce.get_impl("cpu", probe=CPU_MACHINE, variant="full")()(hidden, weight, target)) == 30.0
    assert calls[-1] == ("fakecpu", "full")


# --- explicit requests ---------------------------------------------------------------------------


def test_explicit_backend_wins_over_priority() -> None:
    fake_backend("fakecpu", ("cpu",), 30)
    cands = candidates_for("cpu", "reference", probe=CPU_MACHINE)
    assert names(cands.backends) == ["reference"] and cands.explicit


def test_explicit_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"backend='nope': unknown backend; registered: \[.*'reference'"):
        candidates_for("cpu", "nope", probe=CPU_MACHINE)
    with pytest.raises(ValueError, match="backend='nope': unknown backend"):
        flce.get_impl("cpu", backend="nope")


def test_explicit_unavailable_backend_raises_with_reason() -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    with pytest.raises(RuntimeError, match="backend='fakegpu': backend is not available: cuda faked absent"):
        candidates_for("cuda", "fakegpu", probe=CPU_MACHINE)
    with pytest.raises(RuntimeError, match="backend='fakegpu': backend is not available"):
        flce.get_impl("cuda", backend="fakegpu", probe=CPU_MACHINE)


def test_explicit_backend_for_a_device_it_does_not_serve() -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    with pytest.raises(RuntimeError, match=r"'fakegpu': backend serves device types \('cuda',\), not 'cpu'"):
        candidates_for("cpu", "fakegpu", probe=CUDA_MACHINE)


def test_explicit_backend_that_cannot_serve_the_call(generator: torch.Generator) -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda", supports=lambda cfg, dtype, h, v: (False, "H must be >= 64"))
    cands = candidates_for("cuda", "fakegpu", probe=CUDA_MACHINE)
    with pytest.raises(ValueError, match="backend 'fakegpu' does not support this call: H must be >= 64"):
        choose_for_call(cands, *small_call(generator))


def test_interpreter_backend_serves_cpu_only_when_named() -> None:
    fake_backend("faketriton", ("cuda", "interpret"), 50, needs="triton")
    interpreting = HardwareProbe.fake(triton=True, triton_interpret=True)
    assert names(candidates_for("cpu", probe=interpreting).backends) == ["reference"], "never picked automatically"
    assert names(candidates_for("cpu", "faketriton", probe=interpreting).backends) == ["faketriton"]
    with pytest.raises(RuntimeError, match="serves device types"):
        candidates_for("cpu", "faketriton", probe=HardwareProbe.fake(triton=True))


# --- environment variables -----------------------------------------------------------------------


def test_flce_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_backend("fakecpu", ("cpu",), 30)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    cands = candidates_for("cpu", probe=CPU_MACHINE)
    assert names(cands.backends) == ["reference"] and cands.explicit
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match="FLCE_BACKEND='nope': unknown backend"):
        candidates_for("cpu", probe=CPU_MACHINE)
    assert names(candidates_for("cpu", "fakecpu", probe=CPU_MACHINE).backends) == ["fakecpu"], \
        "the backend= argument beats FLCE_BACKEND"


def test_flce_backend_env_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    monkeypatch.setenv(BACKEND_ENV, "fakegpu")
    with pytest.raises(RuntimeError, match="FLCE_BACKEND='fakegpu': backend is not available"):
        candidates_for("cuda", probe=CPU_MACHINE)


def test_probe_override_env(monkeypatch: pytest.MonkeyPatch, generator: torch.Generator) -> None:
    fake_backend("fakegpu", ("cuda",), 50, needs="cuda")
    monkeypatch.setenv(PROBE_ENV, "cuda=1,triton=1")
    probe = system_probe()
    assert probe.cuda == (True, f"cuda forced present by {PROBE_ENV}") and probe.triton[0]
    assert names(candidates_for("cuda").backends) == ["fakegpu", "reference"]
    monkeypatch.setenv(PROBE_ENV, "cuda=0")
    assert system_probe().cuda == (False, f"cuda forced absent by {PROBE_ENV}")
    cands = candidates_for("cuda")
    assert cands.passed_over == (("fakegpu", f"cuda forced absent by {PROBE_ENV}"),)


@pytest.mark.parametrize("bad", ["cuda=yes", "gpu=1", "cuda"])
def test_probe_override_env_malformed(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(PROBE_ENV, bad)
    with pytest.raises(ValueError, match=f"{PROBE_ENV}={bad!r}: expected comma-separated name=0|1"):
        system_probe()


def test_fake_probe_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown probe names \['tpu'\]"):
        HardwareProbe.fake(tpu=True)
    probe = HardwareProbe.fake(npu=True)
    assert probe.npu == (True, "faked") and probe.cuda == (False, "cuda faked absent")


# --- devices -------------------------------------------------------------------------------------


def test_resolve_device_forms() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1), "no hardware needed to name one"
    assert resolve_device(torch.zeros(1)) == torch.device("cpu")
    expected = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    assert resolve_device(None) == expected


@pytest.mark.parametrize("usable", [False, True], ids=["no GPU", "a GPU"])
def test_a_cuda_build_without_a_gpu_is_a_cpu_machine(usable: bool, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The default torch wheel on a laptop or CI runner: built for CUDA, no GPU at run time. Every place that
    picks the device of a call naming none (get_impl, python -m flce info, flce-autotune tune and its info
    lines) picks the CPU and says why; with a usable GPU, the GPU."""
    from flce.__main__ import main
    from flce.autotune import cli
    from flce.autotune.info import info_lines

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: (
        torch.device("cuda") if usable or not check_available else None))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: usable)
    want = "cuda" if usable else "cpu"
    assert resolve_device(None).type == want
    assert flce.get_impl().device_type == want
    assert cli._device(None).type == want
    err = capsys.readouterr().err
    assert ("built for cuda, but no cuda device is usable" in err) != usable, err
    if usable:
        return
    assert info_lines()[0] == "autotune cache, in lookup order:"  # the CPU's entries, no CUDA device to name
    monkeypatch.setitem(sys.modules, "flce.autotune", types.SimpleNamespace())
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu (" in out and "built for cuda, but no cuda device is usable in this process" in out, out


def test_get_impl_binds_device_backend_and_variant() -> None:
    impl = flce.get_impl(torch.zeros(1), backend="reference", variant="full")
    assert issubclass(impl, flce.LinearCrossEntropy) and issubclass(impl, torch.nn.Module)
    assert (impl.device_type, impl.backend_name, impl.variant) == ("cpu", "reference", "full")
    assert flce.get_impl("cpu", backend="reference", variant="full") is impl, "one class per binding"
