"""flce.testing.clocks: nvidia-smi's clock samples over a benchmark run, and the warning for a held-back GPU."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from flce.testing import clocks


def test_a_sample_line_parses_and_a_line_with_a_missing_field_does_not() -> None:
    sample = clocks.parse_sample("1365, 69, 592.31, 0x0000000000000004\n")
    assert sample == clocks.Sample(1365.0, 69.0, 592.31, 0x4)
    assert clocks.parse_sample("1365, 69, [N/A], 0x0000000000000004") is None
    assert clocks.parse_sample("1365, 69") is None


def test_the_summary_of_power_capped_samples_is_not_held_back() -> None:
    summary = clocks.summarize([clocks.Sample(1980, 40, 150, 0x0), clocks.Sample(1380, 66, 640, 0x4),
                                clocks.Sample(1110, 68, 700, 0x4), clocks.Sample(345, 35, 75, 0x1)])
    assert summary is not None
    assert summary.samples == 4
    assert summary.sm_mhz_mean == pytest.approx((1980 + 1380 + 1110 + 345) / 4)
    assert (summary.sm_mhz_min, summary.sm_mhz_max, summary.temperature_max_c) == (345, 1980, 68)
    assert summary.reasons == ("software power cap",)  # idle is not a slowdown worth naming
    assert not summary.held_back
    assert "WARNING" not in summary.describe()
    assert "software power cap" in summary.describe()


@pytest.mark.parametrize("bit, name", [(0x20, "software thermal slowdown"), (0x40, "hardware thermal slowdown"),
                                       (0x80, "hardware power brake"), (0x8, "hardware slowdown")])
def test_a_thermal_or_brake_reason_marks_the_run_held_back(bit: int, name: str) -> None:
    summary = clocks.summarize([clocks.Sample(1400, 80, 600, 0x4), clocks.Sample(345, 87, 230, bit | 0x4)])
    assert summary is not None and summary.held_back
    assert name in summary.reasons
    assert "WARNING" in summary.describe()


def test_no_samples_claim_nothing() -> None:
    assert clocks.summarize([]) is None


def test_the_sampler_on_a_cpu_starts_nothing() -> None:
    with clocks.ClockSampler(torch.device("cpu")) as sampler:
        pass
    assert sampler.summary is None


def test_the_sampler_without_nvidia_smi_starts_nothing(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    with clocks.ClockSampler(torch.device("cuda")) as sampler:
        pass
    assert sampler.summary is None


def test_the_sampler_reads_what_nvidia_smi_prints_for_the_gpu_asked(tmp_path: Path, monkeypatch) -> None:
    args_file, ready = tmp_path / "args", tmp_path / "ready"
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args_file}\n'
        'echo "1980, 45, 120.0, 0x0000000000000000"\n'
        'echo "345, 87, 230.5, 0x0000000000000020"\n'
        'echo "1365, 69, [N/A], 0x0000000000000004"\n'
        f"touch {ready}\n"
        "exec sleep 60\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(clocks, "_nvidia_smi_id", lambda device: "GPU-0123")
    with clocks.ClockSampler(torch.device("cuda"), interval_ms=50) as sampler:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ready.exists()
    args = args_file.read_text().split()
    assert "--id" in args and args[args.index("--id") + 1] == "GPU-0123"
    assert args[args.index("--loop-ms") + 1] == "50"
    summary = sampler.summary
    assert summary is not None
    assert summary.samples == 2  # the [N/A] line is left out
    assert (summary.sm_mhz_min, summary.sm_mhz_max, summary.temperature_max_c) == (345, 1980, 87)
    assert summary.held_back and summary.reasons == ("software thermal slowdown",)


def test_a_published_run_names_its_clocks_and_a_held_back_run_says_so() -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "benchmarks" / "plot.py"
    spec = importlib.util.spec_from_file_location("flce_tools_plot_clocks", path)
    assert spec is not None and spec.loader is not None
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    summary = clocks.summarize([clocks.Sample(1380, 66, 640, 0x4), clocks.Sample(345, 87, 230, 0x20)])
    assert summary is not None
    run = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-27", "versions": {"torch": "2.11.0"},
           "command": "python tools/benchmarks/peers.py", "clocks": dataclasses.asdict(summary)}
    text = plot.footer(run, width=1 << 20)
    assert "SM clock 862 MHz mean (345-1380), 87 C at most" in text
    assert "software thermal slowdown" in text and "HELD BACK" in text
    assert "SM clock" not in plot.footer({**run, "clocks": None}, width=1 << 20)
    cool = clocks.summarize([clocks.Sample(1700, 60, 450, 0x4)])
    assert cool is not None
    merged = plot.footer({**run, "clocks": [dataclasses.asdict(cool), dataclasses.asdict(summary)]}, width=1 << 20)
    assert merged.index("SM clock 1700 MHz mean") < merged.index("SM clock 862 MHz mean") and "HELD BACK" in merged
