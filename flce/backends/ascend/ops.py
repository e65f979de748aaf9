"""Launchers for the Ascend kernels: device properties, UB tiling, grids.

:class:`AscendChunkKernels` implements flce.engine.kernels.RowKernels (no capabilities); the GEMMs around
it stay in torch (torch_npu runs them on the cube units). Triton is imported on the first launch,
never at import, so the tiling here (and the planner in plan.py) work (and are tested) without it.

Device properties come from the driver on an NPU, from environment variables when set (tests, or
a chip the tables below do not know), and from 910B defaults otherwise:

=============================  ==========================================================
FLCE_ASCEND_VECTOR_CORES       vector cores = programs per launch (910B: 40, 2 per AI core)
FLCE_ASCEND_UB_BYTES           Unified Buffer bytes per vector core (910B: 192 KiB)
FLCE_ASCEND_TOTAL_MEMORY       device memory in bytes (sets the logits-save limit)
=============================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from flce.config import LCEConfig
from flce.engine.memory import total_memory_bytes
from flce.engine.rows import torch_count_tokens, torch_matmul_
from flce.gradients import GradCoefficients
from flce.semantics import PartialRowStats, merge_partial_stats

KiB = 1 << 10

ENV_VECTOR_CORES = "FLCE_ASCEND_VECTOR_CORES"
ENV_UB_BYTES = "FLCE_ASCEND_UB_BYTES"
ENV_TOTAL_MEMORY = "FLCE_ASCEND_TOTAL_MEMORY"

# Atlas 800T/I A2 (910B): 20 AI cores, each with two vector cores; 192 KiB UB per vector core.
DEFAULT_VECTOR_CORES = 40
DEFAULT_UB_BYTES = 192 * KiB
# UB per vector core by SoC name prefix, as triton-ascend's target reports it (first match wins).
UB_BYTES_BY_ARCH = (
    ("Ascend910_95", 256 * KiB),
    ("Ascend910_93", 192 * KiB),
    ("Ascend910B", 192 * KiB),
)

# Share of the UB a block's estimated working set may use: the rest covers what the estimate
# cannot see (the compiler's scratch for reductions and casts, scalars, 32-byte alignment padding).
UB_SAFETY_FRACTION = 0.75
# The vector unit moves 32-byte units: 16 elements is the smallest block that fills one at 16 bits.
MIN_BLOCK_V = 16
# Beyond this a larger block saves no measurable loop overhead and only raises UB pressure.
MAX_BLOCK_V = 8192

# Rows of an fp32 gradient accumulator updated per GEMM: bounds the temporary.
FP32_ACCUMULATE_ROWS = 8192
# int32 offsets address this many elements; larger chunks switch the kernels to int64 row offsets.
INT32_LIMIT = 2**31


# ----------------------------------------------------------------------------- device properties


@dataclass(frozen=True)
class AscendDeviceProperties:
    """What the launchers and the planner need to know about one device."""

    vector_cores: int
    ub_bytes: int
    total_memory_bytes: int
    source: str  # where each figure came from, for messages


def device_properties(device: torch.device) -> AscendDeviceProperties:
    """The device's figures: environment overrides > the driver (NPU only) > 910B defaults."""
    driver = _driver_properties(device.type, device.index) if device.type == "npu" else {}
    sources = []

    def pick(name: str, env: str, fallback: Callable[[], int], fallback_source: str) -> int:
        if os.environ.get(env, "").strip():
            sources.append(f"{name} from {env}")
            return _positive_env_int(env)
        if name in driver:
            sources.append(f"{name} from the driver")
            return driver[name]
        sources.append(f"{name} {fallback_source}")
        return fallback()

    vector_cores = pick("vector_cores", ENV_VECTOR_CORES, lambda: DEFAULT_VECTOR_CORES, "910B default")
    ub_bytes = pick("ub_bytes", ENV_UB_BYTES, lambda: DEFAULT_UB_BYTES, "910B default")
    total = pick("total_memory_bytes", ENV_TOTAL_MEMORY, lambda: total_memory_bytes(device), f"of {device.type}")
    return AscendDeviceProperties(vector_cores, ub_bytes, total, ", ".join(sources))


def _positive_env_int(env: str) -> int:
    text = os.environ[env].strip()
    try:
        value = int(text, 0)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{env}={text!r}: expected a positive integer")
    return value


@cache
def _driver_properties(device_type: str, index: int | None) -> dict[str, int]:
    """Vector cores, UB size and memory of an NPU from triton-ascend and torch_npu."""
    import torch_npu  # noqa: F401  (registers torch.npu)
    from triton.runtime import driver

    index = torch.npu.current_device() if index is None else index
    props = driver.active.utils.get_device_properties(index)
    arch = str(driver.active.get_current_target().arch)
    found = {"total_memory_bytes": int(torch.npu.get_device_properties(index).total_memory)}
    if int(props.get("num_vectorcore", -1)) > 0:
        found["vector_cores"] = int(props["num_vectorcore"])
    ub = ub_bytes_for_arch(arch)
    if ub is not None:
        found["ub_bytes"] = ub
    return found


def ub_bytes_for_arch(arch: str) -> int | None:
    """UB bytes per vector core for a SoC name such as "Ascend910B3"; None when unknown."""
    for prefix, ub_bytes in UB_BYTES_BY_ARCH:
        if arch.startswith(prefix):
            return ub_bytes
    return None


# ----------------------------------------------------------------------------- UB tiling


@dataclass(frozen=True)
class TileFootprint:
    """Tiles of BLOCK_V elements a kernel holds in the UB at once in its inner loop.

    Loaded and stored tiles count twice: triton-ascend double-buffers them by default
    (multiBuffer) so the next block's copy-in overlaps this block's compute.
    """

    io_tiles: int  # loaded or stored in the logits dtype
    fp32_input_tiles: int  # loaded in fp32 (class weights)
    broadcast_tiles: int  # 4-byte tiles made once before the loop: splatted scalars, column indices
    fp32_temporaries: int  # 4-byte values live at the same time inside the loop
    mask_tiles: int  # one byte per element each
    # 4-byte tiles only a softcapped launch holds: softcap._tanh's series (its coefficients and threshold
    # splatted, two temporaries). Counted apart so that the calls without a softcap keep their larger blocks.
    softcap_tiles: int = 0

    def bytes_per_element(self, dtype_bytes: int, softcap: bool = False) -> int:
        buffered = 2 * (self.io_tiles * dtype_bytes + self.fp32_input_tiles * 4)
        extra = self.softcap_tiles if softcap else 0
        return buffered + 4 * (self.broadcast_tiles + self.fp32_temporaries + extra) + self.mask_tiles


# Counted from the IR that triton-ascend 3.2's adapter (triton-adapter-opt) makes of kernels.py, at
# the variant with the most flags on: tools/ascend/compile_check.py reads each variant's inner-loop
# footprint from that IR and fails when it exceeds these counts. The adapter splats every scalar a
# loop uses (lse, target, scale, softcap, constants such as 1.0 and -2.0) and the column indices into
# full tiles before the loop; they stay allocated through it unless BiSheng folds them later.
FOOTPRINTS = {
    # load; x in fp32, x - max, exp; the byte of "mask" covers the 0-d values (running max, sums)
    "plain_loss": TileFootprint(io_tiles=1, fp32_input_tiles=0, broadcast_tiles=0, fp32_temporaries=3, mask_tiles=1),
    # load + store; lse, target, scale, 1.0, column indices; x, p, p - onehot; onehot
    "plain_grad": TileFootprint(io_tiles=2, fp32_input_tiles=0, broadcast_tiles=5, fp32_temporaries=3, mask_tiles=1),
    # load, class weights; softcap, constants, temperature, -inf, column indices, ...; five fp32
    # values of the tanh and the sums; mask, max-equality
    "row_stats": TileFootprint(io_tiles=1, fp32_input_tiles=1, broadcast_tiles=9, fp32_temporaries=5, mask_tiles=2,
                               softcap_tiles=7),
    # load + store, class weights; lse, a, h, d, e, softcap, temperature, target, constants, column
    # indices; five fp32 values of the tanh and the gradient; onehot
    "full_grad": TileFootprint(io_tiles=2, fp32_input_tiles=1, broadcast_tiles=12, fp32_temporaries=5, mask_tiles=1,
                               softcap_tiles=7),
    # load + store; scale; x, x * scale
    "scale": TileFootprint(io_tiles=2, fp32_input_tiles=0, broadcast_tiles=1, fp32_temporaries=2, mask_tiles=0),
    # distill_kernels.py, counted from the same IR (tools/ascend/compile_check.py records their launches too).
    # Two loads; the temperature, -inf, 0 and column indices splatted; t, s, both exponentials, the cross
    # product and the hard term's exponential; mask, and one more byte for the running scalars
    "pair_stats": TileFootprint(io_tiles=2, fp32_input_tiles=0, broadcast_tiles=5, fp32_temporaries=6, mask_tiles=2),
    # two loads; both normalisers (max, log_sum), the temperature, the two log-weights and constants splatted;
    # log p, log q, the mixture's two terms and log m, a product; mask
    "mixture_sums": TileFootprint(io_tiles=2, fp32_input_tiles=0, broadcast_tiles=11, fp32_temporaries=6,
                                  mask_tiles=1),
    # two loads + two stores; every per-row coefficient (both normalisers as max and log_sum), beta and its logs,
    # the target column, constants and column indices splatted; t, s, u - max twice, log p, log q, p, q, the
    # mixture's terms, both gradients; onehot
    "pair_grad": TileFootprint(io_tiles=4, fp32_input_tiles=0, broadcast_tiles=18, fp32_temporaries=13,
                               mask_tiles=1),
}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_size(kernel: str, dtype: torch.dtype, vocab: int, ub_bytes: int, softcap: bool = False) -> int:
    """BLOCK_V for a kernel: the largest power of two whose working set stays within
    UB_SAFETY_FRACTION of the UB, no larger than the row needs and at most MAX_BLOCK_V."""
    per_element = FOOTPRINTS[kernel].bytes_per_element(dtype.itemsize, softcap)
    usable = int(ub_bytes * UB_SAFETY_FRACTION)
    if MIN_BLOCK_V * per_element > usable:
        raise ValueError(
            f"UB of {ub_bytes} bytes (from {ENV_UB_BYTES} or the device) is too small for the {kernel} kernel: "
            f"its smallest block ({MIN_BLOCK_V} elements x {per_element} bytes) needs "
            f"{MIN_BLOCK_V * per_element} bytes, more than {UB_SAFETY_FRACTION:.0%} of the UB; "
            f"expected at least {-(-MIN_BLOCK_V * per_element // UB_SAFETY_FRACTION):.0f} bytes"
        )
    fits = 1 << ((usable // per_element).bit_length() - 1)
    return max(MIN_BLOCK_V, min(fits, next_power_of_2(vocab), MAX_BLOCK_V))


def needs_wide_offsets(logits: torch.Tensor) -> bool:
    """True when some element offset of the chunk does not fit int32."""
    rows, cols = logits.shape
    return rows > 0 and (rows - 1) * logits.stride(0) + cols >= INT32_LIMIT


def grid_for(n_rows: int, props: AscendDeviceProperties) -> tuple[int]:
    """One program per vector core (fewer for small chunks); rows are grid-strided inside."""
    return (max(1, min(n_rows, props.vector_cores)),)


# ----------------------------------------------------------------------------- launchers


def _kernels() -> ModuleType:
    """kernels.py, imported on the first launch (it imports triton and decorates with @jit)."""
    from flce.backends.ascend import kernels

    return kernels


def _row_vector(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """An fp32 per-row vector (or scalar) and its element stride, without copying broadcasts."""
    t = t.float()
    if t.dim() == 0:
        return t.reshape(1), 0
    if t.shape != (n,):
        raise ValueError(f"per-row coefficient has shape {tuple(t.shape)}; expected [{n}] or a scalar")
    return t, t.stride(0)


def _unit_column_stride(logits: torch.Tensor) -> torch.Tensor:
    """The kernels address a row as contiguous memory (torch.mm's output always is)."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


def _shard_class_weight(cfg: LCEConfig, vocab_offset: int, vocab: int) -> torch.Tensor | None:
    if cfg.class_weight is None:
        return None
    return cfg.class_weight[vocab_offset:vocab_offset + vocab].float().contiguous()


class AscendChunkKernels:
    """The chunk kernels of the Ascend backend for one device's properties."""

    def __init__(self, props: AscendDeviceProperties):
        self.props = props

    def _block(self, kernel: str, logits: torch.Tensor, softcap: bool = False) -> int:
        return block_size(kernel, logits.dtype, logits.shape[1], self.props.ub_bytes, softcap)

    def plain_loss(self, logits, target, ignore_index, grad_scale):
        logits = _unit_column_stride(logits)
        n, vocab = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        write_grad = grad_scale is not None
        if n:
            scale, scale_stride = _row_vector(grad_scale, n) if write_grad else (loss, 0)
            block = self._block("plain_grad" if write_grad else "plain_loss", logits)
            _kernels()._plain_loss_kernel[grid_for(n, self.props)](
                logits, logits.stride(0), target, scale, scale_stride, loss, lse, n, vocab, ignore_index,
                WRITE_GRAD=write_grad, WIDE_OFFSETS=needs_wide_offsets(logits), BLOCK_V=block,
            )
        return loss, lse, logits if write_grad else None

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):
        logits = _unit_column_stride(logits)
        n, vocab = logits.shape
        if n:
            scale, scale_stride = _row_vector(grad_scale, n)
            _kernels()._plain_grad_kernel[grid_for(n, self.props)](
                logits, logits.stride(0), target, lse.float(), scale, scale_stride, n, vocab, ignore_index,
                WIDE_OFFSETS=needs_wide_offsets(logits), BLOCK_V=self._block("plain_grad", logits),
            )
        return logits

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int, into=None) -> PartialRowStats:
        stats = self._block_row_stats(logits, target, cfg, vocab_offset)
        return stats if into is None else merge_partial_stats(into, stats)

    def _block_row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int) -> PartialRowStats:
        logits = _unit_column_stride(logits)
        n, vocab = logits.shape
        stats = PartialRowStats.allocate(n, cfg, logits.device)
        if n == 0:
            return stats
        weight = _shard_class_weight(cfg, vocab_offset, vocab) if stats.weighted_sum_z is not None else None
        unused = stats.row_max  # any tensor: the kernel never reads a pointer whose flag is off
        _kernels()._row_stats_kernel[grid_for(n, self.props)](
            logits, logits.stride(0), target, weight if weight is not None else unused,
            stats.row_max, stats.sum_exp, stats.target_z,
            stats.sum_exp_dz if stats.sum_exp_dz is not None else unused,
            stats.weighted_sum_z if stats.weighted_sum_z is not None else unused,
            stats.argmax if stats.argmax is not None else unused,
            n, vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_TEMPERATURE=cfg.temperature != 1.0,
            HAS_CLASS_WEIGHT=weight is not None, NEED_SUM_EXP_DZ=stats.sum_exp_dz is not None,
            NEED_WEIGHTED_SUM_Z=stats.weighted_sum_z is not None, NEED_ARGMAX=stats.argmax is not None,
            WIDE_OFFSETS=needs_wide_offsets(logits), BLOCK_V=self._block("row_stats", logits, cfg.softcap is not None),
        )
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):
        logits = _unit_column_stride(logits)
        n, vocab = logits.shape
        if n == 0:
            return logits
        a, a_stride = _row_vector(coeffs.a, n)
        d, d_stride = _row_vector(coeffs.d, n)
        h, h_stride = _row_vector(coeffs.h, n) if coeffs.h is not None else (a, 0)
        e, e_stride = _row_vector(coeffs.e, n) if coeffs.e is not None else (a, 0)
        weight = _shard_class_weight(cfg, vocab_offset, vocab) if coeffs.e is not None else None
        _kernels()._full_grad_kernel[grid_for(n, self.props)](
            logits, logits.stride(0), target, weight if weight is not None else a, lse.float(),
            a, a_stride, h, h_stride, d, d_stride, e, e_stride,
            n, vocab, vocab_offset, float(cfg.softcap or 1.0), 1.0 / cfg.temperature,
            HAS_SOFTCAP=cfg.softcap is not None, HAS_TEMPERATURE=cfg.temperature != 1.0,
            HAS_CLASS_WEIGHT=weight is not None, HAS_H=coeffs.h is not None, HAS_E=coeffs.e is not None,
            WIDE_OFFSETS=needs_wide_offsets(logits), BLOCK_V=self._block("full_grad", logits, cfg.softcap is not None),
        )
        return logits

    def scale_(self, tensor, scale):
        if tensor.numel() == 0:
            return tensor
        if not tensor.is_contiguous():
            # Gradients of non-contiguous inputs keep their layout; the kernel walks flat memory.
            # The fp32 scale is not rounded to the gradient's dtype first (1.3 is 1.296875 in bf16).
            return tensor.mul_(scale.float())
        n = tensor.numel()
        block = block_size("scale", tensor.dtype, n, self.props.ub_bytes)
        _kernels()._scale_kernel[grid_for(-(-n // block), self.props)](
            tensor, scale.float().reshape(()), n, WIDE_OFFSETS=n >= INT32_LIMIT, BLOCK=block,
        )
        return tensor

    def matmul_(self, a, b, out, accumulate) -> None:
        torch_matmul_(a, b, out, accumulate)

    def count_tokens(self, target, ignore_index, dtype, vocab):
        return torch_count_tokens(target, ignore_index, dtype, vocab)

    def add_column_sums_(self, acc, a) -> None:
        acc += a.sum(0, dtype=acc.dtype)

    def accumulate_fp32_(self, acc, a, b) -> None:
        # Each block's GEMM runs in the operands' dtype on the cube units (fp32 sums inside) and is
        # added into the fp32 accumulator: the temporary stays at FP32_ACCUMULATE_ROWS x H.
        for start in range(0, acc.shape[0], FP32_ACCUMULATE_ROWS):
            rows = slice(start, start + FP32_ACCUMULATE_ROWS)
            acc[rows] += (a[rows] @ b).float()
