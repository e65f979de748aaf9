"""tools/benchmarks/policy_peers.py on the CPU: its methods compute the same loss and gradients (they are compared
on equal work), TRL's formula in it equals the float64 oracle's, and its bookkeeping (each ratio to its own
round's floor, a peer that fails to load or to run, the table) with scripted timings in place of the GPU's."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
import torch

from flce.testing.policy_oracle import reference_policy_loss

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "benchmarks"


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("flce_tools_policy_peers", TOOLS / "policy_peers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    yield module
    sys.modules.pop("flce_tools_policy_peers", None)


def _setting(tool):
    return tool.Setting(batch=3, length=6, hidden=8, vocab=24, dtype=torch.float64)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_methods_compute_the_same_loss(tool, level: str) -> None:
    setting = _setting(tool)
    batch = tool.make_batch(setting, "cpu")
    results = {}
    steps = {name: tool.METHODS[name](setting, level) for name in tool.METHODS
             if name.startswith("flce")}
    steps["materialised TRL formula"] = lambda b: tool.materialised_formula(setting, level)(b.x, b.w, b)
    for name, step in steps.items():
        loss = step(batch)
        results[name] = (loss.detach(), *torch.autograd.grad(loss, (batch.x, batch.w)))
    oracle = reference_policy_loss(batch.x, batch.w, batch.target, batch.advantages, mask=batch.mask,
                                   old_logprobs=batch.old, ref_logprobs=batch.ref, loss_type="dapo",
                                   epsilon_low=setting.epsilon_low, epsilon_high=setting.epsilon_high,
                                   beta=setting.beta, importance_sampling_level=level,
                                   temperature=setting.temperature, entropy_weight=setting.entropy_weight)
    want = (oracle["loss"].detach(), *torch.autograd.grad(oracle["loss"], (batch.x, batch.w)))
    for name, got in results.items():
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_every_ratio_is_to_its_own_rounds_floor(tool, monkeypatch: pytest.MonkeyPatch) -> None:
    floors = iter([10.0, 8.0, 9.0])
    times = {"a": iter([12.0, 9.0, 9.9]), "b": iter([20.0, 17.0, 18.0])}  # per round, whatever the order

    def fake_measure(step, batch, setting):
        return {"ms": next(times[step(batch)]), "peak_mib": 3.0}

    def failing(setting, level):
        raise ImportError("no module named liger_kernel")

    def crashing_step(batch):
        raise RuntimeError("out of memory\nmore lines")

    monkeypatch.setattr(tool, "floor_ms", lambda batch, setting: next(floors))
    monkeypatch.setattr(tool, "measure", lambda step, batch, setting: (
        fake_measure(step, batch, setting) if step is not crashing_step else crashing_step(batch)))
    methods = {"a": lambda s, level: (lambda batch: "a"), "b": lambda s, level: (lambda batch: "b"),
               "liger": failing, "crash": lambda s, level: crashing_step}
    measured = tool.run_rounds(_setting(tool), methods, ("token",), rounds=3, device="cpu")
    # every other round in the reverse order (a method's place in a round weighs alike on all)
    forward = ["3-GEMM floor", "a", "b", "liger", "crash"]
    assert [r["method"] for r in measured] == forward + forward[:1] + forward[:0:-1] + forward
    rows = {r["method"]: r for r in tool.summary(measured)}
    ratios_a = [12.0 / 10.0, 9.0 / 8.0, 9.9 / 9.0]
    assert rows["a"]["ratio"] == pytest.approx(statistics.median(ratios_a))
    assert rows["a"]["ratio_range"] == pytest.approx((min(ratios_a), max(ratios_a)))
    assert rows["a"]["ms"] == pytest.approx(9.9) and rows["a"]["rounds"] == 3
    assert rows["b"]["ratio"] == pytest.approx(statistics.median([2.0, 17.0 / 8.0, 2.0]))
    assert rows["3-GEMM floor"]["ratio"] == 1.0
    assert rows["liger"]["error"] == "fails: ImportError: no module named liger_kernel"
    assert rows["crash"]["error"] == "fails: RuntimeError: out of memory"
    table = tool.markdown(tool.summary(measured), "header")
    assert "| token | a | 9.90 | 1.125 (1.100-1.200) | 3 |" in table
    assert "| token | liger | fails: ImportError: no module named liger_kernel | | |" in table


def test_quick_setting_is_small(tool) -> None:
    """--quick is a smoke run: a small shape with short timings."""
    quick = tool.QUICK
    assert quick.tokens * quick.vocab <= 1 << 23 and quick.rep_ms <= 200
