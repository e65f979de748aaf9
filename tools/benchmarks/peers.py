"""Side-by-side GPU benchmark of linear cross-entropy implementations.

One process, one GPU. For each shape (tokens x hidden x vocab, bf16) and method: forward+backward
median time (triton.testing.do_bench), its ratio to the 3-GEMM floor measured in the same process,
and peak memory above the gradients ((V*H + BT*H) * element size); forward-only too.

    python tools/benchmarks/peers.py                       # all shapes, every method importable here
    python tools/benchmarks/peers.py --shapes 8192x4096x128256 --methods flce,liger --markdown out.md
    python tools/benchmarks/peers.py --methods flce,quack --rounds 3   # interleaved, median (range)
    python tools/benchmarks/peers.py --rounds 3 --json h100.json      # then: tools/benchmarks/plot.py h100.json

Inputs, timing and peak memory come from flce.testing.measure (the same as every tool and the tuner).

Peers are used when importable: Liger-Kernel, Cut Cross-Entropy; torch's F.linear_cross_entropy
when this torch has it; the CuTe-DSL peers of cute_peers.py (quack's linear cross-entropy, Liger's CuTe
paths) where nvidia-cutlass-dsl imports, and then quack's GEMM joins the best-GEMM floor.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from cute_peers import liger_cute_methods, quack_gemm, quack_methods

import flce
from flce.testing.clocks import ClockSampler, ClockSummary
from flce.testing.measure import (
    MiB,
    floor_gradient,
    floor_products,
    median_ms,
    parse_shape,
    peak_mib_above,
    publish,
    round_order,
    shape_inputs,
)

DEFAULT_SHAPES = ("4096x4096x32000", "8192x4096x128256", "16384x2048x151936")


@dataclass
class Case:
    tokens: int
    hidden: int
    vocab: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.hidden}x{self.vocab}"


def make_inputs(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w, t, _ = shape_inputs(case.tokens, case.hidden, case.vocab, device, case.dtype)
    return x, w, t


# Each method: (x, w, t) -> loss, differentiable w.r.t. x and w.
def torch_eager(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t, ignore_index=-100)


_compiled_eager = None


def torch_compile(x, w, t):
    global _compiled_eager
    if _compiled_eager is None:
        _compiled_eager = torch.compile(torch_eager)
    return _compiled_eager(x, w, t)


class _ChunkedGradAndValue(torch.autograd.Function):
    """The chunked torch.func.grad_and_value + torch.compile recipe: gradients of each token chunk
    computed during forward by a compiled function, handed out in backward."""

    compiled = None

    @staticmethod
    def forward(ctx, x, w, t, chunk):
        if _ChunkedGradAndValue.compiled is None:
            def chunk_loss(xc, wt, tc, denom):
                return F.cross_entropy((xc @ wt.t()).float(), tc, ignore_index=-100, reduction="sum") / denom
            _ChunkedGradAndValue.compiled = torch.compile(torch.func.grad_and_value(chunk_loss, argnums=(0, 1)))
        denom = (t != -100).sum().clamp_min(1).float()
        gx = torch.empty_like(x)
        gw = torch.zeros_like(w)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        for s in range(0, x.shape[0], chunk):
            (gxc, gwc), lc = _ChunkedGradAndValue.compiled(x[s:s + chunk], w, t[s:s + chunk], denom)
            gx[s:s + chunk] = gxc
            gw += gwc
            loss += lc
        ctx.save_for_backward(gx, gw)
        return loss

    @staticmethod
    def backward(ctx, grad):
        gx, gw = ctx.saved_tensors
        return gx * grad, gw * grad, None, None


def torch_chunked_compile(x, w, t):
    return _ChunkedGradAndValue.apply(x, w, t, 1024)


def flce_default(x, w, t):
    return flce.linear_cross_entropy(x, w, t)


def flce_budget(budget: int) -> Callable:
    """flce allowed ``budget`` bytes above the gradients: the planner's larger chunks (docs/usage.md)."""
    return lambda x, w, t: flce.linear_cross_entropy(x, w, t, memory_budget=budget)


def flce_accurate(x, w, t):
    return flce.linear_cross_entropy(x, w, t, precision="accurate")


# The generic path on this GPU: calls planned as an A100 would plan them (FLCE_CUDA_PLAN_AS: no TMA, no
# warp-specialised GEMM), with the heuristic's kernels or the knobs flce-autotune may store for such a GPU.
GENERIC_GPU = "NVIDIA A100-SXM4-80GB"
GENERIC_KNOBS = {"flce_generic": None,
                 "flce_generic_exp": {"chunk_grad": "exponentials", "logits_kernel": "triton"},
                 "flce_generic_logits": {"forward_logits": "fused", "logits_kernel": "triton", "chunk_grad": "logits"}}


def flce_generic(knobs: dict | None) -> Callable:
    def call(x, w, t):
        from flce.autotune import override_params

        previous = os.environ.get("FLCE_CUDA_PLAN_AS")
        os.environ["FLCE_CUDA_PLAN_AS"] = GENERIC_GPU
        try:
            with override_params(knobs, backend="cuda") if knobs else contextlib.nullcontext():
                return flce.linear_cross_entropy(x, w, t)
        finally:
            if previous is None:
                os.environ.pop("FLCE_CUDA_PLAN_AS")
            else:
                os.environ["FLCE_CUDA_PLAN_AS"] = previous

    return call


def peer_methods() -> dict[str, Callable]:
    methods: dict[str, Callable] = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        methods["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as exc:
        print(f"liger unavailable: {exc}", file=sys.stderr)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        methods["cce"] = lambda x, w, t: cce(x, w, t, ignore_index=-100)
    except Exception as exc:
        print(f"cut-cross-entropy unavailable: {exc}", file=sys.stderr)
    if "liger" in methods:
        methods.update(liger_cute_methods())
    methods.update(quack_methods())
    if hasattr(F, "linear_cross_entropy"):
        methods["torch_native_chunked"] = lambda x, w, t: F.linear_cross_entropy(x, w, t, ignore_index=-100)
    return methods


def all_methods() -> dict[str, Callable]:
    methods = {"torch_eager": torch_eager, "torch_compile": torch_compile,
               "torch_chunked_compile": torch_chunked_compile}
    methods.update(peer_methods())
    methods.update({"flce": flce_default, "flce_1GiB": flce_budget(1024 * MiB), "flce_2GiB": flce_budget(2048 * MiB),
                    "flce_64MiB": flce_budget(64 * MiB), "flce_accurate": flce_accurate})
    methods.update({name: flce_generic(knobs) for name, knobs in GENERIC_KNOBS.items()})
    return methods


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms over 1.5 s after 200 ms of warm-up: a 100 ms call gets 15 samples. With 400 ms (4 samples of such
    a call) the medians moved by up to 3% and the ranges over rounds were 2-10x wider (one H100, one process,
    flce and torch.compile at 16384x4096x151936 and 8192x4096x128256; docs/data/h100-2026-11-27-peers-rep.md)."""
    return median_ms(fn, warmup_ms=200, rep_ms=1500)


def measure(case: Case, name: str, method: Callable, device: str) -> dict:
    x, w, t = make_inputs(case, device)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        loss = method(x, w, t)
        return torch.autograd.grad(loss, (x, w))

    def fwd_only() -> torch.Tensor:
        with torch.no_grad():
            return method(x, w, t)

    row: dict = {"shape": case.label, "method": name}
    try:
        fwd_bwd()  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        row["peak_mib"] = peak_mib_above(fwd_bwd)  # above the gradients it returns
        row["fwd_bwd_ms"] = bench_ms(fwd_bwd)
    except Exception as exc:
        row["error"] = failure(exc)
    gc.collect()
    torch.cuda.empty_cache()
    try:  # forward-only on its own: a peer may fail one and run the other
        fwd_only()
        row["fwd_peak_mib"] = peak_mib_above(fwd_only)
        row["fwd_ms"] = bench_ms(fwd_only)
    except Exception as exc:
        row["fwd_error"] = failure(exc)
    gc.collect()
    torch.cuda.empty_cache()
    return row


def failure(exc: Exception) -> str:
    """A table cell for a call that raised: the exception's type and its first line."""
    lines = str(exc).strip().splitlines() or [""]
    return f"fails: {type(exc).__name__}: {lines[0][:140]}"


def floor_operands(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], W [V, H] and the floor's gradient G [N, V] of one round, without autograd."""
    x, w, _ = make_inputs(case, device)
    return x.detach(), w.detach(), floor_gradient(case.tokens, case.vocab, case.dtype, device)


def floors(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """(3-GEMM fwd+bwd floor ms, 1-GEMM forward floor ms) by cuBLAS."""
    three = bench_ms(floor_products(x, w, g))
    one = bench_ms(lambda: x @ w.t())
    return three, one


PRODUCTS = ("x @ W.T", "G @ W", "G.T @ x")
GEMMS = ("cuBLAS", "ws", "quack")


def product_times(case: Case, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                  quack: Callable | None) -> dict[str, dict[str, float]]:
    """Each product of the floor timed with every GEMM available here (cuBLAS; flce's warp-specialised Gluon
    GEMM on Hopper; ``quack``, quack's GEMM where it imports): {product: {GEMM: ms}}."""
    from flce.backends.cuda.ws_gemm_ops import ws_matmul, ws_supported

    ws = ws_supported(x, w.t())
    operands = dict(zip(PRODUCTS, ((x, w.t()), (g, w), (g.t(), x)), strict=True))
    return {name: gemm_times(case, name, a, b, (lambda a=a, b=b: ws_matmul(a, b)) if ws else None, quack)
            for name, (a, b) in operands.items()}


def best_floors(times: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(the best-GEMM 3-product floor ms, the best-GEMM forward floor ms): the fastest GEMM per product."""
    best = {name: min(by_gemm.values()) for name, by_gemm in times.items()}
    return sum(best.values()), best["x @ W.T"]


def product_lines(case: Case, rounds: list[dict[str, dict[str, float]]]) -> list[str]:
    """The GEMM table's rows for one shape: each product's median ms over the rounds and its TFLOP/s, per GEMM."""
    tflop = 2 * case.tokens * case.hidden * case.vocab / 1e9
    lines = []
    for name in PRODUCTS:
        cells = []
        for gemm in GEMMS:
            times = [r[name][gemm] for r in rounds if gemm in r[name]]
            ms = statistics.median(times) if times else None
            cells.append("-" if ms is None else f"{ms:.2f} ms, {tflop / ms:.0f}")
        lines.append(f"| {case.label} | {name} | {' | '.join(cells)} |")
    return lines


def gemm_times(case: Case, product: str, a: torch.Tensor, b: torch.Tensor, ws: Callable | None,
               quack: Callable | None) -> dict[str, float]:
    """Milliseconds of ``a @ b`` by cuBLAS, flce's ws GEMM and quack's GEMM, each where it runs."""
    times = {"cuBLAS": bench_ms(lambda: a @ b)}
    if ws is not None:
        times["ws"] = bench_ms(ws)
    if quack is not None:
        try:
            times["quack"] = bench_ms(lambda: quack(a, b))
        except Exception as exc:
            print(f"quack gemm {product} at {case.label} {failure(exc)}", file=sys.stderr)
    return times


def summary(measured: list[dict]) -> dict:
    """One table row from a method's rounds: median ms, the median and range of the per-round ratios to
    that round's floor, the median of the per-round ratios to that round's best-GEMM floor and the largest
    peak (an error in any round is the row's error)."""
    row = {"shape": measured[0]["shape"], "method": measured[0]["method"]}
    keys = (("", "floor_ms", "best_floor_ms"), ("fwd_", "fwd_floor_ms", "fwd_best_floor_ms"))
    for prefix, floor_key, best_key in keys:
        ms_key = "fwd_ms" if prefix else "fwd_bwd_ms"
        errors = [r[prefix + "error"] for r in measured if prefix + "error" in r]
        if errors:
            row[prefix + "error"] = errors[0]
            continue
        ratios = [r[ms_key] / r[floor_key] for r in measured]
        row[ms_key] = statistics.median(r[ms_key] for r in measured)
        row[prefix + "ratio"] = statistics.median(ratios)
        row[prefix + "ratio_range"] = (min(ratios), max(ratios))
        row[prefix + "best_ratio"] = statistics.median(r[ms_key] / r[best_key] for r in measured)
        row[prefix + "peak_mib"] = max(r[prefix + "peak_mib"] for r in measured)
    return row


def ratio_cell(row: dict, prefix: str) -> str:
    """``1.065x``, or over rounds that differ ``1.065x (1.058-1.071)``: the median and the range."""
    low, high = row[prefix + "ratio_range"]
    spread = f" ({low:.3f}-{high:.3f})" if high > low else ""
    return f"{row[prefix + 'ratio']:.3f}x{spread}"


def markdown(rows: list[dict], header: str, gemm_lines: list[str]) -> str:
    columns = ("| shape | method | fwd+bwd ms | x floor | x best floor | MiB above grads | fwd ms | fwd x 1 GEMM | "
               "fwd x best GEMM | fwd MiB |")
    lines = [header, "", columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            train = f"{r['error']} | | |"
        else:
            train = f"{r['fwd_bwd_ms']:.2f} | {ratio_cell(r, '')} | {r['best_ratio']:.3f}x | {r['peak_mib']:.0f}"
        if "fwd_error" in r:
            forward = f"{r['fwd_error']} | | |"
        else:
            forward = (f"{r['fwd_ms']:.2f} | {ratio_cell(r, 'fwd_')} | {r['fwd_best_ratio']:.3f}x | "
                       f"{r['fwd_peak_mib']:.0f}")
        lines.append(f"| {r['shape']} | {r['method']} | {train} | {forward} |")
    lines += ["", "Each product alone (median ms over the rounds, TFLOP/s); a round's best-GEMM floor sums the fastest "
              "per product:", "",
              "| shape | product | cuBLAS | flce warp-specialised GEMM | quack GEMM |", "|---|---|---|---|---|",
              *gemm_lines]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--methods", default=None, help="comma-separated method names, run in this order")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--json", default=None, help="also write the rows, with GPU, date, versions and command")
    parser.add_argument("--revision", default=None,
                        help="flce's revision for --json (default: the checkout's git commit, where it has .git)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each shape's floor and methods this many times, in turn; ratios are "
                             "reported as the median over rounds with their range")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected an int >= 1")
    device = "cuda"
    dtype = getattr(torch, args.dtype)
    methods = all_methods()
    if args.methods:
        wanted = args.methods.split(",")
        print(f"not available here: {[k for k in wanted if k not in methods]}", file=sys.stderr)
        methods = {k: methods[k] for k in wanted if k in methods}  # in the order asked
    rows, gemm_lines = [], []
    with ClockSampler(torch.device(device)) as clocks:
        for shape in args.shapes.split(","):
            shape_rows, lines = measure_shape(Case(*parse_shape(shape), dtype), methods, device, args.rounds)
            rows += shape_rows
            gemm_lines += lines
    gpu = torch.cuda.get_device_name()
    command = (f"python tools/benchmarks/peers.py --shapes {args.shapes}"
               f"{f' --methods {args.methods}' if args.methods else ''}"
               f"{f' --rounds {args.rounds}' if args.rounds > 1 else ''}")
    header = f"### {gpu}, {args.dtype}, {datetime.date.today()} — torch {torch.__version__}\n\nCommand: `{command}`"
    if clocks.summary is not None:
        header += f"\n\n{clocks.summary.describe()}."
        if clocks.summary.held_back:
            print(clocks.summary.describe(), file=sys.stderr)
    publish(markdown(rows, header, gemm_lines).rstrip("\n"), args.markdown)
    if args.json:
        revision = args.revision or flce_revision()
        with open(args.json, "w") as f:
            json.dump(run_record(rows, gpu, args.dtype, command, revision, clocks.summary,
                                 revision_committed(revision)), f, indent=1)


def measure_shape(case: Case, methods: dict, device: str, rounds_wanted: int) -> tuple[list[dict], list[str]]:
    """One shape: ``rounds_wanted`` rounds of the products by every GEMM (the best-GEMM floors), the cuBLAS floor
    and every method; the summary rows and the GEMM table's lines."""
    # Each round measures the floors and then every method, so a method's ratios are to the floors of its
    # own round (the GPU's clock under the power cap drifts over a run) and the methods alternate with each
    # other (compiling and tuning happen in round 1), every other round in the reverse order (round_order).
    rounds: dict[str, list[dict]] = {"3-GEMM floor": [], **{name: [] for name in methods}}
    times_per_round = []
    quack = quack_gemm()
    for number in range(rounds_wanted):
        x, w, g = floor_operands(case, device)
        times = product_times(case, x, w, g, quack)
        floor3, floor1 = floors(x, w, g)
        del x, w, g
        times_per_round.append(times)
        best3, best1 = best_floors(times)
        floors_now = {"floor_ms": floor3, "fwd_floor_ms": floor1, "best_floor_ms": best3, "fwd_best_floor_ms": best1}
        rounds["3-GEMM floor"].append({"shape": case.label, "method": "3-GEMM floor", "fwd_bwd_ms": floor3,
                                       "peak_mib": 0.0, "fwd_ms": floor1, "fwd_peak_mib": 0.0, **floors_now})
        gc.collect()
        torch.cuda.empty_cache()
        for name, method in round_order(methods.items(), number):
            start = time.perf_counter()
            row = measure(case, name, method, device)
            row["wall_s"] = round(time.perf_counter() - start, 1)  # compile and tuning included
            row.update(floors_now)
            rounds[name].append(row)
            print(json.dumps(row), flush=True)
    lines = product_lines(case, times_per_round)
    print("\n".join(lines), flush=True)
    return [summary(measured) for measured in rounds.values()], lines


def run_record(rows: list[dict], gpu: str, dtype: str, command: str, revision: str,
               clocks: ClockSummary | None = None, committed: str | None = None) -> dict:
    """The --json file: the rows with what a reader needs to trust them (GPU, date, versions, command, the
    GPU's clocks over the run where they were sampled, when flce's revision was committed where git knows it);
    tools/benchmarks/plot.py draws and tabulates it, tools/benchmarks/benchmarks_page.py publishes it."""
    versions = {"torch": torch.__version__}
    for package in ("triton", "liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"gpu": gpu, "date": str(datetime.date.today()), "dtype": dtype, "call": "fwd+bwd, mean loss",
            "versions": versions, "flce": revision, **({"flce_committed": committed} if committed else {}),
            "command": command,
            "clocks": dataclasses.asdict(clocks) if clocks is not None else None,
            "inputs": "flce.testing.measure.shape_inputs: logits of std 1, uniform targets, every 17th ignored",
            "floor": "cuBLAS x @ W.T, G @ W, G.T @ x; G from flce.testing.measure.floor_gradient: N(0, 1)",
            "rows": rows}


def flce_revision() -> str:
    """The checkout's commit ("+ local changes" where tracked files differ from it), else flce's version."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    git = ["git", "-C", root]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               check=True)
    except (OSError, subprocess.CalledProcessError):
        return f"flce {flce.__version__} (not a git checkout)"
    return commit.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")


def revision_committed(revision: str) -> str | None:
    """When ``revision`` (its first word: a commit) was committed, UTC, ISO 8601, where this checkout's git knows
    it, else None: docs/benchmarks.md shows the newest run of a day by it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        seconds = subprocess.run(["git", "-C", root, "log", "-1", "--format=%ct", revision.split()[0], "--"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        moment = datetime.datetime.fromtimestamp(int(seconds), datetime.timezone.utc)
    except (OSError, IndexError, ValueError, subprocess.CalledProcessError):
        return None
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    main()
