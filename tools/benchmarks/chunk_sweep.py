"""What memory buys: the default training call at several token-chunk sizes, one GPU, bf16.

For each shape, fwd+bwd of ``flce.linear_cross_entropy`` with ``tokens_per_chunk`` forced to each size
(the autotune override, so neither the shipped cache nor the 512 MiB default budget caps it), and with each
``memory_budget`` of --budgets (the planner's own choice within that budget), beside
the cuBLAS 3-GEMM floor, all interleaved round by round in one process: median (range) of the ratio
to the same round's floor, and MiB above the gradients. Larger chunks mean fewer read-modify-writes
of the V x H weight gradient and larger GEMMs, at chunk x V x 2 bytes of kept logits or exponentials.

    python tools/benchmarks/chunk_sweep.py --shapes 8192x4096x128256,16384x2048x151936 --chunks 2048,4096,8192 \
        --budgets 1024,2048
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import flce
from flce.autotune import override_params
from flce.testing.measure import (
    floor_gradient,
    floor_products,
    gpu_timing,
    median_range,
    parse_shape,
    peak_mib_above,
    save_gpu_results,
    shape_inputs,
)


def sweep(label: str, chunks: list[int], budgets_mib: list[int], rounds: int) -> dict:
    tokens, hidden, vocab = parse_shape(label)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab)
    floor = floor_products(x, w, floor_gradient(tokens, vocab, x.dtype, x.device))

    def step(chunk: int | None):
        knobs = None if chunk is None else {"tokens_per_chunk": chunk}
        with override_params(knobs, backend="cuda") if knobs else contextlib.nullcontext():
            loss = flce.linear_cross_entropy(x, w, t)
            return torch.autograd.grad(loss, (x, w))

    def budget_step(mib: int):
        loss = flce.linear_cross_entropy(x, w, t, memory_budget=mib << 20)
        return torch.autograd.grad(loss, (x, w))

    calls = {"floor": floor, "default": lambda: step(None)}
    calls.update({f"chunk {c}": (lambda c=c: step(c)) for c in chunks if c <= tokens})
    calls.update({f"budget {b} MiB": (lambda b=b: budget_step(b)) for b in budgets_mib})
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name].append(gpu_timing(fn, warmup_ms=25, rep_ms=200).median_ms)
    memory = {name: peak_mib_above(fn) for name, fn in calls.items() if name != "floor"}
    ratios = {name: [ms / f for ms, f in zip(values, samples["floor"], strict=True)]
              for name, values in samples.items() if name != "floor"}
    return {"shape": label, "floor_ms": samples["floor"], "ms": samples, "ratio": ratios, "mib_above_grads": memory}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x4096x128256,16384x2048x151936,4096x4096x32000")
    parser.add_argument("--chunks", default="1024,2048,4096,8192,16384")
    parser.add_argument("--budgets", default="", help="memory_budget values in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    results = []
    for label in args.shapes.split(","):
        chunks = [int(c) for c in args.chunks.split(",") if c]
        budgets = [int(b) for b in args.budgets.split(",") if b]
        result = sweep(label, chunks, budgets, args.rounds)
        results.append(result)
        print(f"\n## {label}: floor {statistics.median(result['floor_ms']):.2f} ms")
        print("| chunk | x floor, median (range) | MiB above grads |\n|---|---|---|")
        for name, ratios in result["ratio"].items():
            print(f"| {name} | {median_range(ratios)} | {result['mib_above_grads'][name]:.0f} |")
    save_gpu_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
