"""tools/benchmarks/gkd_step.py on the CPU: TRL's GKD compute_loss and flce's mixin each take their steps in
interleaved rounds, on the same models and batch, and their losses agree with each other and with TRL's on float64
copies of the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_tool


@pytest.fixture(scope="module")
def gkd_step():
    pytest.importorskip("transformers")
    return load_tool("tools/benchmarks/gkd_step.py")


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_cpu_run_reports_both_methods(gkd_step, beta: float, tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--student", "32x1", "--teacher", "48x2", "--vocab", "300", "--batch", "2",
            "--seq", "16", "--rounds", "2", "--beta", str(beta), "--float64-check", "--out", str(tmp_path)]
    assert gkd_step.main(argv) == 0
    report = json.loads((tmp_path / "gkd_step.json").read_text())
    assert set(report["methods"]) == {"trl", "flce"}
    for method in report["methods"].values():
        assert len(method["samples_ms"]) == 2 and all(s > 0 for s in method["samples_ms"])
        assert method["median_ms"] == pytest.approx(sum(method["samples_ms"]) / 2)
    assert report["loss_relative_difference"] <= 1e-5
    assert all(error <= 1e-5 for error in report["float64_relative_error"].values())
    assert report["flce_over_trl"] == pytest.approx(report["methods"]["flce"]["median_ms"]
                                                    / report["methods"]["trl"]["median_ms"])
    assert "| flce |" in (tmp_path / "gkd_step.md").read_text()


def test_refuses_a_model_without_layers(gkd_step) -> None:
    with pytest.raises(SystemExit):
        gkd_step.parse_args(["--student", "2048"])
