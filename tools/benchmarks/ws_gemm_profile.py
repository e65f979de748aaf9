"""One launch of each kernel of an LM-head product between profiler marks, for Nsight Compute: cuBLAS and
flce's plain ws GEMM for a product, or the ws statistics GEMM keeping nothing / logits / exponentials.

    ncu --profile-from-start off --clock-control none -k regex:'nvjet|gemm|_ws_gemm' --section SpeedOfLight \\
        --section WarpStateStats python tools/benchmarks/ws_gemm_profile.py 16384x2048x151936 logits
    ncu --profile-from-start off -k regex:_ws_gemm ... python tools/benchmarks/ws_gemm_profile.py 1536x2048x151936 kept

Products: logits (x @ W.T), grad_hidden (G @ W), grad_weight (G.T @ x): cuBLAS then the ws GEMM; ``kept``: the
statistics GEMM of a training chunk three times, keeping nothing, then the logits, then the exponentials.
Each kernel runs once before the marks (the first launch compiles), so only the measured launches are profiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flce.backends.cuda.exp_grad_ops import exp_offsets
from flce.backends.cuda.ws_gemm_ops import padded_empty, ws_matmul, ws_partial_row_stats
from flce.config import LCEConfig
from flce.testing.measure import IGNORE_INDEX, parse_shape, shape_inputs

PRODUCTS = ("logits", "grad_hidden", "grad_weight", "kept")


def launches(tokens: int, hidden: int, vocab: int, product: str) -> list:
    x, w, target, _ = shape_inputs(tokens, hidden, vocab, requires_grad=False)
    if product == "kept":
        out = padded_empty(tokens, vocab, x.dtype, x.device)
        offsets = exp_offsets(x, w, target, IGNORE_INDEX)
        cfg = LCEConfig()
        return [lambda: ws_partial_row_stats(x, w, target, 0, cfg),
                lambda: ws_partial_row_stats(x, w, target, 0, cfg, logits_out=out),
                lambda: ws_partial_row_stats(x, w, target, 0, cfg, logits_out=out, exp_offset=offsets)]
    g = padded_empty(tokens, vocab, x.dtype, x.device).normal_()
    a, b = {"logits": (x, w.T), "grad_hidden": (g, w), "grad_weight": (g.T, x)}[product]
    out = padded_empty(a.shape[0], b.shape[1], a.dtype, a.device)
    return [lambda: torch.mm(a, b, out=out), lambda: ws_matmul(a, b, out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="TOKENSxHIDDENxVOCAB, e.g. 16384x2048x151936 (kept: a chunk's rows)")
    parser.add_argument("product", choices=PRODUCTS)
    args = parser.parse_args()
    calls = launches(*parse_shape(args.shape), args.product)
    for call in calls:  # compiles; not profiled
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
