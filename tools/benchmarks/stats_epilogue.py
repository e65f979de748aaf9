"""What the statistics GEMM's epilogue costs at a training chunk's shape: cuBLAS's x @ W.T into a preallocated
output beside the warp-specialised statistics GEMM keeping nothing, the logits, or the exponentials (the
default training call's forward), each ws variant in every --configs tiling (ring stages : block_k),
interleaved round by round in one process: median ms (range) and the ratio to the same round's cuBLAS GEMM.

    python tools/benchmarks/stats_epilogue.py --shapes 1536x2048x151936,2048x4096x128256 --configs 3:64,5:32

(1536 and 2048 rows: the default call's chunks at 16384x2048x151936 and 8192x4096x128256 on the H100.)
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from flce.backends.cuda.exp_grad_ops import exp_offsets
from flce.backends.cuda.ws_gemm_ops import ROW_STATS_CONFIG, padded_empty, ws_partial_row_stats
from flce.config import LCEConfig
from flce.testing.measure import (
    IGNORE_INDEX,
    gpu_timing,
    median_range,
    parse_shape,
    save_gpu_results,
    shape_inputs,
)


def calls(label: str, configs: list[str]) -> dict:
    tokens, hidden, vocab = parse_shape(label)
    x, w, target, _ = shape_inputs(tokens, hidden, vocab, requires_grad=False)
    out = padded_empty(tokens, vocab, x.dtype, x.device)
    offsets = exp_offsets(x, w, target, IGNORE_INDEX)
    cfg = LCEConfig()
    found = {"cuBLAS x @ W.T": lambda: torch.mm(x, w.T, out=out)}
    for text in configs:
        stages, block_k = (int(v) for v in text.split(":"))
        config = dataclasses.replace(ROW_STATS_CONFIG, stages=stages, block_k=block_k)
        found[f"stats only, {text}"] = lambda c=config: ws_partial_row_stats(x, w, target, 0, cfg, config=c)
        found[f"keep logits, {text}"] = lambda c=config: ws_partial_row_stats(
            x, w, target, 0, cfg, logits_out=out, config=c)
        found[f"keep exponentials, {text}"] = lambda c=config: ws_partial_row_stats(
            x, w, target, 0, cfg, logits_out=out, exp_offset=offsets, config=c)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1536x2048x151936,2048x4096x128256")
    parser.add_argument("--configs", default="3:64", help="comma-separated stages:block_k")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    results = []
    for label in args.shapes.split(","):
        fns = calls(label, args.configs.split(","))
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():  # compile outside the rounds
            fn()
        for _ in range(args.rounds):
            for name, fn in fns.items():
                samples[name].append(gpu_timing(fn, warmup_ms=25, rep_ms=150).median_ms)
        base = samples["cuBLAS x @ W.T"]
        print(f"\n## {label}\n| GEMM | ms, median (range) | x cuBLAS, median (range) |\n|---|---|---|")
        for name, ms in samples.items():
            ratios = [a / b for a, b in zip(ms, base, strict=True)]
            print(f"| {name} | {median_range(ms)} | {median_range(ratios)} |")
        results.append({"shape": label, "ms": samples})
    save_gpu_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
