"""The examples run (on the CPU, shortened) and show what they claim."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_loop_learns() -> None:
    losses = _load("train_tiny_lm").main(steps=40, device="cpu")
    assert len(losses) == 40
    # ln(512) = 6.2 at the start; the counting task is learnable, so the loss must fall clearly.
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_policy_gradient_step_matches_materialised_logits() -> None:
    result = _load("rl_policy_gradient").main(device="cpu")
    assert result["grad_norm"] > 0.0
    assert result["loss_error"] < 1e-5
    assert result["max_grad_error"] < 1e-5 * max(1.0, result["grad_norm"])
