"""What the kernel choice (cuda/choice.py) tells the launchers: which kernel takes each role, and their
launch configurations. Plain data, importable without Triton, so the choice can be made and printed on a
machine that has neither the GPU nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.backends.cuda.hardware import has_tma
from flce.engine.choice import DeviceDescription

# The kernels a role can take: the warp-specialised Gluon GEMM (ws_gemm_kernels), the Triton fused GEMM
# (gemm_kernels), cuBLAS (torch.mm) and the row kernels (kernels.py).
WARP_SPECIALIZED = "warp_specialized"
TRITON = "triton"
CUBLAS = "cublas"
_MAX_SPLITS = 256
# The kernels the choice and the launchers name alike (the record's dotted paths; the fallback registry's keys).
_K = "flce.backends.cuda."
WS_GEMM = _K + "ws_gemm_kernels._ws_gemm_kernel"
TRITON_STATS_GEMM = _K + "gemm_kernels._gemm_row_stats_kernel"
GRAD_PERSISTENT = _K + "gemm_kernels._gemm_grad_persistent_kernel"
GRAD_TILES = _K + "gemm_kernels._gemm_grad_kernel"
# The warp-specialised kernel's statistics epilogue and its plain products compile as separate constexpr
# variants, so one can fail where the other does not: the fallback registry keeps them apart.
WS_STATISTICS, WS_PRODUCTS = "statistics", "products"


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
    tma: bool = True  # tensor-descriptor loads (the choice turns it off where the GPU or the operands cannot)
    # The gradient GEMM only: one program per SM walking the tiles, with TMA stores (where tma applies).
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


def default_gemm_config(device: DeviceDescription, dtype: torch.dtype) -> GemmConfig:
    """GPUs: 128 x 256 x 64 tiles, 8 warps, 3 stages, the fastest of six configurations on the H200
    at three LM shapes (95-98% of cuBLAS's TFLOP/s; docs/benchmarks.md); fp32 operands halve the K
    step to keep shared memory per stage the same; TMA loads where the GPU has them. The interpreter:
    small tiles, so CPU tests run in seconds."""
    if device.interpreter:
        return GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1, tma=False)
    return GemmConfig(block_n=256, block_k=32 if dtype == torch.float32 else 64, tma=has_tma(device))


@dataclass(frozen=True)
class KernelChoice:
    """The launchers' instructions for one call. ``stats``: the fused statistics GEMM where only statistics
    are taken (WARP_SPECIALIZED or TRITON); ``logits``: where it also writes a chunk's logits or kept
    exponentials; ``products``: the gradient products G @ W and G.T @ x (WARP_SPECIALIZED or CUBLAS);
    ``launch``: the row kernels' blocks; ``gemm``: the Triton GEMMs' tiles, with ``tma`` and ``persistent``
    already settled for this device and these operands."""

    stats: str
    logits: str
    products: str
    launch: LaunchParams
    gemm: GemmConfig
    # columns per block of the cuBLAS + row-kernel scan that stands in for a statistics GEMM failing to compile
    fallback_scan_block: int

    @property
    def grad_gemm(self) -> str:
        """The fused gradient GEMM's kernel: persistent with TMA stores where the configuration settled on it."""
        return GRAD_PERSISTENT if self.gemm.persistent else GRAD_TILES
