"""tools/benchmarks/distillation_step.py on the CPU: TRL's DistillationTrainer.compute_loss over its own
_chunked_divergence_loss and over flce's drop-in take their steps in interleaved rounds on the same models and batch,
and their losses and logged entropies agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_tool

SMALL = ["--device", "cpu", "--student", "32x1", "--teacher", "48x2", "--vocab", "300", "--batch", "2",
         "--prompt", "6", "--completion", "12"]


@pytest.fixture(scope="module")
def distillation_step():
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    return load_tool("tools/benchmarks/distillation_step.py")


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_cpu_run_reports_both_methods(distillation_step, beta: float, tmp_path: Path) -> None:
    argv = SMALL + ["--rounds", "2", "--beta", str(beta), "--temperature", "0.7", "--out", str(tmp_path)]
    assert distillation_step.main(argv) == 0
    report = json.loads((tmp_path / "distillation_step.json").read_text())
    assert set(report["methods"]) == {"trl", "flce"}
    # Two sequences of 12 completion tokens, the second's last quarter padded.
    assert report["completion_tokens"] == 12 + 9
    for method in report["methods"].values():
        assert len(method["samples_ms"]) == 2 and all(s > 0 for s in method["samples_ms"])
        assert method["loss"] > 0 and method["entropy"] > 0
    assert report["loss_relative_difference"] <= 1e-5
    assert report["entropy_relative_difference"] <= 1e-5
    assert report["flce_over_trl"] == pytest.approx(report["methods"]["flce"]["median_ms"]
                                                    / report["methods"]["trl"]["median_ms"])
    assert "| flce |" in (tmp_path / "distillation_step.md").read_text()


def test_the_methods_differ_only_in_the_divergence_loss(distillation_step) -> None:
    import torch

    from flce.integrations import trl as flce_trl

    args = distillation_step.parse_args(SMALL)
    model = torch.nn.Linear(2, 2)
    ours = distillation_step.trainer(flce_trl.chunked_divergence_loss, model, model, args)
    theirs = distillation_step.trainer(distillation_step.trl_chunked_divergence_loss(), model, model, args)
    assert ours.compute_loss.__globals__["_chunked_divergence_loss"] is flce_trl.chunked_divergence_loss
    assert theirs.compute_loss.__globals__["_chunked_divergence_loss"] is not flce_trl.chunked_divergence_loss
    assert ours.compute_loss.__code__.co_code == theirs.compute_loss.__code__.co_code


def test_refuses_too_short_a_completion(distillation_step) -> None:
    with pytest.raises(SystemExit):
        distillation_step.parse_args(["--completion", "2"])
