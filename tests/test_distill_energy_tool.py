"""tools/benchmarks/distill_energy.py's arithmetic on the CPU: the passes less their restore copy, the call's time
beyond the floor part by part, the passes at the copy's rate, and the report of a saved run (its measurements need
an NVIDIA GPU and NVML; here they are scripted)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "benchmarks" / "distill_energy.py"
SAVED = REPO / "docs" / "data" / "distillation" / "h200-2026-11-29-energy-1c70dc8.json"


@pytest.fixture(scope="module")
def energy():
    spec = importlib.util.spec_from_file_location("flce_tools_distill_energy", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rounds(energy, ms: dict[str, float]) -> dict[str, list[dict[str, float]]]:
    """Two rounds per workload around the given ms (the median is their mean), 700 mJ a ms."""
    return {label: [{"ms": v * 0.99, "mJ": 700 * v * 0.99, "W": 700.0}, {"ms": v * 1.01, "mJ": 700 * v * 1.01,
                                                                        "W": 700.0}]
            for label, v in ms.items()}


def _scripted_ms(energy) -> dict[str, float]:
    ms = dict.fromkeys(energy.launches_a_call(4), 1.0)
    ms.update({"floor: the whole 4 GEMMs": 40.0, "flce: the whole call": 46.0, "floor: teacher logits": 10.0,
               "floor: student logits": 10.0, "floor: G @ W": 10.0, "floor: G.T @ x": 10.0,
               "chunk: teacher logits + statistics": 2.6, "chunk: student logits + statistics": 2.6,
               energy.PASSES: 0.7, energy.RESTORE: 0.2, "chunk: G @ W": 2.5,
               "chunk: grad_weight += G.T @ x": 2.8, "chunk: grad_weight = G.T @ x (the first)": 2.6})
    return ms


def test_the_ledger_splits_the_time_beyond_the_floor(energy) -> None:
    """4 chunks of 1024 rows: each part is its chunk launches less the floor's product it stands for, the passes
    less the restore each began with, and the rest closes the sum to the call's time beyond the floor."""
    shape, rows = "4096x4096x4096x1000", 1024
    med = energy.medians(_rounds(energy, _scripted_ms(energy)))
    assert med[energy.PASSES]["ms"] == pytest.approx(0.5)
    t = energy.ledger(shape, rows, med)
    assert t["logits"] == pytest.approx(4 * 5.2 - 20)
    assert t["grad_weight"] == pytest.approx(3 * 2.8 + 2.6 - 10)
    assert t["grad_hidden"] == pytest.approx(4 * 2.5 - 10)
    assert t["passes"] == pytest.approx(2.0)
    assert t["rest"] == pytest.approx(6.0 - 0.8 - 1.0 - 0.0 - 2.0)
    assert t["without_passes"] == pytest.approx(1 + 4.0 / 40)
    # The restore reads and writes [1024, 1000] bf16 in 0.2 ms: 4.096 MB at 20.48 GB a ms.
    rate = 2 * rows * 1000 * 2 / 0.2
    assert t["copy_tb_s"] == pytest.approx(rate / 1e9)
    assert t["two_reads_at_copy_rate"] == pytest.approx(1 + (4.0 + 4 * 10 * rows * 1000 / rate) / 40)
    assert t["one_read_at_copy_rate"] == pytest.approx(1 + (4.0 + 4 * 6 * rows * 1000 / rate) / 40)
    assert t["one_read_no_rest"] == pytest.approx(t["one_read_at_copy_rate"] - t["rest"] / 40)


def test_the_report_counts_each_workload_by_its_launches(energy) -> None:
    """J a call is a launch's mJ times the launches a call runs it; the restore gets no row of its own."""
    lines = energy.report("4096x4096x4096x1000", 1024, _rounds(energy, _scripted_ms(energy)))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert energy.RESTORE not in rows and "chunk: pair passes (less the restore)" in rows
    assert rows["chunk: grad_weight += G.T @ x"].endswith("| 3 | 5.88 |")  # 3 launches x 1960 mJ
    assert rows["chunk: pair passes (less the restore)"].endswith("| 4 | 1.40 |")  # 4 x (490 - 140) mJ
    assert any("x 1.150 the floor in time" in line for line in lines)


def test_a_saved_run_reports_without_a_gpu(tmp_path: Path) -> None:
    """--from-json prints the published run's tables and ledger from its rounds alone."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(TOOL), "--from-json", str(SAVED), "--markdown", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.count("ms beyond the floor") == 2 and "8192x4096x8192x128256" in text
