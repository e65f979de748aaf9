"""cuBLAS against flce's warp-specialised Gluon GEMM (flce/backends/cuda/ws_gemm_ops.py) on the three
products of the LM-head loss, plus a large square GEMM for the sustained bf16 peak.

    python tools/benchmarks/ws_gemm.py [--shapes 8192x4096x128256,16384x2048x151936] [--configs 3:8:256]

Each product is first checked against torch.mm (relative Frobenius error < 1e-2; outputs poisoned
with NaN before each run), then timed with the median of triton.testing.do_bench. Inputs: bf16,
normal(0, 1) hidden and weight rows, gradient entries normal(0, 1e-3) (any scale times the same).
The markdown table goes to stdout and, when $OUT is set, to $OUT/ws_gemm.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flce.backends.cuda.ws_gemm_ops import DEFAULT_CONFIG, WsGemmConfig, padded_empty, ws_matmul  # noqa: E402


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm() / ref.float().norm()
    return float("nan") if not torch.isfinite(out).all() else float(diff)


def products(tokens: int, hidden: int, vocab: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of the three products, as views of one draw of x [N, H], W [V, H], G [N, V]."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    g = padded_empty(tokens, vocab, torch.bfloat16, x.device).normal_(0, 1e-3)
    return {"logits x@W.T": (x, w.T), "grad_hidden G@W": (g, w), "grad_weight G.T@x": (g.T, x)}


def check(a: torch.Tensor, b: torch.Tensor, config: WsGemmConfig) -> float:
    out = padded_empty(a.shape[0], b.shape[1], a.dtype, a.device).fill_(float("nan"))
    ws_matmul(a, b, out, config)
    return rel_error(out, torch.mm(a, b))


def time_ms(fn) -> float:  # noqa: ANN001
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def parse_config(text: str) -> WsGemmConfig:
    """stages:group_m:block_n[:block_k]"""
    parts = [int(p) for p in text.split(":")]
    names = ["stages", "group_m", "block_n", "block_k"]
    return dataclasses.replace(DEFAULT_CONFIG, **dict(zip(names[:len(parts)], parts, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x4096x128256,16384x2048x151936")
    parser.add_argument("--configs", default="3:8:256", help="comma-separated stages:group_m:block_n[:block_k]")
    parser.add_argument("--square", type=int, default=8192)
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    name = torch.cuda.get_device_name()
    lines = [f"GPU: {name}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"command: python tools/benchmarks/ws_gemm.py --shapes {args.shapes} --configs {args.configs}", "",
             "| shape N x H x V | product | M x N x K | cuBLAS ms | cuBLAS TFLOP/s | " +
             " | ".join(f"ws {c.stages}:{c.group_m}:{c.block_n}:{c.block_k} ms (TFLOP/s, err)" for c in configs) +
             " | best ws / cuBLAS |",
             "|---|---|---|---|---|" + "---|" * len(configs) + "---|"]

    def row(label: str, prod: str, a: torch.Tensor, b: torch.Tensor) -> None:
        m, k = a.shape
        n = b.shape[1]
        flop = 2.0 * m * n * k
        out = padded_empty(m, n, a.dtype, a.device)
        t_ref = time_ms(lambda: torch.mm(a, b, out=out))
        cells, best = [], None
        for c in configs:
            err = check(a, b, c)
            t = time_ms(lambda c=c: ws_matmul(a, b, out, c))
            ok = err < 1e-2
            cells.append(f"{t:.3f} ({flop / t / 1e9:.0f}, {err:.1e}{'' if ok else ' FAIL'})")
            if ok and (best is None or t < best):
                best = t
        ratio = f"{t_ref / best:.3f}x faster" if best is not None else "-"
        lines.append(f"| {label} | {prod} | {m}x{n}x{k} | {t_ref:.3f} | {flop / t_ref / 1e9:.0f} | "
                     + " | ".join(cells) + f" | {ratio} |")
        print(lines[-1], flush=True)

    if args.square:
        s = args.square
        a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        row(f"square {s}^3", "a@b.T", a, b.T)
        row(f"square {s}^3", "a@b", a, b)
        del a, b
    for shape in args.shapes.split(","):
        tokens, hidden, vocab = (int(v) for v in shape.split("x"))
        for prod, (a, b) in products(tokens, hidden, vocab).items():
            row(shape, prod, a, b)
        torch.cuda.empty_cache()
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ws_gemm.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
