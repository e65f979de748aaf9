"""cuBLAS against flce's warp-specialised Gluon GEMM (flce/backends/cuda/ws_gemm_ops.py) on the three
products of the LM-head loss, plus a large square GEMM for the sustained bf16 peak.

    python tools/benchmarks/ws_gemm.py [--shapes 8192x4096x128256,16384x2048x151936] [--configs 3:8:256]
    python tools/benchmarks/ws_gemm.py --shapes 2048x4096x128256 --accumulate    # one token chunk's products

Each product is first checked against torch.mm (relative Frobenius error < 1e-2; outputs poisoned
with NaN before each run), then timed with the median of triton.testing.do_bench (the smaller of
two medians, the variants timed in turn: time_alternating). Inputs: bf16, normal(0, 1) hidden and
weight rows, gradient entries normal(0, 1e-3) (any scale times the same).
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

from ws_kernels import ws_row_stats

from flce.backends.cuda.ws_gemm_ops import (
    DEFAULT_CONFIG,
    ROW_STATS_CONFIG,
    WsGemmConfig,
    padded_empty,
    ws_matmul,
)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm() / ref.float().norm()
    return float("nan") if not torch.isfinite(out).all() else float(diff)


def products(tokens: int, hidden: int, vocab: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of the three products, as views of one draw of x [N, H], W [V, H], G [N, V]."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    g = padded_empty(tokens, vocab, torch.bfloat16, x.device).normal_(0, 1e-3)
    return {"logits x@W.T": (x, w.T), "grad_hidden G@W": (g, w), "grad_weight G.T@x": (g.T, x)}


def check(a: torch.Tensor, b: torch.Tensor, config: WsGemmConfig, accumulate: bool = False) -> float:
    """ws_matmul's relative error against cuBLAS; accumulating, onto a random C (else into a NaN-poisoned one)."""
    if accumulate:
        c = padded_empty(a.shape[0], b.shape[1], a.dtype, a.device).normal_(0, 1e-2)
        ref = torch.addmm(c, a, b)
        return rel_error(ws_matmul(a, b, c, config, accumulate=True), ref)
    out = padded_empty(a.shape[0], b.shape[1], a.dtype, a.device).fill_(float("nan"))
    ws_matmul(a, b, out, config)
    return rel_error(out, torch.mm(a, b))


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def time_alternating(fns: list, passes: int = 2) -> list[float]:
    """The smaller of ``passes`` medians for each function, timed in turn (A B C A B C): the GPU's
    clock drifts over a run (5% between runs on one H200), and alternating keeps that out of the
    ratios."""
    best = [float("inf")] * len(fns)
    for _ in range(passes):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], time_ms(fn))
    return best


def parse_config(text: str) -> WsGemmConfig:
    """stages:group_m:block_n[:block_k]"""
    parts = [int(p) for p in text.split(":")]
    names = ["stages", "group_m", "block_n", "block_k"]
    return dataclasses.replace(DEFAULT_CONFIG, **dict(zip(names[:len(parts)], parts, strict=True)))


def loss_inputs(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, W with logits of std ~0.5, uniform targets with every 13th ignored (-100)."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * (0.5 / hidden ** 0.5)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[::13] = -100
    return x, w, target


def loss_from_stats(row_max: torch.Tensor, sum_exp: torch.Tensor, target_z: torch.Tensor,
                    target: torch.Tensor) -> torch.Tensor:
    valid = target != -100
    return ((row_max + sum_exp.log() - target_z) * valid).sum() / valid.sum()


def loss_float64(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, rows: int = 2048) -> float:
    """Mean plain cross-entropy of x @ W.T in float64, a block of rows at a time."""
    total, w64 = 0.0, w.double()
    valid = target != -100
    for start in range(0, x.shape[0], rows):
        z = x[start:start + rows].double() @ w64.T
        t = target[start:start + rows]
        lse = torch.logsumexp(z, dim=1)
        picked = z.gather(1, t.clamp(min=0)[:, None])[:, 0]
        total += float(((lse - picked) * valid[start:start + rows]).sum())
    return total / int(valid.sum())


def forward_loss_rows(shapes: str, config: WsGemmConfig) -> list[str]:
    """Forward-only plain loss: flce's ws row-statistics epilogue against cuBLAS x @ W.T alone and
    against gemm_ops.gemm_row_stats (today's fused forward)."""
    from flce.backends.cuda.configs import default_gemm_config
    from flce.backends.cuda.gemm_ops import gemm_row_stats
    from flce.backends.cuda.hardware import describe_device
    from flce.config import LCEConfig

    lines = ["", f"Forward only, plain loss (ws row statistics, stages {config.stages}, group_m {config.group_m}):",
             "", "| shape N x H x V | cuBLAS x@W.T ms | ws row stats ms (/ cuBLAS) | gemm_row_stats ms (/ cuBLAS) | "
             "ws loss rel. err vs float64 | gemm_row_stats rel. err |", "|---|---|---|---|---|---|"]
    cfg = LCEConfig()
    for shape in shapes.split(","):
        tokens, hidden, vocab = (int(v) for v in shape.split("x"))
        x, w, target = loss_inputs(tokens, hidden, vocab)
        ref = loss_float64(x, w, target)
        row_max, sum_exp, target_z = ws_row_stats(x, w, target, config)
        ws_err = abs(float(loss_from_stats(row_max, sum_exp, target_z, target)) - ref) / abs(ref)
        gconf = default_gemm_config(describe_device(x.device), x.dtype)
        stats = gemm_row_stats(x, w, None, target, cfg, 0, gconf)
        old_err = abs(float(loss_from_stats(stats.row_max, stats.sum_exp, stats.target_z, target)) - ref) / abs(ref)
        out = padded_empty(tokens, vocab, x.dtype, x.device)
        t_ref, t_ws, t_old = time_alternating([
            lambda x=x, w=w, out=out: torch.mm(x, w.T, out=out),
            lambda x=x, w=w, t=target: ws_row_stats(x, w, t, config),
            lambda x=x, w=w, t=target, g=gconf: gemm_row_stats(x, w, None, t, cfg, 0, g)])
        lines.append(f"| {shape} | {t_ref:.3f} | {t_ws:.3f} ({t_ws / t_ref:.3f}x) | {t_old:.3f} "
                     f"({t_old / t_ref:.3f}x) | {ws_err:.1e} | {old_err:.1e} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x4096x128256,16384x2048x151936")
    parser.add_argument("--configs", default="3:16:256", help="comma-separated stages:group_m:block_n[:block_k]")
    parser.add_argument("--square", type=int, default=8192)
    parser.add_argument("--loss-shapes", default="8192x4096x128256,16384x2048x151936,16384x4096x151936",
                        help="forward-only plain-loss shapes ('' to skip)")
    parser.add_argument("--stats-config", default="3:16:256", help="stages:group_m:block_n of the row statistics")
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--accumulate", action="store_true",
                        help="also time the weight gradient accumulated onto C (cuBLAS addmm_ against the ws GEMM's "
                             "ACCUMULATE), as a token chunk of N rows does")
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    name = torch.cuda.get_device_name()
    lines = [f"GPU: {name}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"command: python tools/benchmarks/ws_gemm.py {' '.join(sys.argv[1:])}", "",
             "| shape N x H x V | product | M x N x K | cuBLAS ms | cuBLAS TFLOP/s | " +
             " | ".join(f"ws {c.stages}:{c.group_m}:{c.block_n}:{c.block_k} ms (TFLOP/s, err)" for c in configs) +
             " | best ws / cuBLAS |",
             "|---|---|---|---|---|" + "---|" * len(configs) + "---|"]

    def row(label: str, prod: str, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
        m, k = a.shape
        n = b.shape[1]
        flop = 2.0 * m * n * k
        out = padded_empty(m, n, a.dtype, a.device).normal_(0, 1e-2)
        errors = [check(a, b, c, accumulate) for c in configs]
        cublas = (lambda: out.addmm_(a, b)) if accumulate else (lambda: torch.mm(a, b, out=out))
        t_ref, *t_ws = time_alternating([cublas] + [lambda c=c: ws_matmul(a, b, out, c, accumulate) for c in configs])
        cells, best = [], None
        for err, t in zip(errors, t_ws, strict=True):
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
    for shape in ([] if args.skip_products else args.shapes.split(",")):
        tokens, hidden, vocab = (int(v) for v in shape.split("x"))
        operands = products(tokens, hidden, vocab)
        for prod, (a, b) in operands.items():
            row(shape, prod, a, b)
        if args.accumulate:  # a token chunk's weight-gradient update: C += G.T @ x, K = the chunk's rows
            row(shape, "grad_weight C += G.T@x", *operands["grad_weight G.T@x"], accumulate=True)
        del operands
        torch.cuda.empty_cache()
    if args.loss_shapes:
        stats_config = dataclasses.replace(ROW_STATS_CONFIG, **dataclasses.asdict(parse_config(args.stats_config)))
        lines += forward_loss_rows(args.loss_shapes, stats_config)
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ws_gemm.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
