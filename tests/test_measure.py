"""flce.testing.measure: the inputs, clocks and memory figures the tools and the tuner share."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flce.testing import measure

CPU = torch.device("cpu")


def test_shape_inputs_are_the_same_per_shape_and_differ_between_shapes() -> None:
    first = measure.shape_inputs(300, 64, 1000, CPU, torch.float32)
    again = measure.shape_inputs(300, 64, 1000, CPU, torch.float32)
    other = measure.shape_inputs(300, 64, 1001, CPU, torch.float32)
    for a, b in zip(first[:3], again[:3], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.hidden, other.hidden)
    assert not torch.equal(first.hidden, measure.shape_inputs(300, 64, 1000, CPU, torch.float32, seed=1).hidden)


def test_shape_inputs_give_logits_of_unit_scale_and_every_17th_target_ignored() -> None:
    x, w, t, _ = measure.shape_inputs(2048, 256, 4000, CPU, torch.float32)
    assert x.shape == (2048, 256) and w.shape == (4000, 256) and t.shape == (2048,)
    assert x.requires_grad and w.requires_grad and t.dtype == torch.int64
    logits_std = float((x @ w.T).detach().std())
    assert 0.9 < logits_std < 1.1, logits_std
    ignored = t == measure.IGNORE_INDEX
    assert torch.equal(ignored.nonzero().flatten(), torch.arange(0, 2048, measure.IGNORED_EVERY))
    assert int(t[~ignored].min()) >= 0 and int(t.max()) < 4000


def test_shape_inputs_keep_the_dtype_and_can_skip_grad() -> None:
    x, w, _, _ = measure.shape_inputs(8, 16, 32, "cpu", torch.bfloat16, requires_grad=False)
    assert x.dtype == w.dtype == torch.bfloat16
    assert not x.requires_grad and not w.requires_grad


def test_floor_gradient_is_standard_normal_in_the_callers_dtype() -> None:
    """Every floor multiplies this G: unit scale (N(0, 1) / V timed the products 1-2% slower on an H100, so a
    floor drawn at another scale would shift every ratio), the dtype asked for, reproducible from a generator."""
    g = measure.floor_gradient(256, 1000, torch.bfloat16, "cpu", generator=torch.Generator().manual_seed(3))
    assert g.shape == (256, 1000) and g.dtype == torch.bfloat16 and g.device.type == "cpu"
    values = g.float()
    assert abs(float(values.mean())) < 0.01 and abs(float(values.std()) - 1.0) < 0.01
    again = measure.floor_gradient(256, 1000, torch.bfloat16, "cpu", generator=torch.Generator().manual_seed(3))
    assert torch.equal(g, again)


def test_cublas_floor_multiplies_the_floor_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = []
    real = measure.floor_gradient

    def recording(*args, **kwargs):
        g = real(*args, **kwargs)
        drawn.append(g)
        return g

    def timed(fn, **_) -> float:  # runs each product once, on the CPU
        fn()
        return 1.0

    monkeypatch.setattr(measure, "floor_gradient", recording)
    monkeypatch.setattr(measure, "median_ms", timed)
    x = torch.randn(8, 16)
    w = torch.randn(32, 16)
    assert measure.cublas_products_ms(x, w) == (1.0, 1.0, 1.0)
    assert len(drawn) == 1 and drawn[0].shape == (8, 32) and drawn[0].dtype == x.dtype


def test_budget_entries_name_the_keyword_and_the_default() -> None:
    assert measure.budget_options(0) == {} and measure.budget_label(0) == "default"
    assert measure.budget_options(2048) == {"memory_budget": 2 << 30} and measure.budget_label(2048) == "2048 MiB"


@pytest.mark.parametrize("label", ["8x4", "8x4x2x1", "8xHx2", ""])
def test_parse_shape_names_the_bad_label(label: str) -> None:
    with pytest.raises(ValueError, match="TOKENSxHIDDENxVOCAB"):
        measure.parse_shape(label)
    assert measure.parse_shape("8192x4096x128256") == (8192, 4096, 128256)


def test_timing_statistics() -> None:
    timing = measure.Timing((4.0, 1.0, 3.0, 2.0, 10.0))
    assert timing.median_ms == 3.0 and timing.min_ms == 1.0 and timing.max_ms == 10.0
    assert timing.quartiles_ms == (2.0, 4.0)
    assert measure.Timing((5.0,)).quartiles_ms == (5.0, 5.0)
    with pytest.raises(ValueError, match="samples_ms"):
        measure.Timing(())


def test_counted_timing_makes_exactly_the_calls_asked_for() -> None:
    calls = []
    timing = measure.counted_timing(lambda: calls.append(1), CPU, warmup=2, repeats=5)
    assert len(calls) == 7 and len(timing.samples_ms) == 5
    assert all(ms >= 0 for ms in timing.samples_ms)
    with pytest.raises(ValueError, match="repeats=0"):
        measure.counted_timing(lambda: None, CPU, warmup=0, repeats=0)


def test_interleaved_timings_alternate_the_calls_round_by_round() -> None:
    order: list[str] = []
    seen: list[tuple[str, str]] = []
    result = measure.interleaved_timings({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, CPU,
                                         rounds=3, warmup_rounds=1,
                                         on_sample=lambda label, name, wall, cpu: seen.append((label, name)))
    assert order == ["a", "b", "b", "a"] * 2  # every other round reversed (round_order), warm-up included
    assert seen[:2] == [("warm-up", "a"), ("warm-up", "b")] and seen[-1] == ("run 3", "a")
    assert set(result.wall) == set(result.cpu) == {"a", "b"}
    assert all(len(t.samples_ms) == 3 for t in (*result.wall.values(), *result.cpu.values()))


def test_peak_memory_has_no_figure_on_the_cpu() -> None:
    assert measure.peak_bytes_above(lambda: torch.ones(10), CPU) is None
    with pytest.raises(ValueError, match="allocator statistics"):
        measure.peak_mib_above(lambda: torch.ones(10), CPU)


@pytest.mark.cuda
def test_peak_memory_counts_the_working_memory_above_what_is_returned() -> None:
    device = torch.device("cuda")
    kept_bytes, scratch_bytes = 64 << 20, 256 << 20

    def call() -> torch.Tensor:  # a result alive at the peak, as gradients are, and scratch freed before returning
        kept = torch.empty(kept_bytes, dtype=torch.uint8, device=device)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)
        kept[0] = scratch.fill_(1)[0]
        return kept

    assert measure.peak_bytes_above(call, device) == scratch_bytes
    assert measure.peak_bytes_above(call, device, include_kept=True) == scratch_bytes + kept_bytes


def test_cpu_benchmark_reports_medians_with_their_spread_and_the_machine() -> None:
    """tools/benchmarks/cpu.py at a tiny shape: every method's median with its min-max and the
    per-round range of its ratio to the floor, for wall and CPU time, and the machine it ran on."""
    script = Path(__file__).resolve().parents[1] / "tools" / "benchmarks" / "cpu.py"
    done = subprocess.run([sys.executable, str(script), "--tokens", "64", "--hidden", "16", "--vocab", "200",
                           "--repeats", "3", "--no-memory", "--markdown"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{measure.cpu_model()}, " in done.stdout and "cores usable" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and " | " in line]
    assert rows[0].startswith("| method | median s (min-max) | vs floor (per round) |")
    by_method = {row.split(" | ")[0].removeprefix("| "): row for row in rows[1:]}
    torch_chunked = {"torch_chunked"} if hasattr(torch.nn, "LinearCrossEntropyOptions") else set()
    assert set(by_method) == {"floor", "eager", "flce"} | torch_chunked
    median_and_range = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)"
    ratio_and_range = r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\dx\)"
    cells = by_method["flce"].split(" | ")
    assert re.fullmatch(median_and_range, cells[1]) and re.fullmatch(median_and_range, cells[3]), cells
    assert re.fullmatch(ratio_and_range, cells[2]) and re.fullmatch(ratio_and_range, cells[4]), cells
    assert "3 timed rounds after 1 warm-up" in done.stdout


def test_host_ms_is_the_median_time_for_a_call_to_return() -> None:
    calls = []

    def call() -> None:
        calls.append(None)
        time.sleep(0.004 if len(calls) % 2 else 0.002)  # 4, 2, 4, 2, 4 ms: the median is 4

    ms = measure.host_ms(call, CPU, repeats=5)
    assert len(calls) == 5
    assert 3.9 <= ms < 50


def test_host_sections_wrap_every_section_of_this_flce(monkeypatch) -> None:
    """tools/profiling/host_sections.py finds every function it times in this flce (a rename would otherwise
    drop a section from its table silently), and a wrapped function still returns its result and is counted."""
    import collections
    import importlib.util

    pytest.importorskip("triton")
    path = Path(__file__).resolve().parents[1] / "tools" / "profiling" / "host_sections.py"
    spec = importlib.util.spec_from_file_location("flce_tools_host_sections", path)
    assert spec is not None and spec.loader is not None
    sections = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sections)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    assert sections.install(totals, counts, patch=monkeypatch.setattr) == []
    from flce.config import LCEConfig
    from flce.engine import objective
    from flce.semantics import count_tokens, denominators

    target = torch.tensor([1, -100, 2, 3])
    denoms = denominators(target, LCEConfig(), torch.float32, count_tokens(target, -100))
    scales = objective.upstream_scales(LCEConfig(), denoms, torch.ones(()), slice(0, 4), 4)
    assert torch.allclose(scales.cross_entropy, torch.full((4,), 1 / 3))
    label = "flce.engine.objective.upstream_scales"
    assert counts[label] == 1 and totals[label] > 0


def test_round_order_reverses_every_other_round() -> None:
    """A method's place in a benchmark round weighs alike on every method over pairs of rounds."""
    assert [measure.round_order("abc", r) for r in range(3)] == [list("abc"), list("cba"), list("abc")]
    assert measure.round_order({"x": 1, "y": 2}.items(), 1) == [("y", 2), ("x", 1)]
