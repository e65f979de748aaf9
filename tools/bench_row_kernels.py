"""Micro-benchmark of the CUDA plain row kernel (loss + gradient in place) under launch configs.

    python tools/bench_row_kernels.py            # prints ms and effective bandwidth per config

Effective bandwidth counts the 6 bytes per bf16 element the kernel must move at least once through
HBM when the gradient pass misses L2 (read, read, write); below 6 means the second read hit L2.
"""

from __future__ import annotations

import torch
import triton.testing

from flce.backends.cuda.ops import LaunchParams, TritonChunkKernels

SHAPES = ((2048, 128256), (1664, 151936), (4096, 32000))
CONFIGS = (
    LaunchParams(4096, 8, 0), LaunchParams(4096, 8, 1), LaunchParams(8192, 16, 1), LaunchParams(4096, 16, 1),
    LaunchParams(4096, 8, 2), LaunchParams(4096, 4, 4), LaunchParams(2048, 4, 4), LaunchParams(8192, 8, 2),
)


def main() -> None:
    print(f"{'rows x V':>14} {'block':>6} {'warps':>5} {'per SM':>6} {'ms':>7} {'GB/s at 6 B/elem':>17}")
    for rows, vocab in SHAPES:
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        scale = torch.full((rows,), 1.0 / rows, device="cuda")
        for launch in CONFIGS:
            kernels = TritonChunkKernels(launch)
            ms = triton.testing.do_bench(lambda k=kernels, u=logits, t=target, s=scale: k.plain_loss(u, t, -100, s),
                                         warmup=50, rep=200, return_mode="median")
            gbs = rows * vocab * 6 / ms / 1e6
            print(f"{rows:>6}x{vocab:<7} {launch.block_v:>6} {launch.num_warps:>5} {launch.programs_per_sm:>6} "
                  f"{ms:>7.3f} {gbs:>17.0f}")


if __name__ == "__main__":
    main()
