"""The launch configurations the kernel choice (cuda/choice.py) gives the launchers: the row kernels' blocks and
the Triton GEMMs' tiles (which family takes each role: families/KernelChoice). Plain data, importable without
Triton, so the choice can be made and printed on a machine that has neither the GPU nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.backends.cuda.hardware import has_tma
from flce.engine.choice import DeviceDescription

_MAX_SPLITS = 256


@dataclass(frozen=True)
class LaunchParams:
    """A row kernel's launch: columns per block and warps per program (tuned, or the launcher's rule)."""

    block_v: int
    num_warps: int | None = None  # None: 8 for blocks of 2048 columns or more, else 4


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch of the Triton fused GEMMs; the autotune cache stores these as gemm_* knobs."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    splits: int | None = None  # None: chosen per call from the SM count (gemm_ops.split_count)
    # Tensor-descriptor loads: set by the family that launches (triton_gemm.py); in a cache entry, gemm_tma=false
    # asks for the family without them.
    tma: bool = True
    # The gradient GEMM only: one program per SM walking the tiles, with TMA stores (the choice turns it off where
    # the gradient's rows are not 16-byte aligned; the family without TMA never runs it).
    persistent: bool = True

    @staticmethod
    def from_params(params: dict) -> GemmConfig | None:
        """The gemm_* knobs of an autotune entry, or None when any is missing or unusable."""
        def knob(name: str, allowed: tuple[int, ...]) -> int | None:
            value = params.get(name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value in allowed
            return value if ok else None

        powers = (16, 32, 64, 128, 256)
        values = (knob("gemm_block_m", powers), knob("gemm_block_n", powers), knob("gemm_block_k", powers),
                  knob("gemm_group_m", (1, 2, 4, 8, 16, 32)), knob("gemm_warps", (4, 8)),
                  knob("gemm_stages", (1, 2, 3, 4, 5, 6)))
        if any(v is None for v in values):
            return None
        splits = params.get("gemm_splits")
        if not (isinstance(splits, int) and not isinstance(splits, bool) and 1 <= splits <= _MAX_SPLITS):
            splits = None
        return GemmConfig(*values, splits=splits, tma=params.get("gemm_tma") is not False,  # type: ignore[arg-type]
                          persistent=params.get("gemm_persistent") is not False)

    def as_params(self) -> dict:
        params = {"gemm_block_m": self.block_m, "gemm_block_n": self.block_n, "gemm_block_k": self.block_k,
                  "gemm_group_m": self.group_m, "gemm_warps": self.num_warps, "gemm_stages": self.num_stages}
        if self.splits is not None:
            params["gemm_splits"] = self.splits
        if not self.tma:
            params["gemm_tma"] = False
        if not self.persistent:
            params["gemm_persistent"] = False
        return params

    def text(self) -> str:
        return (f"tiles {self.block_m}x{self.block_n}x{self.block_k}, group {self.group_m}, {self.num_warps} warps, "
                f"{self.num_stages} stages, splits {self.splits or 'by SM count'}, TMA {'on' if self.tma else 'off'}")


# Shared memory one block needs for the default tiles, compiled by Triton 3.6: 3 stages of a 128 x 256 x 64 16-bit
# tile pair take 147 KiB with TMA loads (the persistent gradient GEMM's TMA store adds 32 KiB), 96 KiB with pointer
# loads (two buffers in flight).
_DEFAULT_TILES_SHARED_MEMORY = {True: 180 * 1024, False: 96 * 1024}


def default_gemm_config(device: DeviceDescription, dtype: torch.dtype) -> GemmConfig:
    """GPUs: 128 x 256 x 64 tiles, 8 warps, 3 stages, the fastest of six configurations on the H200
    at three LM shapes (95-98% of cuBLAS's TFLOP/s; docs/benchmarks.md); fp32 operands halve the K
    step to keep shared memory per stage the same. A GPU whose blocks get less shared memory than those tiles need
    (sm_120's 99 KiB beside TMA) takes 128 x 128 tiles in 2 stages, which fit it (tools/compat/compile_for_gpus.py
    checks every kernel's need against the GPU's); not measured on such a GPU. The interpreter: small tiles, so CPU
    tests run in seconds."""
    if device.interpreter:
        return GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1, tma=False)
    block_k = 32 if dtype == torch.float32 else 64
    if 0 < device.shared_memory < _DEFAULT_TILES_SHARED_MEMORY[has_tma(device)]:
        return GemmConfig(block_n=128, block_k=block_k, num_stages=2)
    return GemmConfig(block_n=256, block_k=block_k)


@dataclass(frozen=True)
class LaunchSettings:
    """The launch configuration of one call's kernels: the row kernels' blocks, the Triton GEMMs' tiles (with
    ``persistent`` settled for the call's operands) and the columns per block of the cuBLAS + row-kernel scan that
    stands in for a statistics GEMM that failed to compile."""

    launch: LaunchParams
    gemm: GemmConfig
    fallback_scan_block: int
    # Linear distillation's one-kernel passes (distill_kernels._pair_passes_kernel): its programs, each walking
    # rows p, p + P, ...; None: one program a row.
    rows_in_flight: int | None = None
    # and the registers a thread of it may use (plan.PAIR_REGISTERS; None: the compiler's choice)
    pair_registers: int | None = None
    # Where the row kernels' blocks and the GEMMs' tiles came from, as the record says it.
    launch_source: str = "heuristic"
    gemm_source: str = "heuristic"
