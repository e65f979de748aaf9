"""What bounds flce's schedules: their cuBLAS GEMMs alone, beside flce, as ratios to the 3-GEMM floor.

For each shape, in one process (bf16, one GPU):

* the default (in-forward) schedule at the planner's chunk size: the chunk GEMMs alone (logits,
  G @ W, G.T @ x adding into the weight gradient), the same with the row kernel between them (what
  flce runs), and flce's call;
* the lean schedule at 64 MiB (vocabulary blocks of all rows): its four GEMMs' work alone (a
  statistics pass, then per block the recomputed logits and the two gradient GEMMs), and flce's call;
* for the RL shapes, the deferred schedule at 512 MiB (RL objective, nothing kept: vocabulary blocks
  as in the lean schedule) the same way.

Any schedule built on these GEMMs takes at least the "GEMMs alone" time; the floor is measured as
the benchmark tools do (one function running the three full-size GEMMs back to back).

    python tools/benchmarks/bounds.py [--shapes 16384x2048x151936,8192x4096x128256] [--rl-shapes 16384x4096x151936]
                                      [--markdown out.md]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton

import flce
from flce.autotune import tuned_params
from flce.backends.cuda import BACKEND
from flce.backends.cuda.plan import DEFAULT_CHUNK_BUDGET, chunk_rows, vocab_block_columns
from flce.config import LCEConfig
from flce.engine.plans import PlanRequest
from flce.inputs import prepare_inputs
from flce.testing.measure import median_ms, parse_shape, publish, shape_inputs

LEAN_BUDGET = 64 << 20
RL_BUDGET = 512 << 20
RL = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}


def bounds_rows(label: str, rl: bool) -> list[str]:
    """The table rows of one shape: default and 64 MiB, or (rl) the RL call at 512 MiB."""
    dev = torch.device("cuda")
    x, w, t, g = shape_inputs(*parse_shape(label), dev)
    (n, h), v = x.shape, w.shape[0]
    xd, wd = x.detach(), w.detach()

    def floor() -> None:
        logits = xd @ wd.t()
        logits @ wd
        logits.t() @ xd

    floor_ms = median_ms(floor, warmup_ms=100, rep_ms=600)

    def ratio(fn) -> str:
        return f"{median_ms(fn, warmup_ms=100, rep_ms=600) / floor_ms:.3f}x"

    advantages = torch.randn(n, device=dev, generator=g)

    def flce_step(budget: int | None = None):
        if not rl:
            return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, memory_budget=budget), (x, w))
        out = flce.linear_cross_entropy(x, w, t, memory_budget=budget, **RL)
        return torch.autograd.grad(-(advantages * out.logprobs).mean() - 0.01 * out.entropy.mean(), (x, w))

    def blocks_row(budget: int, name: str) -> str:
        cols = vocab_block_columns(n, 2, budget)
        blocks = [slice(s, min(s + cols, v)) for s in range(0, v, cols)]
        block = torch.empty(n, cols, device=dev, dtype=torch.bfloat16)

        def gemms() -> None:
            for c in blocks:  # the statistics pass: one GEMM's work
                torch.mm(xd, wd[c].t(), out=block[:, : c.stop - c.start])
            for i, c in enumerate(blocks):  # recomputed logits, then the two gradient GEMMs
                b = block[:, : c.stop - c.start]
                torch.mm(xd, wd[c].t(), out=b)
                if i == 0:
                    torch.mm(b, wd[c], out=gx)
                else:
                    gx.addmm_(b, wd[c])
                torch.mm(b.t(), xd, out=gw[c])

        row = (f"| {label} | {name}: {len(blocks)} blocks of {cols} columns | {ratio(gemms)} | | "
               f"{ratio(lambda: flce_step(budget))} |")
        print(row, flush=True)
        return row

    gx, gw = torch.empty_like(xd), torch.empty_like(wd)
    if rl:
        return [blocks_row(RL_BUDGET, "RL, 512 MiB")]

    shipped, _ = tuned_params(dev, "cuda", "plain", torch.bfloat16, h, v, n)
    chunk = (shipped or {}).get("tokens_per_chunk") or chunk_rows(n, DEFAULT_CHUNK_BUDGET // (v * 2))
    chunks = [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    logits = torch.empty(chunk, v, device=dev, dtype=torch.bfloat16)
    # The row kernels as the library's call of this shape launches them (its kernel choice).
    kernels = BACKEND.plan_call(prepare_inputs(xd, wd, t, None, LCEConfig()), LCEConfig(), "plain",
                                PlanRequest(training=True)).kernels
    scale = torch.tensor(1.0 / n, device=dev)

    def in_forward(row_kernel: bool) -> None:
        for i, r in enumerate(chunks):
            b = logits[: r.stop - r.start]
            torch.mm(xd[r], wd.t(), out=b)
            if row_kernel:
                kernels.plain_loss(b, t[r], -100, scale)
            torch.mm(b, wd, out=gx[r])
            if i == 0:
                torch.mm(b.t(), xd[r], out=gw)
            else:
                gw.addmm_(b.t(), xd[r])

    rows = [f"| {label} | default: {len(chunks)} chunks of {chunk} rows | {ratio(lambda: in_forward(False))} "
            f"| {ratio(lambda: in_forward(True))} | {ratio(flce_step)} |"]
    print(rows[-1], flush=True)
    rows.append(blocks_row(LEAN_BUDGET, "64 MiB"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="16384x2048x151936,8192x4096x128256")
    parser.add_argument("--rl-shapes", default="16384x4096x151936")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    rows = ["| shape | schedule | cuBLAS GEMMs alone | GEMMs + row kernel | flce |", "|---|---|---|---|---|"]
    for labels, rl in ((args.shapes, False), (args.rl_shapes, True)):
        for label in filter(None, labels.split(",")):
            rows += bounds_rows(label, rl)
            torch.cuda.empty_cache()
    text = "\n".join([f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
                      f"{datetime.date.today()}, `python tools/benchmarks/bounds.py`", "",
                      "forward+backward, ratio to the 3-GEMM floor:", "", *rows])
    publish(text, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
