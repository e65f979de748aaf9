"""Which GEMMs the default training call runs, side by side, one GPU, bf16, one process.

The default call (plain loss, mean, gradients in forward) runs per token chunk: the chunk's logits
(``forward_logits``: cuBLAS and the row kernel, or the fused statistics GEMM that also writes them:
the warp-specialised one on Hopper) and the gradient row kernel, or (``chunk_grad="exponentials"``) the
ws statistics GEMM keeping row-offset exponentials and no row kernel; then the two gradient products
(``grad_gemm_kernel``: cuBLAS, or the warp-specialised GEMM, which fetches the weight gradient's tile
for its read-modify-write during its main loop). Each combination is timed as a ratio to the three
cuBLAS GEMMs timed beside it, in turn, twice (``--rounds``), with peak MiB above the gradients and
the gradients' difference from the all-cuBLAS combination. Then the weight-gradient product of one
default chunk alone: written (beta = 0) and accumulated (beta = 1), by cuBLAS and by the ws GEMM.

    python tools/benchmarks/training_kernels.py --markdown out.md [--shapes 8192x4096x128256,...]
"""

from __future__ import annotations

import argparse
import datetime

import torch

import flce
from flce.autotune import override_params
from flce.testing.measure import (
    cublas_products_ms,
    median_ms,
    parse_shape,
    peak_mib_above,
    publish,
    relative_difference,
    shape_inputs,
)

SHAPES = "4096x4096x32000,8192x4096x128256,16384x2048x151936"
VARIANTS = {  # label: the knobs set for the call (everything else: the planner's heuristics)
    "cuBLAS logits + row kernel + cuBLAS grads": {"forward_logits": "cublas", "chunk_grad": "logits",
                                                  "grad_gemm_kernel": "cublas"},
    "ws logits + row kernel + cuBLAS grads": {"forward_logits": "fused", "chunk_grad": "logits",
                                              "grad_gemm_kernel": "cublas"},
    "ws exponentials + cuBLAS grads": {"forward_logits": "fused", "chunk_grad": "exponentials",
                                       "grad_gemm_kernel": "cublas"},
}
WS_GRAD_VARIANTS = {  # --ws-grads: the gradient products on the warp-specialised GEMM too
    "ws logits + row kernel + ws grads": {"forward_logits": "fused", "chunk_grad": "logits",
                                          "grad_gemm_kernel": "warp_specialized"},
    "ws exponentials + ws grads": {"forward_logits": "fused", "chunk_grad": "exponentials",
                                   "grad_gemm_kernel": "warp_specialized"},
}


def training_rows(label: str, rounds: int, variants: dict[str, dict]) -> list[str]:
    tokens, hidden, vocab = parse_shape(label)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab)

    def step(knobs: dict) -> tuple[torch.Tensor, ...]:
        with override_params(knobs, backend="cuda"):
            loss = flce.linear_cross_entropy(x, w, t)
            return (loss, *torch.autograd.grad(loss, (x, w)))

    ratios: dict[str, list[float]] = {name: [] for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        floor = sum(cublas_products_ms(x, w))
        for name, knobs in variants.items():
            ms = median_ms(lambda knobs=knobs: step(knobs))
            times[name].append(ms)
            ratios[name].append(ms / floor)
    base = step(next(iter(VARIANTS.values())))
    rows = []
    for name, knobs in variants.items():
        got = step(knobs)
        diffs = [relative_difference(a, b) for a, b in zip(got, base, strict=True)]
        peak = peak_mib_above(lambda knobs=knobs: step(knobs))
        rows.append(f"| {label} | {name} | {' / '.join(f'{m:.2f}' for m in times[name])} | "
                    f"{' / '.join(f'{r:.3f}x' for r in ratios[name])} | {peak:.0f} | "
                    f"{diffs[0]:.1e} / {diffs[1]:.1e} / {diffs[2]:.1e} |")
    return rows


def accumulate_rows(label: str) -> list[str]:
    """grad_weight [V, H] (+)= G.T @ x of one default chunk (the planner's tokens_per_chunk)."""
    from flce.backends.cuda.plan import DEFAULT_CHUNK_BUDGET, chunk_rows
    from flce.backends.cuda.ws_gemm_ops import ws_matmul

    tokens, hidden, vocab = parse_shape(label)
    chunk = chunk_rows(tokens, DEFAULT_CHUNK_BUDGET // (vocab * 2))
    x = torch.randn(chunk, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    flops = 2 * chunk * hidden * vocab
    cases = {"cuBLAS mm (beta 0)": lambda: torch.mm(g.T, x, out=out),
             "cuBLAS addmm_ (beta 1)": lambda: out.addmm_(g.T, x),
             "ws (beta 0)": lambda: ws_matmul(g.T, x, out),
             "ws accumulate (beta 1)": lambda: ws_matmul(g.T, x, out, accumulate=True)}
    rows = []
    for name, fn in cases.items():
        ms = median_ms(fn)
        rows.append(f"| {label} | {vocab}x{hidden}x{chunk} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--ws-grads", action="store_true", help="also the gradient products on the ws GEMM")
    parser.add_argument("--no-accumulate", action="store_true", help="skip the weight-gradient product alone")
    args = parser.parse_args()
    variants = {**VARIANTS, **(WS_GRAD_VARIANTS if args.ws_grads else {})}
    shapes = args.shapes.split(",")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp}", "",
             "| shape N x H x V | GEMMs | ms (each round) | x cuBLAS floor (each round) | MiB above grads | "
             "rel. diff loss / grad_hidden / grad_weight vs the first row |", "|---|---|---|---|---|---|"]
    for label in shapes:
        lines += training_rows(label, args.rounds, variants)
    if not args.no_accumulate:
        lines += ["", "| shape | M x N x K (one chunk) | grad_weight product | ms | TFLOP/s |",
                  "|---|---|---|---|---|"]
        for label in shapes:
            lines += accumulate_rows(label)
    publish("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
