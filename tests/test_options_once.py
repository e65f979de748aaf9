"""A call's options are checked once: where the user gives them (a module's constructor, the functional
form's keywords), never again on the way (the engine's derived configs, the compile path's ops, the
kernel choice). Counted by wrapping flce.config.validate_options and counting checks of every option."""

from __future__ import annotations

import pytest
import torch

import flce
from flce import config
from flce.autotune import override_params


@pytest.fixture
def full_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per check of all of a config's options (a derived config's single changed option is not
    counted: it is new, not checked again)."""
    counted: list[int] = []
    real = config.validate_options

    def counting(cfg: config.LCEConfig, names: tuple[str, ...]) -> None:
        if set(names) == set(config.option_names()):
            counted.append(1)
        real(cfg, names)

    monkeypatch.setattr(config, "validate_options", counting)
    return counted


def _inputs(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(48, 16, generator=generator).requires_grad_()
    w = torch.randn(40, 16, generator=generator).requires_grad_()
    return x, w, torch.randint(0, 40, (48,), generator=generator)


def _checks_in(calls: list[int], step) -> int:
    step()  # a first call may build memoised state (dispatch, compiled graphs)
    before = len(calls)
    step()
    return len(calls) - before


def test_functional_form_checks_once_per_call(full_checks: list[int], generator: torch.Generator) -> None:
    x, w, t = _inputs(generator)
    ids = torch.randint(0, 40, (48, 3), generator=generator)

    def plain() -> None:
        flce.linear_cross_entropy(x, w, t).backward()

    def selected() -> None:  # selected_ids derive a config that asks for log-probs too
        out = flce.linear_cross_entropy(x, w, t, selected_ids=ids, reduction="none")
        (out.loss.sum() + out.selected_logprobs.sum()).backward()

    assert _checks_in(full_checks, plain) == 1
    assert _checks_in(full_checks, selected) == 1


def test_module_checks_at_construction_only(full_checks: list[int], generator: torch.Generator) -> None:
    x, w, t = _inputs(generator)
    loss_fn = flce.get_impl("cpu")(class_weight=torch.rand(40, generator=generator) + 0.5, label_smoothing=0.1)
    assert len(full_checks) == 1
    loss_fn.to(torch.float64).to(torch.float32)  # the class weights buffer is a new tensor: cfg is derived

    def step() -> None:
        loss_fn(x, w, t).backward()

    assert _checks_in(full_checks, step) == 0
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)

    def compiled_step() -> None:
        compiled(x, w, t).backward()

    assert _checks_in(full_checks, compiled_step) == 0


def test_cuda_backend_checks_once_per_call(full_checks: list[int], generator: torch.Generator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the Triton interpreter, the chunk gradient from kept exponentials included (it used to build
    a config per chunk)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    from flce.backends.cuda import ops

    chunks = []
    real = ops.TritonChunkKernels.gemm_exp_grad
    monkeypatch.setattr(ops.TritonChunkKernels, "gemm_exp_grad",
                        lambda self, hidden, *args: chunks.append(hidden.shape[0]) or real(self, hidden, *args))
    x, w, t = _inputs(generator)

    def step() -> None:
        knobs = {"tokens_per_chunk": 16, "grad_schedule": "token_chunks", "chunk_grad": "exponentials"}
        with override_params(knobs, backend="cuda"):
            flce.linear_cross_entropy(x, w, t, backend="cuda").backward()

    assert _checks_in(full_checks, step) == 1
    assert chunks == [16, 16, 16] * 2, "the kept-exponentials path ran, three chunks a call"
