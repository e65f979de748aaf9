"""Where the default training call's time goes, kernel by kernel (torch.profiler), one GPU, bf16.

For each shape and each forward_logits choice (cuBLAS + row kernel, or the fused statistics GEMM
that keeps the logits): the call's CUDA kernels grouped by name, milliseconds per call, beside the
three cuBLAS GEMMs of the floor timed in the same process.

    python tools/profiling/training_breakdown.py [--shapes 16384x2048x151936] [--knob grad_gemm_kernel=cublas]
    python tools/profiling/training_breakdown.py --forward fused --budgets 0,2048   # default and 2 GiB budgets
"""

from __future__ import annotations

import argparse

import torch

import flce
from flce.autotune import override_params
from flce.testing.measure import (
    budget_label,
    budget_options,
    cublas_products_ms,
    kernel_times,
    median_ms,
    parse_shape,
    shape_inputs,
)


def profile_shape(label: str, extra: dict, forwards: list[str], budgets: list[int]) -> None:
    tokens, hidden, vocab = parse_shape(label)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab)
    floor = cublas_products_ms(x, w)
    print(f"\n## {label}: cuBLAS x@W.T {floor[0]:.2f} ms, G@W {floor[1]:.2f}, G.T@x {floor[2]:.2f}, "
          f"floor {sum(floor):.2f}")
    for forward, budget in ((f, b) for f in forwards for b in budgets):
        knobs = {"forward_logits": forward, **extra}
        options = budget_options(budget)

        def step(knobs=knobs, options=options):
            with override_params(knobs, backend="cuda"):
                loss = flce.linear_cross_entropy(x, w, t, **options)
                return torch.autograd.grad(loss, (x, w))

        total = median_ms(step)
        rows = kernel_times(step)
        print(f"\n### knobs {knobs}, budget {budget_label(budget)}: {total:.2f} ms = "
              f"{total / sum(floor):.3f}x floor; "
              f"kernels {sum(r[1] for r in rows):.2f} ms")
        print("| kernel | ms per call | launches |\n|---|---|---|")
        for name, ms, count in rows[:16]:
            print(f"| `{name}` | {ms:.3f} | {count} |")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x4096x128256,16384x2048x151936")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--forward", default="cublas,fused", help="forward_logits choices, comma-separated")
    parser.add_argument("--budgets", default="0", help="memory_budget in MiB, comma-separated (0: the default)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.knob)
    print(torch.cuda.get_device_name(), torch.__version__)
    for label in args.shapes.split(","):
        profile_shape(label, extra, args.forward.split(","), [int(b) for b in args.budgets.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
