"""The CUDA backend's kernel families as objects (flce/backends/cuda/families): a new family is its module and one
registration, and from there the choice, the launchers, the record, the fallback chain, flce-autotune and
``python -m flce info`` all take it; the choice's chains hold only families that fit the call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flce.backends.cuda import families
from flce.backends.cuda.families.family import (
    CHUNK_LOGITS,
    PRODUCTS,
    ROLES,
    STATISTICS,
    KernelFamily,
)

B200, H100 = "NVIDIA B200", "NVIDIA H100 80GB HBM3"


class BlackwellStatistics(KernelFamily):
    """What a Blackwell family's module would hold, here launching cuBLAS and the row kernels (so its results
    are right everywhere) and recording that it was asked."""

    name = "blackwell_test"
    title = "a test family for sm_100"
    roles = frozenset({STATISTICS, CHUNK_LOGITS})
    fused = True
    fallback = "triton"
    launched: list[str] = []

    def unfit(self, device, call, role):
        if role not in self.roles:
            return super().unfit(device, call, role)
        return None if device.capability == (10, 0) else f"{device.arch}: written for sm_100"

    def kernels(self, role, settings, call):
        return ("flce.backends.cuda.kernels._row_stats_kernel",)

    def statistics(self, settings, hidden, weight, bias, target, cfg, vocab_offset, logits_out, against=None):
        self.launched.append(STATISTICS if logits_out is None else CHUNK_LOGITS)
        return families.family_named("cublas").statistics(settings, hidden, weight, bias, target, cfg, vocab_offset,
                                                          logits_out)

    def tuning_candidates(self, device, shape, quick):
        return [] if device.capability != (10, 0) else [{"forward_logits": "fused", "logits_kernel": self.name}]


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> BlackwellStatistics:
    """The one registration line: the family first in families.FAMILIES."""
    family = BlackwellStatistics()
    family.launched = []
    monkeypatch.setattr(families, "FAMILIES", (family, *families.FAMILIES))
    return family


def test_a_new_family_is_one_module_and_one_registration(registered: BlackwellStatistics,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from planning import cuda_choice, described_gpu, meta_inputs

    import flce
    from flce.autotune import spaces
    from flce.autotune.lookup import TunedEntry
    from flce.backends.cuda import hardware, plan
    from flce.backends.cuda.availability import kernel_availability
    from flce.backends.cuda.ops import TritonChunkKernels
    from flce.config import LCEConfig

    # The choice takes it where it fits, passes over it with its reason where it does not.
    b200 = str(flce.explain("cuda", gpu=B200, shape="8192x4096x128256", training=False))
    assert "heuristic: blackwell_test" in b200, b200
    h100 = str(flce.explain("cuda", gpu=H100, shape="8192x4096x128256", training=False))
    assert "blackwell_test: sm_90: written for sm_100" in h100 and "so warp_specialized" in h100, h100
    # Its fallback chain is its own (should its kernel fail to compile in a call: the Triton family without TMA,
    # then cuBLAS); once it failed, later calls plan the next family that fits, and their record says why.
    record, kernels = cuda_choice(meta_inputs(8192, 4096, 128256), training=False, device=described_gpu(B200))
    assert [f.name for f in kernels.chains[STATISTICS]] == ["blackwell_test", "triton", "cublas"]
    failed = {("blackwell_test", STATISTICS): "OutOfResources: test"}
    after, chosen = cuda_choice(meta_inputs(8192, 4096, 128256), training=False, device=described_gpu(B200),
                                failed=failed)
    assert chosen.family(STATISTICS).name == "triton_tma"
    assert "blackwell_test: fallback: it failed to compile here earlier (OutOfResources: test)" in str(after)
    # The launchers hand it the role's work.
    x, w = torch.randn(8, 16), torch.randn(64, 16)
    t = torch.randint(0, 64, (8,))
    TritonChunkKernels(kernels).gemm_row_stats(x, w, None, t, LCEConfig(), 0)
    assert registered.launched == [STATISTICS]
    # flce-autotune times it, and reads it back from a cache entry.
    monkeypatch.setattr(hardware, "describe_device", lambda device: described_gpu(B200))
    shape = spaces.TuneShape(torch.device("cpu"), torch.bfloat16, hidden=4096, vocab=128256, tokens=8192,
                             variant="plain")
    candidates = spaces.tuning_space("cuda").candidates(shape, True)
    assert any(c.get("logits_kernel") == "blackwell_test" for c in candidates)
    assert plan.tuned_knobs(TunedEntry({"logits_kernel": "blackwell_test"}, None, "t")).logits_kernel == \
        "blackwell_test"
    # python -m flce info lists it.
    assert any(name.startswith("blackwell_test:") for name, _, _ in kernel_availability(torch.device("cpu")))


@pytest.mark.parametrize("gpu", [H100, "NVIDIA A100-SXM4-80GB", B200, "NVIDIA L40S"])
@pytest.mark.parametrize("options", [{}, {"precision": "accurate"}, {"return_logit_stats": True},
                                     {"reduction": "none", "return_logprobs": True, "temperature": 0.7}])
def test_chains_hold_only_families_that_fit(gpu: str, options: dict) -> None:
    """Every family in every role's chain fits the call on the device, the chain ends with cuBLAS (which cannot
    fail to compile) and the products never take a Triton GEMM (it has no products kernel)."""
    from planning import cuda_choice, described_gpu, meta_inputs

    from flce.config import LCEConfig
    from flce.engine.choice import CallDescription
    from flce.engine.plans import PlanRequest

    device, flat, cfg = described_gpu(gpu), meta_inputs(8192, 4096, 128256), LCEConfig(**options)
    _, kernels = cuda_choice(flat, cfg, device=device)
    call = CallDescription.of(flat, cfg, "full" if cfg.needs_full else "plain", PlanRequest(training=True))
    for role in ROLES:
        chain = kernels.chains[role]
        assert all(family.unfit(device, call, role) is None for family in chain), (role, chain)
        if chain:
            assert chain[-1].name == "cublas", (role, chain)
    assert all(not family.name.startswith("triton") for family in kernels.chains[PRODUCTS])
