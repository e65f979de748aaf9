"""tools/profiling/power_ceiling.py's arithmetic on the CPU: the tensor peak at a clock and the loss's gradient it
times the floor's products with (its GPU tables need an H100 and nvidia-smi)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tool

from flce.testing.measure import IGNORE_INDEX


@pytest.fixture(scope="module")
def tool():
    return load_tool("tools/profiling/power_ceiling.py")


def test_tensor_peak_is_hoppers_rate_at_the_clock(tool) -> None:
    # An H100 SXM at its 1980 MHz boost: 4096 FLOP x 132 SMs x 1.98 GHz; at the power cap's ~1380 MHz, 746.
    assert tool.tensor_peak_tflops((9, 0), 132, 1980.0) == pytest.approx(1070.5, abs=0.1)
    assert tool.tensor_peak_tflops((9, 0), 132, 1380.0) == pytest.approx(746.1, abs=0.1)
    assert tool.tensor_peak_tflops((8, 0), 108, 1410.0) is None  # a rate the tool does not list: no peak claimed


@pytest.mark.parametrize("rows_per_block", [3, 64])
def test_loss_gradient_is_the_mean_losss_gradient_of_the_logits(tool, rows_per_block: int) -> None:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(11, 6, generator=generator)
    w = torch.randn(19, 6, generator=generator)
    t = torch.randint(0, 19, (11,), generator=generator)
    t[[2, 5]] = IGNORE_INDEX
    logits = (x @ w.T).requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits, t, ignore_index=IGNORE_INDEX)
    (expected,) = torch.autograd.grad(loss, logits)
    got = tool.loss_gradient(x, w, t, rows_per_block=rows_per_block)
    assert got.dtype == x.dtype and got.shape == (11, 19)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert (got[[2, 5]] == 0).all()


def test_cells_are_median_and_range(tool) -> None:
    assert tool.median_range([1.2, 1.0, 1.1]) == "1.100 (1.000-1.200)"
    assert tool.median_or_dash([]) == "-" and tool.median_or_dash([1900.0, 1380.0, 1390.0]) == "1390"


def test_the_tool_runs_through_on_the_cpu(tool, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Both tables, every row, at a small shape: on the CPU nothing is sampled (no clock, power or peak columns) and
    the products are not timed (each runs once; the tool's GPU timer needs CUDA)."""
    calls = []

    def run_once(fn, **_) -> float:
        calls.append(fn())
        return 2.0

    monkeypatch.setattr(tool, "median_ms", run_once)
    tool.main(["--shapes", "64x16x96", "--rounds", "2", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"### CPU, torch {torch.__version__}"
    products = [line for line in lines if line.startswith("| 64x16x96 | cuBLAS")]
    assert products == ["| 64x16x96 | cuBLAS x @ W.T | 2.000 (2.000-2.000) | 0 | - | - | - | - |"]
    gradients = [line for line in lines if line.startswith("| 64x16x96 |") and "x @ W.T" not in line]
    assert [line.split(" | ")[1] for line in gradients] == ["N(0, 1) (floor_gradient)", "N(0, 1) / V",
                                                             "the loss's gradient", "zeros"]
    assert len(calls) == 2 * (1 + 8)  # two rounds of x @ W.T and of the eight gradient products


def test_the_calls_table_runs_through_on_the_cpu(tool, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--calls: the floor's three products as one timing, flce's default and 2 GiB calls (each run once here, their
    gradients checked against the oracle's), the ratio to the floor per round; no clocks on the CPU, so no
    equal-clock column."""
    from flce.testing import reference_loss

    calls = []

    def run_once(fn, **_) -> float:
        result = fn()
        # the floor's three products, a call's two gradients, or one product (the x @ W.T table)
        kind = {3: "floor", 2: "call"}.get(len(result), "product") if isinstance(result, tuple) else "product"
        calls.append((kind, result))
        return 2.0 if kind == "floor" else 3.0

    monkeypatch.setattr(tool, "median_ms", run_once)
    tool.main(["--shapes", "64x16x96", "--rounds", "2", "--device", "cpu", "--skip-gradients", "--calls"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 64x16x96 |") and "x @ W.T" not in line]
    assert [line.split(" | ")[1] for line in rows] == ["the floor's 3 cuBLAS products", "flce, default", "flce, 2 GiB"]
    assert rows[0].endswith("| 2.000 (2.000-2.000) | 1.000 (1.000-1.000) | - | - | - |")
    assert rows[1].endswith("| 3.000 (3.000-3.000) | 1.500 (1.500-1.500) | - | - | - |")
    assert [kind for kind, _ in calls] == ["product"] * 2 + ["floor", "call", "call"] * 2
    x, w, t, _ = tool.shape_inputs(64, 16, 96, torch.device("cpu"))
    want = torch.autograd.grad(reference_loss(x.double(), w.double(), t).loss, (x, w))
    for gx, gw in (calls[3][1], calls[4][1]):  # the default and the 2 GiB call's gradients (bf16)
        torch.testing.assert_close(gx, want[0].to(gx.dtype), rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(gw, want[1].to(gw.dtype), rtol=2e-2, atol=1e-3)


def test_the_calls_table_at_equal_clocks(tool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call 10% over the floor that ran at a clock 5% below the floor's did 4.5% more work a clock: the last column
    takes each round's ratio times that round's clock ratio."""
    def timed(fns, rounds, rep_ms, device):
        clocks = {"the floor's 3 cuBLAS products": 1400.0, "flce, default": 1330.0, "flce, 2 GiB": 1400.0}
        ms = {"the floor's 3 cuBLAS products": 10.0, "flce, default": 11.0, "flce, 2 GiB": 10.5}
        return {name: {"ms": [ms[name]] * rounds, "mhz": [clocks[name]] * rounds, "watts": [700.0] * rounds,
                       "held_back": []} for name in fns}

    monkeypatch.setattr(tool, "timed_with_clocks", timed)
    rows = tool.calls_table("64x16x96", 2, 1.0, torch.device("cpu"))
    assert rows[1] == ("| 64x16x96 | flce, default | 11.000 (11.000-11.000) | 1.100 (1.100-1.100) | 1330 | 700 | "
                       "1.045 (1.045-1.045) |")
    assert rows[2].endswith("| 1.050 (1.050-1.050) | 1400 | 700 | 1.050 (1.050-1.050) |")


def test_the_calls_table_compares_clocks_only_at_the_cap(tool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timing that drew well under the floor's power (too short to heat the GPU) gets no equal-clock ratio."""
    def timed(fns, rounds, rep_ms, device):
        watts = {"the floor's 3 cuBLAS products": 690.0, "flce, default": 150.0, "flce, 2 GiB": 680.0}
        return {name: {"ms": [10.0] * rounds, "mhz": [1400.0] * rounds, "watts": [watts[name]] * rounds,
                       "held_back": []} for name in fns}

    monkeypatch.setattr(tool, "timed_with_clocks", timed)
    rows = tool.calls_table("64x16x96", 1, 1.0, torch.device("cpu"))
    assert rows[1].endswith("| 150 | - (below the floor's power) |")
    assert rows[2].endswith("| 680 | 1.000 (1.000-1.000) |")
