"""tools/benchmarks/peers.py's bookkeeping on the CPU: each round's floors, the ratios a table reports and the
products table (its timings need a GPU; here they are scripted, the code around them runs as on one)."""

from __future__ import annotations

import importlib.util
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "benchmarks"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(TOOLS))  # peers.py imports its sibling cute_peers.py, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("flce_tools_peers", TOOLS / "peers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up while the class is made
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
        sys.modules.pop("flce_tools_peers", None)
    return module


def test_best_floors_take_the_fastest_gemm_per_product(peers) -> None:
    times = {"x @ W.T": {"cuBLAS": 10.0, "ws": 9.5}, "G @ W": {"cuBLAS": 11.0, "ws": 11.5, "quack": 10.5},
             "G.T @ x": {"cuBLAS": 12.0}}
    assert peers.best_floors(times) == (9.5 + 10.5 + 12.0, 9.5)


def test_products_table_is_the_median_over_rounds_per_gemm(peers) -> None:
    case = peers.Case(1000, 1000, 1000, torch.bfloat16)  # 2 GFLOP a product
    rounds = [{"x @ W.T": {"cuBLAS": ms, "ws": ms - 1}, "G @ W": {"cuBLAS": ms}, "G.T @ x": {"cuBLAS": ms}}
              for ms in (4.0, 2.0, 3.0)]
    lines = peers.product_lines(case, rounds)
    assert lines[0] == "| 1000x1000x1000 | x @ W.T | 3.00 ms, 1 | 2.00 ms, 1 | - |"
    assert lines[1] == "| 1000x1000x1000 | G @ W | 3.00 ms, 1 | - | - |"


def test_every_ratio_is_to_its_own_rounds_floors(peers, monkeypatch) -> None:
    """Three rounds whose floors drift (as the clock does under the power cap): a method's ratio and its
    best-GEMM ratio are medians of per-round ratios, and the floor row's best ratio compares the two floors."""
    rounds = 3
    # bench_ms's results in call order, per round: the three products by cuBLAS (the only GEMM on the CPU),
    # then floors(): the three-GEMM floor, the one-GEMM floor.
    products = [(12.0, 13.0, 14.0), (10.0, 11.0, 12.0), (9.0, 10.0, 11.0)]
    floor3 = [40.0, 36.0, 33.0]
    floor1 = [13.5, 12.0, 11.0]
    script = iter([ms for r in range(rounds) for ms in (*products[r], floor3[r], floor1[r])])
    calls = []

    def bench_ms(fn):
        fn()  # the timed function runs, on the CPU's tiny inputs
        calls.append(fn)
        return next(script)

    # (fwd+bwd, forward) per round; the first round is not the median one, so ratios to its floors alone fail here
    method_ms = [(41.0, 12.0), (37.0, 11.0), (35.0, 10.5)]
    measured = iter(method_ms)

    def measure(case, name, method, device):
        fwd_bwd, forward = next(measured)
        return {"shape": case.label, "method": name, "fwd_bwd_ms": fwd_bwd, "peak_mib": 5.0, "fwd_ms": forward,
                "fwd_peak_mib": 1.0}

    monkeypatch.setattr(peers, "bench_ms", bench_ms)
    monkeypatch.setattr(peers, "measure", measure)
    monkeypatch.setattr(peers, "quack_gemm", lambda: None)
    case = peers.Case(8, 16, 24, torch.float32)
    rows, lines = peers.measure_shape(case, {"m": None}, "cpu", rounds)
    assert len(calls) == 5 * rounds
    floor_row, row = rows
    best3 = [sum(p) for p in products]
    best1 = [p[0] for p in products]
    ratios = [ms / f for (ms, _), f in zip(method_ms, floor3, strict=True)]
    assert row["ratio"] == pytest.approx(statistics.median(ratios))
    assert row["ratio_range"] == pytest.approx((min(ratios), max(ratios)))
    assert row["best_ratio"] == pytest.approx(statistics.median(ms / b for (ms, _), b in zip(method_ms, best3,
                                                                                               strict=True)))
    assert row["fwd_ratio"] == pytest.approx(statistics.median(f / o for (_, f), o in zip(method_ms, floor1,
                                                                                           strict=True)))
    assert row["fwd_best_ratio"] == pytest.approx(statistics.median(f / b for (_, f), b in zip(method_ms, best1,
                                                                                                strict=True)))
    assert (row["fwd_bwd_ms"], row["peak_mib"]) == (37.0, 5.0)
    assert floor_row["ratio"] == 1.0 and floor_row["ratio_range"] == (1.0, 1.0)
    assert floor_row["best_ratio"] == pytest.approx(statistics.median(f / b for f, b in zip(floor3, best3,
                                                                                             strict=True)))
    assert lines[0] == "| 8x16x24 | x @ W.T | 10.00 ms, 0 | - | - |"  # the median round's


def test_every_other_round_runs_the_methods_in_reverse(peers, monkeypatch) -> None:
    """A method's place in a round is worth up to 1.5% on an H200: every other round reverses the order, so pairs of
    rounds weigh it alike on every method."""
    order = []
    monkeypatch.setattr(peers, "bench_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(peers, "quack_gemm", lambda: None)
    monkeypatch.setattr(peers, "measure", lambda case, name, method, device: order.append(name) or {
        "shape": case.label, "method": name, "fwd_bwd_ms": 2.0, "peak_mib": 1.0, "fwd_ms": 1.0, "fwd_peak_mib": 1.0})
    peers.measure_shape(peers.Case(8, 16, 24, torch.float32), {"a": None, "b": None, "c": None}, "cpu", 3)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_a_run_records_when_its_revision_was_committed(peers) -> None:
    """docs/benchmarks.md orders the runs of one day by it (tools/benchmarks/benchmarks_page.py)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    stamp = peers.revision_committed(f"{head} + local changes")
    assert stamp is not None and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
    assert peers.revision_committed("flce 0.1.0 (not a git checkout)") is None
    assert peers.run_record([], "G", "bfloat16", "peers.py", head, None, stamp)["flce_committed"] == stamp
    assert "flce_committed" not in peers.run_record([], "G", "bfloat16", "peers.py", "flce 0.1.0", None, None)
