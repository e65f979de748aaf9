"""The Ascend kernels through triton-ascend's own compiler.

triton-ascend installs itself as ``triton``, so it lives in its own environment, build/ascend-venv
(``make ascend-venv``; ``make test ASCEND=1`` and CI build it first). test_every_variant_lowers_and_fits_the_ub
runs tools/ascend/compile_check.py there: every kernel variant flce's launchers produce goes through
triton-ascend's frontend (``ttir``) and ``triton-adapter-opt`` (``ttadapter``), stops only where
BiSheng (CANN, not installable here) would take over, and its inner loop's UB footprint read from the
adapter's IR fits the tiling's estimate and share. The footprint reader itself is tested here on
small IR written for the purpose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "ascend"))

from ub_footprint import loop_footprints, shaped_bytes  # noqa: E402

ASCEND_PYTHON = Path(os.environ.get("FLCE_ASCEND_VENV", REPO / "build" / "ascend-venv")) / "bin" / "python"
KERNELS = ("_plain_loss_kernel", "_plain_grad_kernel", "_row_stats_kernel", "_full_grad_kernel", "_scale_kernel",
           "_pair_stats_kernel", "_mixture_sums_kernel", "_pair_grad_kernel")
FLAGS = {
    "_plain_loss_kernel": ("WRITE_GRAD", "WIDE_OFFSETS"),
    "_plain_grad_kernel": ("WIDE_OFFSETS",),
    "_row_stats_kernel": ("HAS_SOFTCAP", "HAS_TEMPERATURE", "HAS_CLASS_WEIGHT", "NEED_SUM_EXP_DZ",
                          "NEED_WEIGHTED_SUM_Z", "NEED_ARGMAX", "WIDE_OFFSETS"),
    "_full_grad_kernel": ("HAS_SOFTCAP", "HAS_TEMPERATURE", "HAS_CLASS_WEIGHT", "HAS_H", "HAS_E", "WIDE_OFFSETS"),
    "_scale_kernel": ("WIDE_OFFSETS",),
    # Linear distillation's (CROSS and LOSS are 0 for one loss each, else the others).
    "_pair_stats_kernel": ("CROSS", "HARD", "HARD_OWN_LSE", "WIDE_OFFSETS"),
    "_mixture_sums_kernel": ("WIDE_OFFSETS",),
    "_pair_grad_kernel": ("LOSS", "SOFT", "HARD", "TEACHER", "WIDE_OFFSETS"),
}

# Two loops over 64-element f32 tiles, in the adapter's printed forms. The second reuses the first's
# value names, as MLIR does in sibling regions.
IR = """\
module {
  func.func @k(%arg0: memref<?xf32>, %arg1: i32) attributes {mix_mode = "aiv"} {
    %cst = arith.constant 1.000000e+00 : f32
    %0 = tensor.empty() : tensor<64xf32>
    %1 = linalg.fill ins(%cst : f32) outs(%0 : tensor<64xf32>) -> tensor<64xf32>
    scf.for %arg2 = %c0_i32 to %arg1 step %c64_i32  : i32 {
      %view = memref.reinterpret_cast %arg0 to offset: [0], sizes: [64], strides: [1] : memref<?xf32> to memref<64xf32>
      %alloc = memref.alloc() : memref<64xf32>
      memref.copy %view, %alloc : memref<64xf32> to memref<64xf32>
      %2 = bufferization.to_tensor %alloc restrict writable : memref<64xf32>
      %3 = arith.addf %2, %1 : tensor<64xf32>
      %4 = math.exp %3 : tensor<64xf32>
      %5 = arith.cmpf ogt, %4, %1 : tensor<64xf32>
      %6 = arith.select %5, %4, %1 : tensor<64xi1>, tensor<64xf32>
      bufferization.materialize_in_destination %6 in writable %view : (tensor<64xf32>, memref<64xf32>) -> ()
    }
    scf.for %arg2 = %c0_i32 to %arg1 step %c64_i32  : i32 {
      %view = memref.reinterpret_cast %arg0 to offset: [0], sizes: [64], strides: [1] : memref<?xf32> to memref<64xf32>
      %2 = math.exp %1 : tensor<64xf32>
      %3 = arith.truncf %2 : tensor<64xf32> to tensor<64xbf16>
      %reduced = linalg.reduce ins(%2 : tensor<64xf32>) outs(%0 : tensor<64xf32>) dimensions = []
        (%in: f32, %init: f32) {
          %7 = arith.addf %in, %init : f32
          linalg.yield %7 : f32
        }
      bufferization.materialize_in_destination %3 in writable %view : (tensor<64xbf16>, memref<64xf32>) -> ()
    }
    return
  }
}
"""


def test_shaped_bytes():
    assert shaped_bytes("tensor<4096xbf16>") == 8192
    assert shaped_bytes("memref<4096xf32, strided<[1], offset: ?>>") == 16384
    assert shaped_bytes("tensor<f32>") == 4
    assert shaped_bytes("tensor<64xi1>") == 64
    assert shaped_bytes("tensor<?xf32>") is None
    assert shaped_bytes("i32") is None


def test_footprint_double_buffers_tiles_and_keeps_invariants_live():
    first, second = loop_footprints(IR)
    # Loaded %alloc and stored %6 (2 x 256 B each, whole body), invariant %1 (256 B), and at the
    # exp both %3 and %4 (256 B each).
    assert first.peak_bytes == 512 + 512 + 256 + 512
    kinds = {b.value: b.kind for b in first.live_at_peak}
    assert kinds == {"%alloc": "loaded tile", "%6": "stored tile", "%1": "loop invariant",
                     "%3": "temporary", "%4": "temporary"}
    # The sibling loop's %2 and %3 are its own: stored bf16 %3 (2 x 128 B), %1, %2, the reduce's result.
    assert second.peak_bytes == 256 + 256 + 256 + 256
    assert {b.value for b in second.live_at_peak} == {"%1", "%2", "%3", "%reduced"}


def test_footprint_without_double_buffering_follows_liveness():
    first, _ = loop_footprints(IR, double_buffer=False)
    # At the select: %4, %5 (64 x i1), %6 and %1; the loaded tile died at the addf.
    assert first.peak_bytes == 256 + 64 + 256 + 256


def _require_ascend_venv() -> None:
    """Skip without triton-ascend's environment, saying how to build it; fail where it was asked
    for (`make test ASCEND=1`, which CI runs, sets FLCE_REQUIRE_ASCEND_VENV=1)."""
    if not ASCEND_PYTHON.exists():
        message = (f"{ASCEND_PYTHON} is missing: the Triton-Ascend compiler check needs it; build it with "
                   "`make ascend-venv` or run `make test ASCEND=1` (1.1 GB; CI always does)")
        if os.environ.get("FLCE_REQUIRE_ASCEND_VENV") == "1":
            pytest.fail(f"the triton-ascend compile check was asked for (ASCEND=1): {message}")
        pytest.skip(message)


def _run_check(tmp_path: Path) -> list[dict]:
    _require_ascend_venv()
    out = tmp_path / "variants.json"
    jobs = str(max(1, min(4, len(os.sched_getaffinity(0)))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([str(ASCEND_PYTHON), str(REPO / "tools" / "ascend" / "compile_check.py"), "--jobs", jobs,
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    summary = "\n".join(line for line in proc.stdout.splitlines() if not line.startswith("ERROR: Invalid bishengir"))
    assert proc.returncode == 0, f"compile check failed:\n{summary[-6000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_every_variant_lowers_and_fits_the_ub(tmp_path):
    results = _run_check(tmp_path)
    assert results, "the compile check produced no variants"
    for r in results:
        assert r["passed"] and not r["error"], r
        assert r["stages"][:2] == ["ttir", "ttadapter"], r
        # Without CANN the only stop allowed is BiSheng's; with it the binary must be there.
        assert r["stopped_at"].startswith("npubin: BiSheng") or "npubin" in r["stages"], r
        assert 0 < r["ir_footprint_bytes"] <= r["tiling_estimate_bytes"] <= r["ub_share_bytes"], r
    by_kernel: dict[str, list[dict]] = {}
    for r in results:
        by_kernel.setdefault(r["kernel"], []).append(r)
    assert sorted(by_kernel) == sorted(KERNELS)
    for kernel, flags in FLAGS.items():
        for flag in flags:
            seen = {bool(r["constants"][flag]) for r in by_kernel[kernel]}
            assert seen == {False, True}, f"{kernel}: {flag} only ever {seen}"
    contexts = " | ".join(c for r in results for c in r["contexts"])
    for needed in ("Ascend910B3", "Ascend910_9391", "Ascend910_9599", "V=32000", "V=128256", "V=151936",
                   "bfloat16", "float16", "float32"):
        assert needed in contexts, needed
    # The blocks the tiling picks differ between a 192 KiB and a 256 KiB UB, and all were compiled.
    assert len({r["block"] for r in results if r["kernel"] == "_full_grad_kernel"}) >= 2


def test_info_in_the_triton_ascend_environment_says_why_unavailable():
    """`python -m flce info` with triton-ascend installed but no torch_npu, NPU or CANN."""
    _require_ascend_venv()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([str(ASCEND_PYTHON), "-m", "flce", "info"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("ascend"))
    assert "no Ascend NPU: torch_npu is not installed" in row, row
    assert "triton-ascend 3.2.0 is installed" in row and "bishengir-compile" in row, row
