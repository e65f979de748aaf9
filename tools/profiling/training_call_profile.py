"""The kernels of flce's default training call against the floor's three cuBLAS products, under Nsight Compute
with the clocks locked (so durations are cycles, not the power cap's clock), kernel by kernel and summed.

Run it through ``ncu_training_call.sh``, which profiles each side in its own process between profiler marks (a
warm-up run first, so nothing compiles inside the marks) and then tabulates both reports::

    bash tools/profiling/ncu_training_call.sh 16384x2048x151936 [MEMORY_BUDGET_MIB]

``python tools/profiling/training_call_profile.py run SHAPE {floor,call} [--budget-mib N]``: the marked launches;
``python tools/profiling/training_call_profile.py table FLOOR.csv CALL.csv``: the markdown table of two
``ncu --csv --page raw`` reports (kernels grouped by name: launches, ms, DRAM GB read / written, SM throughput);
``python tools/profiling/training_call_profile.py metrics``: the ``ncu --metrics`` list those reports need.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import defaultdict

DURATION = "gpu__time_duration.sum"
READ, WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
METRICS = (DURATION, READ, WRITE, SM)
_SCALE = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "ms": 1.0, "msecond": 1.0, "s": 1e3,
          "second": 1e3, "byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "%": 1.0}


def run(shape: str, side: str, budget_mib: int | None) -> None:
    import torch

    import flce
    from flce.testing.measure import floor_gradient, floor_products, parse_shape, shape_inputs

    tokens, hidden, vocab = parse_shape(shape)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab)
    if side == "floor":
        step = floor_products(x, w, floor_gradient(tokens, vocab, x.dtype, x.device))
    else:
        options = {} if budget_mib is None else {"memory_budget": budget_mib << 20}

        def step() -> object:
            return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, **options), (x, w))

    step()  # compile and plan outside the marks
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read_report(text: str) -> list[dict]:
    """Rows of an ``ncu --csv --page raw`` report: kernel name and METRICS in ms / GB / %."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if len(lines) < 2:
        return []
    header, units, *rows = list(csv.reader(io.StringIO("\n".join(lines))))
    out = []
    for row in rows:
        record = dict(zip(header, row, strict=False))
        unit = dict(zip(header, units, strict=False))
        kernel = {"name": record.get("Kernel Name", "?")}
        for metric in METRICS:
            value = record.get(metric, "").replace(",", "")
            kernel[metric] = float(value) * _SCALE.get(unit.get(metric, ""), 1.0) if value else 0.0
        out.append(kernel)
    return out


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name[:60]


def table(floor: list[dict], call: list[dict]) -> str:
    lines = ["| side | kernel | launches | ms | DRAM GB read / written | SM throughput % (mean) |",
             "|---|---|---|---|---|---|"]
    totals = {}
    for side, kernels in (("floor", floor), ("call", call)):
        groups: dict[str, list[dict]] = defaultdict(list)
        for kernel in kernels:
            groups[short_name(kernel["name"])].append(kernel)
        for name, group in sorted(groups.items(), key=lambda item: -sum(k[DURATION] for k in item[1])):
            ms = sum(k[DURATION] for k in group)
            read, written = sum(k[READ] for k in group), sum(k[WRITE] for k in group)
            sm = sum(k[SM] * k[DURATION] for k in group) / ms if ms else 0.0
            lines.append(f"| {side} | `{name}` | {len(group)} | {ms:.3f} | {read:.2f} / {written:.2f} | {sm:.0f} |")
        totals[side] = (sum(k[DURATION] for k in kernels), sum(k[READ] + k[WRITE] for k in kernels))
    lines.append("")
    for side, (ms, gb) in totals.items():
        lines.append(f"{side}: {ms:.3f} ms of kernels, {gb:.1f} GB of DRAM traffic")
    if totals.get("floor", (0,))[0]:
        lines.append(f"call / floor: {totals['call'][0] / totals['floor'][0]:.3f} (kernel time at locked clocks)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    marked = sub.add_parser("run")
    marked.add_argument("shape")
    marked.add_argument("side", choices=("floor", "call"))
    marked.add_argument("--budget-mib", type=int, default=None)
    tab = sub.add_parser("table")
    tab.add_argument("floor_csv")
    tab.add_argument("call_csv")
    sub.add_parser("metrics")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.shape, args.side, args.budget_mib)
    elif args.command == "metrics":
        print(",".join(METRICS))
    else:
        with open(args.floor_csv) as floor, open(args.call_csv) as call:
            print(table(read_report(floor.read()), read_report(call.read())))


if __name__ == "__main__":
    main()
