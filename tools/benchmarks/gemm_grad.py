"""The gradient GEMM against what it replaces, one GPU, bf16, one process.

For each vocabulary block of the lean schedules (the blocks the planner makes at a 64 MiB budget,
and the RL case's at 512 MiB): cuBLAS ``x @ W_block.T`` followed by the full-gradient row kernel,
against ``_gemm_grad_kernel`` (logits tile in registers, d loss / d u written once) for several
tile configurations, with each compiled kernel's registers and spills. Plain coefficients (a, d)
and RL ones (a, h, d at temperature 0.7). Medians of triton.testing.do_bench. Each block's gradients
are checked against the reference path's first (bf16 rounding apart).

    python tools/benchmarks/gemm_grad.py --markdown out.md
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton

from flce.backends.cuda import BACKEND, gemm_kernels
from flce.backends.cuda.gemm_ops import GemmConfig, gemm_grad
from flce.config import LCEConfig
from flce.engine.plans import PlanRequest
from flce.gradients import GradCoefficients
from flce.inputs import prepare_inputs
from flce.testing.measure import median_ms, parse_shape, publish, shape_inputs

BLOCKS = (  # tokens x hidden x block columns
    "8192x4096x3968",  # 64 MiB at 8192x4096x128256
    "16384x2048x1920",  # 64 MiB at 16384x2048x151936
    "16384x4096x15872",  # RL, 512 MiB at 16384x4096x151936
)
CONFIGS = (  # the 2-D grid (persistent=False) and the persistent kernel with TMA stores
    GemmConfig(128, 256, 64, 8, 8, 3, persistent=False),
    GemmConfig(256, 128, 64, 8, 8, 3, persistent=False),
    GemmConfig(128, 256, 64, 8, 8, 3),
    GemmConfig(128, 256, 64, 8, 8, 4),
    GemmConfig(256, 128, 64, 8, 8, 3),
    GemmConfig(128, 128, 64, 8, 8, 4),
    GemmConfig(128, 128, 64, 8, 4, 4),
)


def _compiled_kernels() -> dict[int, object]:
    """The gradient kernel's compiled variants so far, by identity."""
    kernels = (gemm_kernels._gemm_grad_kernel, gemm_kernels._gemm_grad_persistent_kernel)
    return {id(k): k for kernel in kernels for cache in kernel.device_caches.values() for k in cache[0].values()}


def _registers(kernels: list) -> str:
    """Registers per thread and spilled bytes of the variants compiled for one configuration."""
    return ", ".join(f"{getattr(k, 'n_regs', '?')} regs / {getattr(k, 'n_spills', '?')} spills" for k in kernels)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = ["| block | coefficients | cuBLAS + row kernel | " + " | ".join(
        f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}{' persistent' * c.persistent}"
        for c in CONFIGS) + " |",
        "|---|---|---|" + "---|" * len(CONFIGS)]
    for label in BLOCKS:
        x, w, t, g = shape_inputs(*parse_shape(label), dev, requires_grad=False)
        n = x.shape[0]
        lse = torch.full((n,), 12.0, device=dev)
        rand = torch.randn(n, device=dev, generator=g)
        for kind, cfg, coeffs in (
            ("plain", LCEConfig(), GradCoefficients(a=rand, h=None, d=rand, e=None)),
            ("RL", LCEConfig(reduction="none", temperature=0.7, return_logprobs=True, return_entropy=True),
             GradCoefficients(a=rand, h=rand.abs(), d=rand, e=None)),
        ):
            # The row kernels as the library's call of this shape launches them (its kernel choice).
            kernels = BACKEND.plan_call(prepare_inputs(x, w, t, None, cfg), cfg, "full",
                                        PlanRequest(training=True)).kernels

            def reference(cfg=cfg, coeffs=coeffs, kernels=kernels, x=x, w=w, t=t, lse=lse) -> None:
                kernels.full_grad_(torch.mm(x, w.t()), t, cfg, 0, lse, coeffs)

            cells = [f"{median_ms(reference):.3f} ms"]
            want = kernels.full_grad_(torch.mm(x, w.t()), t, cfg, 0, lse, coeffs).float()
            for config in CONFIGS:
                def fused(cfg=cfg, coeffs=coeffs, config=config, x=x, w=w, t=t, lse=lse):
                    return gemm_grad(x, w, None, t, cfg, 0, lse, coeffs, config)

                try:
                    before = _compiled_kernels()
                    error = float((fused().float() - want).abs().max() / want.abs().max())
                    new = [k for key, k in _compiled_kernels().items() if key not in before]
                    ms = median_ms(fused)
                    wrong = f", WRONG: max error {error:.1e} of the largest" if error > 2e-2 else ""
                    cells.append(f"{ms:.3f} ms ({_registers(new)}{wrong})")
                except (triton.CompilationError, triton.OutOfResources) as error:
                    cells.append(f"failed: {type(error).__name__}")
            rows.append(f"| {label} | {kind} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    text = "\n".join([f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
                      f"{datetime.date.today()}, `python tools/benchmarks/gemm_grad.py`", "", *rows])
    publish(text, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
