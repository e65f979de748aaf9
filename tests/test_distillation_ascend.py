"""The Ascend backend's linear distillation kernels (flce/backends/ascend/distill_kernels.py) against the
float64 oracle: under the Triton interpreter on CPU tensors (``backend="ascend"``, TRITON_INTERPRET=1, which
tests/conftest.py sets without a GPU), in fp32, with a Unified Buffer small enough that every row spans
several vocabulary blocks; on a real NPU where there is one. tests/test_ascend_toolchain.py lowers the same
kernels through triton-ascend's compiler."""

from __future__ import annotations

import os

import pytest
import torch
from distillation_helpers import assert_matches_oracle, make_pair

from flce.backends.ascend import ops
from flce.explain_distillation import explain_distillation

LOSSES = ("forward_kl", "reverse_kl", "jsd")
# A UB this small gives pair_grad blocks of 16 columns: a row of 40 spans three, the last one partial.
SMALL_UB = "4096"


def _device() -> str:
    return "npu" if os.environ.get("FLCE_ASCEND_DISTILLATION_DEVICE") == "npu" else "cpu"


# On CPU tensors the Ascend kernels run only in the interpreter, which tests/conftest.py turns on where there is no
# GPU (with one, Triton compiles for it, and the registry offers the Ascend backend no CPU tensors).
runs_kernels = pytest.mark.skipif(_device() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="the Ascend kernels on CPU tensors need the Triton interpreter "
                                         "(TRITON_INTERPRET=1, set by tests/conftest.py on machines without a GPU)")


@pytest.fixture(autouse=True)
def small_unified_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.ENV_UB_BYTES, SMALL_UB)


pytestmark = pytest.mark.triton


@runs_kernels
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_losses_with_hard_labels_and_a_temperature(loss: str, reduction: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True).detached(_device())
    assert_matches_oracle(pair, generator, loss=loss, reduction=reduction, hard_label_weight=0.3, temperature=0.7,
                          backend="ascend", memory_budget=1000)


@runs_kernels
@pytest.mark.parametrize("loss", LOSSES)
def test_teacher_gradient_and_beta(loss: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, scale=2.0).detached(_device())
    assert_matches_oracle(pair, generator, loss=loss, beta=0.2, temperature=1.6, teacher_grad=True, backend="ascend")


@runs_kernels
@pytest.mark.parametrize("hard_label_weight", [0.0, 1.0])
def test_only_one_term_and_no_target(hard_label_weight: float, generator: torch.Generator) -> None:
    pair = make_pair(generator, target=hard_label_weight > 0).detached(_device())
    assert_matches_oracle(pair, generator, loss="jsd", reduction="sum", hard_label_weight=hard_label_weight,
                          backend="ascend")


def test_the_record_names_the_kernels() -> None:
    record = explain_distillation("npu", shape=(8192, 4096, 8192, 128256), loss="jsd", hard_label_weight=0.5)
    names = record.kernel_names()
    for kernel in ("_pair_stats_kernel", "_mixture_sums_kernel", "_pair_grad_kernel"):
        assert f"flce.backends.ascend.distill_kernels.{kernel}" in names
    assert "BLOCK_V" in str(record)
