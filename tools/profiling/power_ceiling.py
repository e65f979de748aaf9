"""What bounds a 16-bit GEMM under the GPU's power cap, and how much the floor's gradient moves the floor.

1. Each product ``x @ W.T`` (cuBLAS, and flce's warp-specialised GEMM on Hopper) timed back to back while
   nvidia-smi samples the SM clock and the board's power (flce/testing/clocks.py): its TFLOP/s against the
   dense tensor-core peak at the clock it ran at (Hopper: 4096 16-bit FLOP a clock a multiprocessor).
2. The floor's two gradient products ``G @ W`` and ``G.T @ x`` by cuBLAS with G drawn four ways: the N(0, 1)
   of ``flce.testing.measure.floor_gradient`` (every floor in flce's tools), N(0, 1) / V, the mean loss's own
   gradient (softmax - onehot) / count on the same inputs, zeros.
3. With ``--calls``: flce's default training call (loss, then the gradients of x and W) and the same call with
   ``memory_budget=2 << 30``, beside the floor's three cuBLAS products back to back, each timed as above while the
   clock is sampled: the call's ratio to the floor, and that ratio at equal clocks (times the call's clock over the
   floor's), which is what is left of the call's excess where its own traffic lowers the clock under the cap; only
   where both timings held the cap (within AT_THE_CAP of the floor's power: use --rep-ms of a second or more).

Every timing is ``triton.testing.do_bench``'s median over ``--rep-ms`` after a warm-up, the variants in turn,
``--rounds`` rounds; a cell is the median over rounds (range), the clock and power the median over rounds of the
samples' mean during each of the variant's timings. Inputs: ``flce.testing.measure.shape_inputs``, bf16.

    python tools/profiling/power_ceiling.py [--shapes 16384x2048x151936,8192x4096x128256] [--rounds 3]
                                            [--rep-ms 2000] [--skip-gradients] [--calls] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from flce.testing.clocks import ClockSampler
from flce.testing.measure import (
    IGNORE_INDEX,
    floor_gradient,
    floor_products,
    median_ms,
    median_range,
    parse_shape,
    publish,
    shape_inputs,
)

# Dense 16-bit tensor-core FLOP a clock a multiprocessor, by compute capability (Hopper's 4th-generation tensor
# cores: 4 a multiprocessor x 512 FMA). A GPU not listed gets no peak column.
TENSOR_FLOP_PER_CLOCK_SM = {(9, 0): 4096}


def tensor_peak_tflops(capability: tuple[int, int], multiprocessors: int, sm_mhz: float) -> float | None:
    """The dense 16-bit tensor peak (TFLOP/s) at ``sm_mhz``, or None for a GPU whose rate is not listed."""
    per_clock = TENSOR_FLOP_PER_CLOCK_SM.get(tuple(capability))
    return None if per_clock is None else per_clock * multiprocessors * sm_mhz * 1e6 / 1e12


def loss_gradient(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                  rows_per_block: int = 2048) -> torch.Tensor:
    """d(mean cross-entropy)/d(logits) of ``hidden @ weight.T`` in hidden's dtype: (softmax - onehot) / count on
    the rows whose target is not IGNORE_INDEX, 0 on the others; the softmax in fp32, ``rows_per_block`` rows at a
    time (a [rows, V] fp32 block at a time, not the whole batch's)."""
    count = max(int((target != IGNORE_INDEX).sum()), 1)
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], rows_per_block):
        rows = slice(start, start + rows_per_block)
        grad = torch.softmax((hidden[rows] @ weight.T).float(), dim=1)
        kept = target[rows] != IGNORE_INDEX
        grad[kept, target[rows][kept]] -= 1.0
        grad[~kept] = 0.0
        out[rows] = (grad / count).to(hidden.dtype)
    return out


def timed_with_clocks(fns: dict[str, Callable[[], object]], rounds: int, rep_ms: float,
                      device: torch.device) -> dict[str, dict]:
    """Per variant and round: its median (ms), and the mean SM clock and power sampled during that timing (none
    where ClockSampler has nothing to sample: a CPU, no nvidia-smi); "held_back" lists the rounds heat or a power
    brake slowed (their clocks compare with nothing, flce/testing/clocks.py)."""
    results = {name: {"ms": [], "mhz": [], "watts": [], "held_back": []} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with ClockSampler(device, interval_ms=20) as clocks:
                results[name]["ms"].append(median_ms(fn, warmup_ms=200, rep_ms=rep_ms))
            if clocks.summary is not None:
                results[name]["mhz"].append(clocks.summary.sm_mhz_mean)
                results[name]["watts"].append(clocks.summary.power_mean_w)
                if clocks.summary.held_back:
                    results[name]["held_back"].append(clocks.summary.describe())
    return results


def median_or_dash(values: list[float]) -> str:
    """The median over rounds of a sampled figure (the first round's samples include the seconds before the
    power cap bites), or "-" where nothing was sampled."""
    return f"{statistics.median(values):.0f}" if values else "-"


def products_table(label: str, rounds: int, rep_ms: float, device: torch.device) -> list[str]:
    from flce.backends.cuda.ws_gemm_ops import padded_empty, ws_matmul, ws_supported

    tokens, hidden, vocab = parse_shape(label)
    x, w, _, _ = shape_inputs(tokens, hidden, vocab, device, requires_grad=False)
    out = padded_empty(tokens, vocab, x.dtype, x.device)
    fns = {"cuBLAS x @ W.T": lambda: torch.mm(x, w.T, out=out)}
    if ws_supported(x, w.T):
        fns["flce ws x @ W.T"] = lambda: ws_matmul(x, w.T, out)
    results = timed_with_clocks(fns, rounds, rep_ms, device)
    lines = []
    for name, r in results.items():
        ms = statistics.median(r["ms"])
        tflops = 2 * tokens * hidden * vocab / ms / 1e9
        peak = None
        if r["mhz"] and device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            peak = tensor_peak_tflops((props.major, props.minor), props.multi_processor_count,
                                      statistics.median(r["mhz"]))
        lines.append(f"| {label} | {name} | {median_range(r['ms'])} | {tflops:.0f} | {median_or_dash(r['mhz'])} | "
                     f"{median_or_dash(r['watts'])} | {'-' if peak is None else f'{peak:.0f}'} | "
                     f"{'-' if peak is None else f'{tflops / peak:.3f}'} |")
        lines += [f"| {label} | {name}: held back | {why} | | | | | |" for why in r["held_back"]]
    return lines


def gradients_table(label: str, rounds: int, rep_ms: float, device: torch.device) -> list[str]:
    tokens, hidden, vocab = parse_shape(label)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab, device, requires_grad=False)
    normal = floor_gradient(tokens, vocab, x.dtype, x.device)
    gradients = {"N(0, 1) (floor_gradient)": normal, "N(0, 1) / V": normal / vocab,
                 "the loss's gradient": loss_gradient(x, w, t), "zeros": torch.zeros_like(normal)}
    fns = {}
    for name, g in gradients.items():
        fns[f"{name}: G @ W"] = lambda g=g: g @ w
        fns[f"{name}: G.T @ x"] = lambda g=g: g.T @ x
    results = timed_with_clocks(fns, rounds, rep_ms, device)
    lines = []
    for name in gradients:
        hidden_r, weight_r = results[f"{name}: G @ W"], results[f"{name}: G.T @ x"]
        lines.append(f"| {label} | {name} | {median_range(hidden_r['ms'])} | {median_range(weight_r['ms'])} | "
                     f"{median_or_dash(hidden_r['mhz'] + weight_r['mhz'])} | "
                     f"{median_or_dash(hidden_r['watts'] + weight_r['watts'])} |")
        held_back = hidden_r["held_back"] + weight_r["held_back"]
        lines += [f"| {label} | {name}: held back | {why} | | | |" for why in held_back]
    return lines


# A timing's power over the floor's at least this for the two to share a clock ceiling.
AT_THE_CAP = 0.95


def calls_table(label: str, rounds: int, rep_ms: float, device: torch.device) -> list[str]:
    """The floor's three products as one timing, flce's default call and its 2 GiB call, with their clocks."""
    import flce

    tokens, hidden, vocab = parse_shape(label)
    x, w, t, _ = shape_inputs(tokens, hidden, vocab, device)
    floor = floor_products(x, w, floor_gradient(tokens, vocab, x.dtype, x.device))

    def call(**options) -> Callable[[], object]:
        return lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t, **options), (x, w))

    fns = {"the floor's 3 cuBLAS products": floor, "flce, default": call(), "flce, 2 GiB": call(memory_budget=2 << 30)}
    results = timed_with_clocks(fns, rounds, rep_ms, device)
    base = results["the floor's 3 cuBLAS products"]
    lines = []
    for name, r in results.items():
        ratios = [ms / floor_ms for ms, floor_ms in zip(r["ms"], base["ms"], strict=True)]
        equal = "-"
        if r["mhz"] and len(r["mhz"]) == len(base["mhz"]) == len(ratios):
            # Clocks compare only where both timings held the power cap: a timing too short for the GPU to heat
            # samples its boost clock at low power (one of 0.3 s drew 150 W at 1967 MHz beside the floor's 592 W).
            if min(r["watts"]) < AT_THE_CAP * max(base["watts"]):
                equal = "- (below the floor's power)"
            else:
                equal = median_range([q * mhz / floor_mhz for q, mhz, floor_mhz in zip(ratios, r["mhz"],
                                                                                     base["mhz"], strict=True)])
        lines.append(f"| {label} | {name} | {median_range(r['ms'])} | {median_range(ratios)} | "
                     f"{median_or_dash(r['mhz'])} | {median_or_dash(r['watts'])} | {equal} |")
        lines += [f"| {label} | {name}: held back | {why} | | | | |" for why in r["held_back"]]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x2048x151936,8192x4096x128256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=2000.0)
    parser.add_argument("--skip-gradients", action="store_true", help="only the x @ W.T table")
    parser.add_argument("--calls", action="store_true", help="also flce's training calls beside the floor")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only runs the code through")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    labels = args.shapes.split(",")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = [f"### {name}, torch {torch.__version__}", "",
            f"Command: `python tools/profiling/power_ceiling.py --shapes {args.shapes} --rounds {args.rounds} "
            f"--rep-ms {args.rep_ms:g}{' --skip-gradients' if args.skip_gradients else ''}"
            f"{' --calls' if args.calls else ''}`", "",
            "| shape | GEMM | ms, median (range) | TFLOP/s | SM MHz | W | tensor peak at that clock, TFLOP/s "
            "| fraction |",
            "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        text += products_table(label, args.rounds, args.rep_ms, device)
    if not args.skip_gradients:
        text += ["", "The floor's gradient products by cuBLAS, G drawn four ways:", "",
                 "| shape | G | `G @ W` ms | `G.T @ x` ms | SM MHz | W |", "|---|---|---|---|---|---|"]
        for label in labels:
            text += gradients_table(label, args.rounds, args.rep_ms, device)
    if args.calls:
        text += ["", "flce's training calls beside the floor's three products (one timing each, clocks sampled during "
                 "it); x floor: each round's ms over that round's floor; at equal clocks: that ratio times the call's "
                 "SM clock over the floor's:", "",
                 "| shape | timed | ms, median (range) | x floor | SM MHz | W | x floor at equal clocks |",
                 "|---|---|---|---|---|---|---|"]
        for label in labels:
            text += calls_table(label, args.rounds, args.rep_ms, device)
    publish("\n".join(text), args.markdown)


if __name__ == "__main__":
    main()
