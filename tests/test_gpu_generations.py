"""Every NVIDIA generation a user has, without its GPU: for an sm_80, sm_89, sm_100a and sm_120 GPU, every Triton
kernel flce would give it compiles for its target within its shared memory, and is the set ``python -m flce
explain`` names (tools/compat/compile_for_gpus.py); explain says for each generation which kernel family takes each
role and why the others do not; FLCE_CUDA_PLAN_AS plans a real GPU's calls as another's (its GPU lane:
tests/test_generic_path_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flce

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
GENERATIONS = {"NVIDIA A100-SXM4-80GB": "sm_80", "NVIDIA L40S": "sm_89", "NVIDIA B200": "sm_100a",
               "NVIDIA GeForce RTX 5090": "sm_120a"}


@pytest.mark.parametrize("gpu", list(GENERATIONS))
def test_every_kernel_a_generation_is_given_compiles_for_it(gpu: str, tmp_path: Path) -> None:
    """In a process without TRITON_INTERPRET, under whichever Triton the suite runs with."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "compiled.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "compat" / "compile_for_gpus.py"), "--gpu", gpu,
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(out.read_text())
    assert report["problems"] == []
    assert {v["target"].split()[1].rstrip(",") for v in report["variants"]} == {GENERATIONS[gpu]}
    # explain names exactly what compiles for each call (none of it is the Hopper-only Gluon GEMM)
    assert report["named"] == report["compiled"]
    assert not any("ws_gemm_kernels" in k for kernels in report["compiled"].values() for k in kernels)
    calls = {call.rsplit(",", 1)[0] for call in report["compiled"]}
    assert {"default", "forward only", "rl deferred", "tuned: fused gradient GEMM"} <= calls


@pytest.mark.parametrize(("gpu", "statistics", "passed_over"), [
    ("NVIDIA A100-SXM4-80GB", "triton", ["warp_specialized: sm_80: the kernels are written for sm_90 (Hopper)",
                                         "triton_tma: sm_80: no TMA (sm_90 and later)"]),
    ("NVIDIA L40S", "triton", ["warp_specialized: sm_89", "triton_tma: sm_89: no TMA"]),
    ("NVIDIA GeForce RTX 4090", "triton", ["warp_specialized: sm_89", "triton_tma: sm_89: no TMA"]),
    ("NVIDIA B200", "triton_tma", ["warp_specialized: sm_100: the kernels are written for sm_90 (Hopper)"]),
])
def test_explain_answers_for_each_generation(gpu: str, statistics: str, passed_over: list[str]) -> None:
    """Each role's family and why the faster ones were passed over, for a forward-only and a training call."""
    forward = flce.explain("cuda", gpu=gpu, shape="8192x4096x128256", dtype="bfloat16", training=False)
    text = str(forward)
    assert forward.backend == "cuda" and f"heuristic: {statistics}" in text, text
    for reason in passed_over:
        assert reason in text, (reason, text)
    training = str(flce.explain("cuda", gpu=gpu, shape="8192x4096x128256", dtype="bfloat16"))
    assert "heuristic: cublas" in training and "ws_gemm_kernels" not in training, training
    assert "measured slower than cuBLAS and the row kernel for a chunk's logits" in training


def _fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda answering as an H100 would (what hardware.describe_device asks the driver)."""
    from flce.backends.cuda import hardware

    props = SimpleNamespace(major=9, minor=0, multi_processor_count=132, total_memory=80 << 30,
                            shared_memory_per_block_optin=232448)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hardware._gpu.cache_clear()


def test_plan_as_another_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLCE_CUDA_PLAN_AS: the GPU at hand described with the named GPU's compute capability and name (so its
    kernel families and autotune entries), its own SM count, and the record saying so; an unknown name is refused."""
    from flce.backends.cuda import hardware

    _fake_h100(monkeypatch)
    cuda = torch.device("cuda", 0)
    try:
        assert hardware.describe_device(cuda).capability == (9, 0)
        monkeypatch.setenv(hardware.PLAN_AS_ENV, "NVIDIA A100-SXM4-80GB")
        planned = hardware.describe_device(cuda)
        assert (planned.name, planned.capability, planned.multiprocessors) == ("NVIDIA A100-SXM4-80GB", (8, 0), 132)
        assert planned.runs_on == "NVIDIA H100 80GB HBM3" and "planned as this GPU" in planned.text()
        assert not hardware.has_tma(planned) and not hardware.is_hopper(planned)
        monkeypatch.setenv(hardware.PLAN_AS_ENV, "NVIDIA Imaginary")
        with pytest.raises(ValueError, match="FLCE_CUDA_PLAN_AS='NVIDIA Imaginary': not a GPU flce knows"):
            hardware.describe_device(cuda)
    finally:
        hardware._gpu.cache_clear()
