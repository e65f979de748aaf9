"""Where linear distillation's time goes beyond its 4-GEMM floor, one GPU, bf16, one process.

Per shape (tokens x student H x teacher H x V): the cuBLAS 4-GEMM floor and flce's JSD call (beta 0.5, forward +
backward into the student) at memory budgets from 512 MiB to one chunk, and at 512 MiB with the pair passes as
separate kernels and with the warp-specialised gradient products, interleaved round by round (ratios to each
round's floor); then the kernels of one default call and of one floor by the torch profiler, summed by name
(ms per call, launches per call). The budget sweep separates what each extra chunk costs (its weight-gradient
read-modify-write, its shorter GEMMs) from what every chunk costs (the passes over the logits).

    python tools/benchmarks/distill_profile.py --markdown out.md [--shapes 8192x4096x4096x128256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics

import torch

import flce
from flce.autotune import override_params
from flce.testing.measure import MiB, floor_gradient, kernel_times, median_ms, peak_mib_above, publish, shape_inputs

SHAPES = "8192x4096x4096x128256,8192x4096x8192x128256"
VARIANTS = {  # label: (memory budget in MiB, autotune knobs)
    "512 MiB": (512, None),
    "1 GiB": (1024, None),
    "2 GiB": (2048, None),
    "one chunk": (None, None),  # the budget that holds every row's two logits, set per shape
    "512 MiB, separate passes": (512, {"pair_passes": "separate"}),
    "512 MiB, ws gradient products": (512, {"grad_gemm_kernel": "warp_specialized"}),
}


def inputs(shape: str) -> tuple:
    tokens, student, teacher, vocab = (int(p) for p in shape.split("x"))
    xs, ws, target, _ = shape_inputs(tokens, student, vocab)
    xt, wt, _, _ = shape_inputs(tokens, teacher, vocab, seed=1, requires_grad=False)
    return xs, ws, xt, wt, target


def step_of(tensors: tuple, budget_mib: int, knobs: dict | None):
    xs, ws, xt, wt, target = tensors

    def step() -> tuple[torch.Tensor, ...]:
        with override_params(knobs, backend="cuda"):
            loss = flce.linear_distillation_loss(xs, ws, xt, wt, target, loss="jsd", beta=0.5,
                                                 memory_budget=budget_mib * MiB, backend="cuda")
        return torch.autograd.grad(loss, (xs, ws))

    return step


def floor_of(tensors: tuple):
    xs, ws, xt, wt, _ = tensors
    xs, ws = xs.detach(), ws.detach()
    g = floor_gradient(xs.shape[0], ws.shape[0], xs.dtype, xs.device)
    return lambda: (xt @ wt.t(), xs @ ws.t(), g @ ws, g.t() @ xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lines = [f"### {torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, JSD beta 0.5, "
             f"bf16, {args.rounds} rounds"]
    data = {}
    for shape in args.shapes.split(","):
        tensors = inputs(shape)
        tokens, vocab = tensors[0].shape[0], tensors[1].shape[0]
        one_chunk = (2 * tokens * vocab * 2) // MiB + 64
        steps = {label: step_of(tensors, one_chunk if mib is None else mib, knobs)
                 for label, (mib, knobs) in VARIANTS.items()}
        floor = floor_of(tensors)
        ratios: dict[str, list[float]] = collections.defaultdict(list)
        peaks = {label: peak_mib_above(step) for label, step in steps.items()}
        for _ in range(args.rounds):
            floor_ms = median_ms(floor, warmup_ms=200, rep_ms=1000)
            ratios["floor ms"].append(floor_ms)
            for label, step in steps.items():
                ratios[label].append(median_ms(step, warmup_ms=200, rep_ms=1000) / floor_ms)
        lines += ["", f"#### {shape}", "", "| call | x 4-GEMM floor (rounds) | MiB above grads |", "|---|---|---|"]
        lines.append(f"| 4-GEMM floor | {statistics.median(ratios['floor ms']):.2f} ms | 0 |")
        for label in steps:
            lines.append(f"| {label} | {statistics.median(ratios[label]):.3f} "
                         f"({', '.join(f'{r:.3f}' for r in ratios[label])}) | {peaks[label]:.0f} |")
        tables = {"flce 512 MiB": kernel_times(steps["512 MiB"]), "floor": kernel_times(floor)}
        for title, rows in tables.items():
            lines += ["", f"{title}: kernels, ms per call (launches)", "", "| kernel | ms | launches |",
                      "|---|---|---|"]
            lines += [f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in rows[:14]]
            lines.append(f"| all | {sum(ms for _, ms, _ in rows):.3f} | {sum(n for _, _, n in rows):g} |")
        data[shape] = {"ratios": ratios, "peaks": peaks, "kernels": tables}
        del tensors, steps, floor
        torch.cuda.empty_cache()
    publish("\n".join(lines), args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shapes": data}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
