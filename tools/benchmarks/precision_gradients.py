"""16-bit gradients against float64, per element in units of the dtype's ULP (the spacing of bf16 or fp16 at
the float64 value) and as a relative Frobenius norm: torch eager, torch's chunked ``linear_cross_entropy`` with
``acc_policy="accurate"`` (fp32 GEMMs), flce ``precision="fast"`` and ``"accurate"`` (docs/precision.md).

Inputs: hidden ~ N(0, 1), weight ~ N(0, 1/H) in the dtype, uniform targets; a small shape in one chunk and
larger ones that flce runs in several token chunks (``memory_budget``), ``reduction`` mean and sum, three
seeds each; the table keeps the largest error over the seeds.

    python tools/benchmarks/precision_gradients.py [--device cpu] [--seeds 3] [--markdown out.md]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flce
from flce.testing import measure

# (tokens, hidden, vocab, flce memory_budget in bytes or None)
SHAPES = [(96, 32, 64, None), (512, 64, 256, 64 * 256 * 4), (2048, 64, 512, 64 * 512 * 4)]


def ulps(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (got.double() - exact).abs() / measure.ulp_spacing(exact, dtype)


def methods(target: torch.Tensor, reduction: str, budget: int | None) -> dict:
    def torch_accurate(x, w):
        options = torch.nn.LinearCrossEntropyOptions(acc_policy="accurate", acc_dtype=torch.float32,
                                                     batch_chunk_size=max(1, x.shape[0] // 4))
        return F.linear_cross_entropy(x, w, target, reduction=reduction, options=options)

    found = {"torch eager": lambda x, w: F.cross_entropy(x @ w.T, target, reduction=reduction)}
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        found["torch chunked, acc_policy accurate"] = torch_accurate
    for precision in ("fast", "accurate"):
        found[f"flce {precision}"] = (lambda x, w, p=precision: flce.linear_cross_entropy(
            x, w, target, reduction=reduction, precision=p, memory_budget=budget))
    return found


def rows(dtype: torch.dtype, device: torch.device, seeds: int) -> list[str]:
    out = []
    for (n, h, v, budget), reduction in [(s, r) for s in SHAPES for r in ("mean", "sum")]:
        worst: dict[str, list[float]] = {}
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
            w = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
            t = torch.randint(0, v, (n,), generator=g)
            xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
            exact = torch.autograd.grad(F.cross_entropy(xd @ wd.T, t, reduction=reduction), (xd, wd))
            for name, fn in methods(t.to(device), reduction, budget).items():
                xs, ws = x.to(device).requires_grad_(), w.to(device).requires_grad_()
                grads = [gr.cpu() for gr in torch.autograd.grad(fn(xs, ws), (xs, ws))]
                errors = [float(ulps(gr, ex, dtype).max()) for gr, ex in zip(grads, exact, strict=True)]
                errors += [measure.relative_difference(gr, ex) for gr, ex in zip(grads, exact, strict=True)]
                worst[name] = [max(a, b) for a, b in zip(worst.get(name, errors), errors, strict=True)]
        for name, (uh, uw, fh, fw) in worst.items():
            chunks = "one chunk" if budget is None else "chunks"
            out.append(f"| {str(dtype).removeprefix('torch.')} | {n}x{h}x{v} ({chunks}), {reduction} | {name} | "
                       f"{uh:.1f} | {uw:.1f} | {fh:.1e} | {fw:.1e} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    lines = [f"torch {torch.__version__}, {args.device}, {args.seeds} seeds (the largest error kept)", "",
             "| dtype | shape N x H x V, reduction | method | max ULP grad_hidden | max ULP grad_weight | "
             "rel. norm grad_hidden | rel. norm grad_weight |", "|---|---|---|---|---|---|---|"]
    for dtype in (torch.bfloat16, torch.float16):
        lines += rows(dtype, torch.device(args.device), args.seeds)
    measure.publish("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
