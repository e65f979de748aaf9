"""flce/backends/cuda/gluon_compat.py: the Gluon names the kernels use on this Triton, the probe that says
whether the warp-specialised GEMM can be built, the launchers' fallback when it cannot, and what
``python -m flce info`` says. (That the kernels compile on each Triton: tests/test_ws_gemm.py.)"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("triton")

from flce.backends.cuda import gluon_compat


def test_this_triton_builds_the_gluon_kernels_with_its_own_names() -> None:
    version = gluon_compat.triton_version()
    assert version is not None and gluon_compat.OLDEST_TRITON <= version <= gluon_compat.NEWEST_TESTED_TRITON
    ok, why = gluon_compat.gluon_support()
    assert ok and why.startswith(f"triton {version[0]}.{version[1]}: "), why
    # 3.9 keeps the old TMA names as functions that raise: from 3.8 on, the new names must be the ones used.
    new_names = version >= (3, 8)
    assert gluon_compat.tma_load.__name__ == ("async_load" if new_names else "async_copy_global_to_shared")
    assert gluon_compat.tma_store.__name__ == ("async_store" if new_names else "async_copy_shared_to_global")
    assert gluon_compat.cta_barrier.__name__ == ("barrier" if version >= (3, 7) else "thread_barrier")


@pytest.mark.parametrize("version,ok,reason", [
    (None, False, "triton is not installed"),
    ((3, 4), False, "triton 3.4 is older than 3.5"),
    ((3, 10), True, "triton 3.10: Gluon with TMA, wgmma and warp specialisation (newer than 3.9, the newest tested)"),
])
def test_the_probe_says_why_not(monkeypatch: pytest.MonkeyPatch, version, ok: bool, reason: str) -> None:
    monkeypatch.setattr(gluon_compat, "triton_version", lambda: version)
    monkeypatch.setattr(gluon_compat, "_support", None)  # probed again under the patched version
    got_ok, got_reason = gluon_compat.gluon_support()
    assert got_ok == ok and got_reason.startswith(reason), got_reason


def test_without_gluon_the_choice_takes_the_triton_gemm_and_cublas_with_one_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a Hopper GPU whose installed Triton cannot build the warp-specialised GEMM, the kernel choice takes the
    fused Triton GEMM and cuBLAS, its record says why, and the reason is logged once per process."""
    from planning import cuda_choice, meta_inputs

    from flce.backends.cuda import hardware
    from flce.backends.cuda.families import warp_specialized
    from flce.backends.cuda.families.family import ROLES

    monkeypatch.setattr(gluon_compat, "gluon_support", lambda: (False, "triton 3.4 is older than 3.5"))
    warp_specialized._say_once.cache_clear()
    gpu = hardware.gpu_description("NVIDIA H100 80GB HBM3", triton=hardware.installed_triton())
    with caplog.at_level(logging.WARNING, logger="flce"):
        for tokens in (8192, 4096):  # two calls: one log line
            record, kernels = cuda_choice(meta_inputs(tokens, 4096, 128256), device=gpu)
            assert not any(family.name == "warp_specialized" for role in ROLES for family in kernels.chains[role])
            assert not any("ws_gemm_kernels" in name for step in record.steps for name in step.kernels), record
            assert "triton 3.4 is older than 3.5" in str(record)
    notes = [r.getMessage() for r in caplog.records if "warp-specialised Gluon GEMM" in r.getMessage()]
    assert len(notes) == 1 and "triton 3.4 is older than 3.5" in notes[0], notes
    warp_specialized._say_once.cache_clear()


def test_info_lists_the_cuda_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    from flce.__main__ import main

    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("cuda kernels:"):].splitlines()
    gluon = next(line for line in lines if "warp-specialised GEMM (Gluon, sm_90a)" in line)
    # No GPU here: not available on the CPU, and the line says both what this Triton builds and why not.
    assert " no " in gluon and "Gluon with TMA" in gluon and "sm_90 GPU only" in gluon, gluon
    assert any(line.lstrip().startswith("row kernels (Triton)") for line in lines), lines
