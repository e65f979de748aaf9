"""What the gaps between a training call's kernels cost: the default training call eager against the same
call replayed from a CUDA graph (one launch, no gaps for the host to fill), per ``memory_budget``, beside
the cuBLAS 3-GEMM floor, one GPU, bf16.

Per shape: the floor's three cuBLAS products once, then per budget three alternating pairs of medians
(eager, graph replay; ``triton.testing.do_bench``, L2 emptied before each call); the table gives the middle
of the three of each and its ratio to the floor. Where eager and replay differ, the difference is the time
the GPU waited between launches; where they agree, what is left above the floor is in the kernels.

    python tools/profiling/launch_gaps.py [--shapes 16384x2048x151936,8192x4096x128256] [--budgets 0,1024,2048]
                                          [--markdown out.md]
"""

from __future__ import annotations

import argparse

import torch

import flce
from flce.testing.measure import (
    budget_label,
    budget_options,
    cublas_products_ms,
    median_ms,
    parse_shape,
    publish,
    shape_inputs,
)

PAIRS = 3


def eager_and_replay_ms(step) -> tuple[float, float]:
    """The middle of PAIRS medians of ``step()`` eager and of its CUDA-graph replay, alternating."""
    for _ in range(3):
        step()
    # Captured after warm-up on a side stream, as torch.cuda.graphs asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    eager, replay = [], []
    for _ in range(PAIRS):
        eager.append(median_ms(step))
        replay.append(median_ms(graph.replay))
    return sorted(eager)[PAIRS // 2], sorted(replay)[PAIRS // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x2048x151936,8192x4096x128256")
    parser.add_argument("--budgets", default="0,1024,2048", help="memory_budget in MiB; 0: the default")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flce {flce.__version__}", "",
             "| shape | memory_budget | floor ms | eager ms (x floor) | CUDA-graph replay ms (x floor) |",
             "|---|---|---|---|---|"]
    for label in args.shapes.split(","):
        x, w, t, _ = shape_inputs(*parse_shape(label))
        floor = sum(cublas_products_ms(x, w))
        for budget in (int(b) for b in args.budgets.split(",")):
            opts = budget_options(budget)

            def step(opts=opts, x=x, w=w, t=t):
                return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, **opts), (x, w))

            eager, replay = eager_and_replay_ms(step)
            lines.append(f"| {label} | {budget_label(budget)} | {floor:.2f} | "
                         f"{eager:.2f} ({eager / floor:.3f}x) | {replay:.2f} ({replay / floor:.3f}x) |")
            print(lines[-1], flush=True)
    publish("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
