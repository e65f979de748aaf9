"""Linear distillation's energy beside its 4-GEMM floor's, one NVIDIA GPU, bf16, one process.

Under its power cap a GPU's sustained speed is its energy: a kernel that finishes in its own time still spends
joules the GEMMs around it then lack. Per shape (tokens x student H x teacher H x V), JSD beta 0.5 at the default
512 MiB, every workload alone, called back to back for a steady state and then for ``--seconds``: milliseconds and
millijoules a launch (NVML's energy counter, the board's), its mean watts, and the joules a call spends on it
(launches a call x mJ). Workloads: the whole floor and the whole flce call (forward and backward into the
student); the floor's four cuBLAS GEMMs; one chunk's parts as the call runs them (the explain's chunk rows): each
head's logits with both softmaxes' statistics in the warp-specialised GEMM's epilogue, the fused pair passes from
those statistics (the gradient written over the student's logits, which each launch restores first: a copy
measured alone and subtracted), and the student's two gradient products on cuBLAS (grad_weight accumulated, or
written by the first chunk). Every workload in every round; the rounds' medians. Then the call's time beyond the
floor part by part, and what the passes would take at the restore copy's rate reading each row twice or once.

    python tools/benchmarks/distill_energy.py --markdown out.md [--json out.json] [--rounds 2] [--seconds 2]
    python tools/benchmarks/distill_energy.py --from-json out.json    # a saved run's report again, no GPU
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch

import flce
from flce.testing.measure import floor_gradient, publish, shape_inputs

SHAPES = "8192x4096x4096x128256,8192x4096x8192x128256"


class Nvml:
    """The board's energy counter (millijoules since the driver loaded) through libnvidia-ml."""

    def __init__(self, index: int) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
            raise RuntimeError(f"no NVML handle for GPU {index}")

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) != 0:
            raise RuntimeError("this GPU has no energy counter")
        return value.value


def steady(fn: Callable[[], object], nvml: Nvml, seconds: float) -> dict[str, float]:
    """ms and mJ a launch of ``fn`` called back to back, after 0.7 s of the same to reach the capped clocks. The
    counts come from a first timing: a loop on the host's clock would queue far more GPU work than it times."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - start) / 3
    for _ in range(max(1, round(0.7 / estimate))):
        fn()
    torch.cuda.synchronize()
    calls = max(3, round(seconds / estimate))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before = nvml.energy_mj()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    spent_mj, ms = nvml.energy_mj() - before, begin.elapsed_time(end)
    if spent_mj <= 0:  # seen once in a second's window: the counter had not moved
        raise RuntimeError(f"NVML's energy counter did not advance over {ms:.0f} ms; lengthen --seconds")
    return {"ms": ms / calls, "mJ": spent_mj / calls, "W": spent_mj / ms}


RESTORE = "chunk: the restore alone (subtracted)"
PASSES = "chunk: pair passes (with the restore)"  # timed so; report() shows it less the restore


def launches_a_call(chunks: int) -> dict[str, int]:
    """How often a call runs each workload (the whole calls once; the restore copy is not the call's)."""
    return {
        "floor: the whole 4 GEMMs": 1,
        "flce: the whole call": 1,
        "floor: teacher logits": 1,
        "floor: student logits": 1,
        "floor: G @ W": 1,
        "floor: G.T @ x": 1,
        "chunk: teacher logits + statistics": chunks,
        "chunk: student logits + statistics": chunks,
        PASSES: chunks,
        RESTORE: 0,
        "chunk: G @ W": chunks,
        "chunk: grad_weight += G.T @ x": chunks - 1,
        "chunk: grad_weight = G.T @ x (the first)": 1,
    }


def workloads(shape: str) -> tuple[dict[str, Callable[[], object]], int]:
    """label (launches_a_call's): workload, and the chunk rows."""
    from flce.backends.cuda.configs import LaunchParams
    from flce.backends.cuda.distill_ops import pair_passes_
    from flce.backends.cuda.ws_gemm_ops import ws_partial_row_stats
    from flce.config import LCEConfig
    from flce.distillation.config import DistillationConfig
    from flce.distillation.semantics import pair_stats_of_heads

    tokens, student_h, teacher_h, vocab = (int(p) for p in shape.split("x"))
    xs, ws, target, _ = shape_inputs(tokens, student_h, vocab)
    xt, wt, _, _ = shape_inputs(tokens, teacher_h, vocab, seed=1, requires_grad=False)
    rows = flce.explain_distillation("cuda", shape=shape).plan.tokens_per_chunk
    g = floor_gradient(tokens, vocab, xs.dtype, xs.device)
    x_s, w_s = xs.detach(), ws.detach()
    cfg = DistillationConfig(loss="jsd", beta=0.5)
    teacher, student = (torch.empty(rows, vocab, dtype=xs.dtype, device=xs.device) for _ in range(2))
    head = LCEConfig()

    def logits_stats(hidden, weight, out):
        return ws_partial_row_stats(hidden[:rows], weight, target[:rows], 0, head, logits_out=out)

    known = pair_stats_of_heads(logits_stats(xt, wt, teacher), logits_stats(x_s, w_s, student), cfg)
    saved = student.clone()
    scale = torch.full((rows,), 1.0 / tokens, device=xs.device)
    grad_weight = torch.zeros_like(w_s)
    g_rows, x_rows = g[:rows], x_s[:rows]

    def call():
        loss = flce.linear_distillation_loss(xs, ws, xt, wt, target, loss="jsd", beta=0.5, backend="cuda")
        return torch.autograd.grad(loss, (xs, ws))

    def passes():
        student.copy_(saved)
        pair_passes_(teacher, student, None, cfg, scale, False, LaunchParams(block_v=4096, num_warps=8), None,
                     known, 64)

    work = {
        "floor: the whole 4 GEMMs": lambda: (xt @ wt.t(), x_s @ w_s.t(), g @ w_s, g.t() @ x_s),
        "flce: the whole call": call,
        "floor: teacher logits": lambda: xt @ wt.t(),
        "floor: student logits": lambda: x_s @ w_s.t(),
        "floor: G @ W": lambda: g @ w_s,
        "floor: G.T @ x": lambda: g.t() @ x_s,
        "chunk: teacher logits + statistics": lambda: logits_stats(xt, wt, teacher),
        "chunk: student logits + statistics": lambda: logits_stats(x_s, w_s, student),
        PASSES: passes,
        RESTORE: lambda: student.copy_(saved),
        "chunk: G @ W": lambda: g_rows @ w_s,
        "chunk: grad_weight += G.T @ x": lambda: grad_weight.addmm_(g_rows.t(), x_rows),
        "chunk: grad_weight = G.T @ x (the first)": lambda: g_rows.t() @ x_rows,
    }
    return work, rows


def medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each workload's median over the rounds, the passes less the restore copy they each began with."""
    med = {label: {k: statistics.median(r[k] for r in runs) for k in ("ms", "mJ", "W")}
           for label, runs in rounds.items()}
    restore, passes = med[RESTORE], med[PASSES]
    med[PASSES] = {"ms": passes["ms"] - restore["ms"], "mJ": passes["mJ"] - restore["mJ"], "W": passes["W"]}
    return med


def ledger(shape: str, rows: int, med: dict[str, dict[str, float]]) -> dict[str, float]:
    """The call's ms beyond the floor, part by part (each chunk part's launches less the floor's product it
    stands for), and what the passes would take at the restore copy's rate: 10 bytes a column (both rows read
    twice, the gradient written) and 6 (each read once)."""
    tokens, _, _, vocab = (int(p) for p in shape.split("x"))
    chunks = -(-tokens // rows)
    ms = {label: m["ms"] for label, m in med.items()}
    floor, call = ms["floor: the whole 4 GEMMs"], ms["flce: the whole call"]
    parts = {
        "logits": chunks * (ms["chunk: teacher logits + statistics"] + ms["chunk: student logits + statistics"])
        - ms["floor: teacher logits"] - ms["floor: student logits"],
        "grad_weight": (chunks - 1) * ms["chunk: grad_weight += G.T @ x"]
        + ms["chunk: grad_weight = G.T @ x (the first)"] - ms["floor: G.T @ x"],
        "grad_hidden": chunks * ms["chunk: G @ W"] - ms["floor: G @ W"],
        "passes": chunks * ms[PASSES],
    }
    parts["rest"] = call - floor - sum(parts.values())
    copy_bytes_per_ms = 2 * rows * vocab * 2 / ms[RESTORE]  # the restore reads and writes one [rows, V] bf16
    chunk_columns = rows * vocab
    without_passes = call - floor - parts["passes"]
    return {"floor_ms": floor, "call_ms": call, "ratio": call / floor, **parts,
            "without_passes": 1 + without_passes / floor,
            "two_reads_at_copy_rate": 1 + (without_passes + chunks * 10 * chunk_columns / copy_bytes_per_ms) / floor,
            "one_read_at_copy_rate": 1 + (without_passes + chunks * 6 * chunk_columns / copy_bytes_per_ms) / floor,
            "one_read_no_rest": 1 + (without_passes - parts["rest"] + chunks * 6 * chunk_columns / copy_bytes_per_ms)
            / floor,
            "copy_tb_s": copy_bytes_per_ms / 1e9}


def report(shape: str, rows: int, rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    """One shape's table, the parts' joules a call against the whole calls', and the ledger."""
    tokens = int(shape.split("x")[0])
    launches = launches_a_call(-(-tokens // rows))
    med = medians(rounds)
    lines = ["", f"#### {shape} ({rows}-row chunks)", "",
             "| workload | ms a launch | mJ a launch | W | launches a call | J a call |", "|---|---|---|---|---|---|"]
    for label, m in med.items():
        if label != RESTORE:
            shown = label.replace("(with the restore)", "(less the restore)")
            lines.append(f"| {shown} | {m['ms']:.3f} | {m['mJ']:.0f} | {m['W']:.0f} | {launches[label]} | "
                         f"{launches[label] * m['mJ'] / 1e3:.2f} |")
    floor_parts, chunk_parts = (sum(m["mJ"] * launches[label] for label, m in med.items()
                                    if label.startswith(prefix) and "whole" not in label) / 1e3
                                for prefix in ("floor: ", "chunk: "))
    floor, call = med["floor: the whole 4 GEMMs"], med["flce: the whole call"]
    t = ledger(shape, rows, med)
    lines += ["", f"Parts alone, J a call: the floor's {floor_parts:.2f}, flce's chunks {chunk_parts:.2f}; "
              f"the whole calls {floor['mJ'] / 1e3:.2f} and {call['mJ'] / 1e3:.2f} "
              f"(flce x {t['ratio']:.3f} the floor in time, x {call['mJ'] / floor['mJ']:.3f} in energy).", "",
              f"ms beyond the floor ({t['floor_ms']:.2f} ms; the call {t['call_ms']:.2f}): the logits GEMMs "
              f"{t['logits']:+.2f}, grad_weight {t['grad_weight']:+.2f}, grad_hidden {t['grad_hidden']:+.2f}, the "
              f"passes {t['passes']:.2f}, the rest (small kernels, gaps) {t['rest']:+.2f}. Without the passes "
              f"x {t['without_passes']:.3f}; with passes at the restore copy's {t['copy_tb_s']:.2f} TB/s, "
              f"10 bytes a column x {t['two_reads_at_copy_rate']:.3f}, 6 bytes x {t['one_read_at_copy_rate']:.3f} "
              f"(x {t['one_read_no_rest']:.3f} without the rest)."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-json", default=None, help="print the report of a saved --json run (no GPU)")
    args = parser.parse_args()
    if args.seconds < 1.0:
        # NVML's counter moves in coarse steps: half-second windows read a whole call at 420 W on an H200 (700 W cap).
        parser.error("--seconds: at least 1 (NVML's energy counter is too coarse for shorter windows)")
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        lines = [f"### {saved['gpu']}, from {args.from_json}"]
        for shape, run in saved["shapes"].items():
            lines += report(shape, run["chunk_rows"], run["rounds"])
        publish("\n".join(lines), args.markdown)
        return 0
    nvml = Nvml(torch.cuda.current_device())
    lines = [f"### {torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, JSD beta 0.5, "
             f"bf16, the default budget, {args.rounds} rounds of {args.seconds:g} s a workload"]
    data = {}
    for shape in args.shapes.split(","):
        work, rows = workloads(shape)
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in work}
        for _ in range(args.rounds):
            for label, fn in work.items():
                rounds[label].append(steady(fn, nvml, args.seconds))
                print(shape, label, {k: round(v, 3) for k, v in rounds[label][-1].items()}, flush=True)
        lines += report(shape, rows, rounds)
        data[shape] = {"chunk_rows": rows, "rounds": rounds}
        del work
        torch.cuda.empty_cache()
    publish("\n".join(lines), args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shapes": data}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
