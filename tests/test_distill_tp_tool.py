"""tools/distributed/distill_tp.py on 2 gloo ranks of this CPU: its agreement checks pass (DTensor heads among them),
and both timings (each step alone from a barrier, calls back to back) come out per configuration with a ratio from
their medians."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "distributed" / "distill_tp.py"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun's gloo ranks")


def test_distill_tp_gloo_run_reports_both_timings(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TOOL),
               "--device", "cpu", "--shapes", "192x32x48x1001", "--rounds", "2", "--alone", "1", "--calls", "2",
               "--warmup", "1", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "distill_tp.json").read_text())
    assert len(report["checks"]) == 14 and all(c["passed"] for c in report["checks"])
    assert sum(c["loss"].endswith("DTensor heads") for c in report["checks"]) == 6
    assert all(c["worst over ranks"] <= c["limit"] for c in report["checks"])
    (timing,) = report["timings"]
    assert timing["shape"] == "192x32x48x1001"
    for mode, count in (("alone", 2), ("back_to_back", 2)):
        result = timing[mode]
        for config in ("tp1", "tp2"):
            samples = result[config]["samples"]
            assert len(samples) == count and all(s > 0 for s in samples)
            assert result[config]["range_ms"] == [min(samples), max(samples)]
        assert result["ratio"] == pytest.approx(result["tp2"]["median_ms"] / result["tp1"]["median_ms"])
    text = (tmp_path / "distill_tp.md").read_text()
    assert "| 192x32x48x1001 | alone (1 a round) |" in text
    assert "| 192x32x48x1001 | back to back (2 a round) |" in text


def test_distill_tp_refuses_empty_rounds() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--rounds", "0"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert run.returncode == 2 and "--rounds must be at least 1" in run.stderr
