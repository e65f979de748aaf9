"""One launch each of cuBLAS and flce's ws GEMM (and its row-statistics forward) on one LM-head
product, after a warm-up, for Nsight Compute:

    ncu --clock-control none --launch-skip 0 -k regex:'nvjet|gemm|_ws_gemm' --section SpeedOfLight \\
        --section WarpStateStats python tools/benchmarks/ws_gemm_profile.py 16384x2048x151936 logits
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flce.backends.cuda.ws_gemm_ops import padded_empty, ws_matmul, ws_row_stats


def main() -> None:
    tokens, hidden, vocab = (int(v) for v in sys.argv[1].split("x"))
    product = sys.argv[2]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    g = padded_empty(tokens, vocab, torch.bfloat16, x.device).normal_()
    a, b = {"logits": (x, w.T), "grad_hidden": (g, w), "grad_weight": (g.T, x)}[product]
    out = padded_empty(a.shape[0], b.shape[1], a.dtype, a.device)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    for _ in range(2):  # the first pass compiles
        torch.mm(a, b, out=out)
        ws_matmul(a, b, out)
        if product == "logits":
            ws_row_stats(x, w, target)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
