"""tools/benchmarks/distill_peers.py's bookkeeping on the CPU: rounds interleaved with their floors, the ratios a
table reports, "fails: ..." rows, the arguments, and the torch.compile peer's formula against flce's oracle (its
timings need a GPU; here they are scripted, the code around them runs as on one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from flce.testing.distillation import reference_distillation_loss

TOOL = Path(__file__).resolve().parents[1] / "tools" / "benchmarks" / "distill_peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("flce_tools_distill_peers", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the classes are made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_rounds_interleave_the_floor_and_every_method(peers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round times the floor and then every method on fresh inputs, every other round in the reverse order (a
    drift within a round cancels over pairs); a method's rows carry their own round's floor, and its ratio is the
    median of the per-round ratios (the first round is not the median one here)."""
    floors = iter([40.0, 36.0, 33.0])
    order = []

    def bench(fn):
        fn()  # the floor's four products run, on the CPU's tiny inputs
        order.append("floor")
        return next(floors)

    method_ms = {"a": iter([41.0, 37.0, 35.0]), "b": iter([80.0, 72.0, 66.0])}

    def measure(method, inputs, bench):
        assert inputs.student_hidden.requires_grad and not inputs.teacher_hidden.requires_grad
        order.append(method)
        return {"ms": next(method_ms[method]), "peak_mib": 5.0}

    monkeypatch.setattr(peers, "measure", measure)
    case = peers.Case(8, 4, 6, 32, torch.float32)
    measured = peers.run_rounds(case, {"a": "a", "b": "b"}, 3, "cpu", bench)
    assert order == ["floor", "a", "b", "floor", "b", "a", "floor", "a", "b"]
    assert [r["floor_ms"] for r in measured["a"]] == [40.0, 36.0, 33.0]
    row = peers.summary(case.label, "a", measured["a"])
    ratios = sorted([41 / 40, 37 / 36, 35 / 33])
    assert row["ratio"] == pytest.approx(ratios[1]) and row["ratio_range"] == pytest.approx((ratios[0], ratios[2]))
    assert row["ms"] == 37.0 and row["peak_mib"] == 5.0
    floor = peers.summary(case.label, peers.FLOOR, measured[peers.FLOOR])
    assert floor["ratio"] == 1.0 and floor["ratio_range"] == (1.0, 1.0)
    text = peers.markdown([floor, row], "### header")
    assert f"| 8x4x6x32 | a | 37.00 | {ratios[1]:.3f}x ({ratios[0]:.3f}-{ratios[2]:.3f}) | 5 |" in text
    assert "| 8x4x6x32 | 4-GEMM floor | 36.00 | 1.000x | 0 |" in text


def test_a_method_that_fails_is_a_row_saying_so(peers) -> None:
    rows = [{"ms": 1.0, "peak_mib": 1.0, "floor_ms": 1.0}, {"error": "fails: RuntimeError: out of memory"}]
    row = peers.summary("s", "m", rows)
    assert row == {"shape": "s", "method": "m", "error": "fails: RuntimeError: out of memory"}
    assert "| s | m | fails: RuntimeError: out of memory | | |" in peers.markdown([row], "h")
    inputs = peers.make_inputs(peers.Case(4, 4, 4, 8, torch.float32), "cpu")
    refused = peers.measure("fails: ImportError: no liger", inputs, lambda fn: 0.0)
    assert refused == {"error": "fails: ImportError: no liger"}


def test_liger_is_listed_whether_it_loads_or_not(peers) -> None:
    methods = peers.all_methods()
    assert list(methods) == ["flce", "flce_512MiB", "flce_separate", "flce_cublas_logits", "flce_gemm_statistics",
                             "flce_uncapped", "flce_2GiB", "flce_entropy", "liger_jsd", "torch_compile",
                             "trl_divergence", "flce_trl_dropin", "flce_liger_dropin", "liger_defaults"]
    if importlib.util.find_spec("liger_kernel") is None:
        assert methods["liger_jsd"].startswith("fails: ModuleNotFoundError")
        assert methods["liger_defaults"].startswith("fails: ModuleNotFoundError")
    assert "liger_defaults" not in peers.all_methods("reverse_kl")


def test_the_liger_dropin_at_ligers_defaults_is_ligers_loss(peers, generator: torch.Generator) -> None:
    """The two methods that time Liger's class at its defaults compute the same loss: JSD plus the hard-label term,
    each weighted 0.5 (the oracle's w = 0.5 hard, 0.5 soft)."""
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = peers.make_inputs(peers.Case(64, 32, 48, 256, torch.float32), device)
    expected = reference_distillation_loss(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                           inputs.teacher_weight, inputs.target, loss="jsd", beta=0.5,
                                           hard_label_weight=0.5)
    for dropin in (True, False):
        got = peers.liger_defaults_method(dropin)(inputs)
        torch.testing.assert_close(got.double().cpu(), expected.cpu(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "reverse_kl"])
def test_the_formula_and_flce_equal_the_oracle(peers, loss: str, generator: torch.Generator) -> None:
    """The torch.compile peer computes the same loss as flce (its formula run eagerly here), both the oracle's, for
    every loss the tool times."""
    gpu = torch.cuda.is_available()
    inputs = peers.make_inputs(peers.Case(16, 8, 12, 40, torch.float32), "cuda" if gpu else "cpu")
    expected = reference_distillation_loss(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                           inputs.teacher_weight, inputs.target, loss=loss, beta=peers.BETA)
    tolerance = {"rtol": 1e-4 if gpu else 1e-5, "atol": 1e-6}  # the GPU's fp32 GEMMs: the 1e-4
    torch.testing.assert_close(peers.materialised(inputs, loss).double(), expected, **tolerance)
    # flce's CUDA backend (in the interpreter without a GPU), with nothing cached and with one kernel a pass
    pytest.importorskip("triton")
    for method in (peers.flce_method(None, loss=loss),
                   peers.flce_method(None, lambda: {"pair_passes": "separate"}, loss)):
        torch.testing.assert_close(method(inputs).double(), expected, **tolerance)


@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "reverse_kl"])
def test_liger_at_its_beta_is_each_divergence(peers, loss: str, generator: torch.Generator) -> None:
    """Liger's JSD class at LIGER_BETA's beta computes the loss the tool names (where liger-kernel is installed: on
    the GPU machine's runs)."""
    pytest.importorskip("liger_kernel")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = peers.make_inputs(peers.Case(64, 32, 48, 256, torch.float32), device)
    expected = reference_distillation_loss(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                           inputs.teacher_weight, inputs.target, loss=loss, beta=peers.BETA)
    torch.testing.assert_close(peers.liger_method(loss)(inputs).double().cpu(), expected.cpu(), rtol=1e-4, atol=1e-6)


def test_arguments(peers) -> None:
    quick = peers.parse_args(["--quick"])
    assert quick.rounds == 1 and quick.shapes == ",".join(peers.QUICK_SHAPES)
    full = peers.parse_args([])
    assert full.rounds == 4 and full.shapes == ",".join(peers.DEFAULT_SHAPES)
    assert peers.parse_case("8192x4096x8192x128256", torch.bfloat16).label == "8192x4096x8192x128256"
    with pytest.raises(ValueError, match="TOKENSxSTUDENT_HxTEACHER_HxVOCAB"):
        peers.parse_case("8192x4096x128256", torch.bfloat16)
    with pytest.raises(SystemExit):
        peers.parse_args(["--rounds", "0"])
    assert full.loss == "jsd" and peers.parse_args(["--loss", "forward_kl"]).loss == "forward_kl"
    with pytest.raises(SystemExit):
        peers.parse_args(["--loss", "kl"])


@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "reverse_kl"])
def test_trls_kernel_at_its_beta_is_each_divergence(peers, loss: str) -> None:
    """TRL's DistillationTrainer kernel at LIGER_BETA's beta, and flce's drop-in for that trainer's loss, compute the
    loss the tool names (TRL's torch path on the CPU, its Triton kernels on the GPU), over the tokens whose target
    counts."""
    pytest.importorskip("trl")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = peers.make_inputs(peers.Case(64, 32, 48, 256, torch.float32), device)
    expected = reference_distillation_loss(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                           inputs.teacher_weight, inputs.target, loss=loss, beta=peers.BETA)
    for method in (peers.trl_divergence_method(loss), peers.trl_dropin_method(loss)):
        torch.testing.assert_close(method(inputs).double().cpu(), expected.cpu(), rtol=1e-4, atol=1e-6)
