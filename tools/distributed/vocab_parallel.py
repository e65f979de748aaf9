"""Vocab-parallel flce on several GPUs: correctness against the unsharded op, then TP=2 vs TP=1 time.

    torchrun --nproc-per-node 2 tools/distributed/vocab_parallel.py         # NCCL, 16384 x 4096 x 128256
    torchrun --nproc-per-node 2 tools/distributed/vocab_parallel.py --device cpu --tokens 512 --hidden 64 \
        --vocab 4000                                                        # gloo smoke run on a CPU

1. Checks (small shapes, uneven shards, fp32 and bf16, plain and full options, every reduction,
   random upstream gradients): on every rank, the sharded outputs, grad_hidden and this rank's
   slice of grad_weight/grad_bias against the unsharded flce op on the same device, and the loss
   and grad_hidden against float64 materialised logits. Then at the benchmark shape, TP=2 against
   TP=1 on the same inputs.
2. Timing at the benchmark shape (default 16384x4096x128256 bf16, mean reduction), forward +
   backward per rank, median of --iters after --warmup, ranks aligned by a barrier before each
   step: TP=1 (every rank runs the whole vocabulary, no communication) and TP=2 (half each).
   Communication is reported separately, two ways: the collectives of one step replayed alone
   (same sizes, dtypes and ops, timed the same way) and the device time of the NCCL kernels inside
   a profiled step (this one includes waiting for the slower rank). Bytes per step are recorded
   and compared with flce.distributed.payload_bytes_per_step.

Inputs are flce.testing.measure's draw for the shape (the same as every tool's), broadcast from rank 0;
the timer stays this script's own: every step starts with the ranks aligned by a barrier.
Rank 0 prints a summary and writes vocab_parallel.json and vocab_parallel.md to --out (default: $OUT, if set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flce
from flce.config import LCEConfig
from flce.distributed import payload_bytes_per_step, record_collectives
from flce.registry import candidates_for
from flce.testing.measure import MiB, publish, shape_inputs

COMM_PROFILE_KEY = "collective time in one profiled step, ms (NCCL kernels on GPUs, gloo ops on CPUs)"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CHECK_OPTION_SETS: dict[str, dict[str, Any]] = {
    "plain/mean": dict(reduction="mean"),
    "plain/sum+bias": dict(reduction="sum"),
    "full/none": dict(reduction="none", label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0,
                      temperature=0.8, return_z_loss=True, return_token_accuracy=True,
                      return_predicted_tokens=True, return_logprobs=True, return_entropy=True),
    "smoothing+metrics/mean": dict(reduction="mean", label_smoothing=0.2, return_token_accuracy=True,
                                   return_predicted_tokens=True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", default=None, help="flce backend (default: the registry's choice)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for vocab_parallel.json / .md")
    return p.parse_args()


# --------------------------------------------------------------------------- setup and timing

def setup(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each call after warm-up; every call starts with all ranks aligned."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        dist.barrier()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def gather_floats(value: float, device: torch.device) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [float(p) for p in parts]


def shard_sizes(vocab: int, world: int, uneven: bool) -> list[int]:
    if not uneven:
        base = [vocab // world] * world
        base[-1] += vocab - sum(base)
        return base
    # Uneven on purpose: the first shard a third smaller than the others.
    first = vocab // world - vocab // (3 * world)
    rest = vocab - first
    sizes = [first] + [rest // (world - 1)] * (world - 1)
    sizes[-1] += vocab - sum(sizes)
    return sizes


def shard_slice(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def random_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int,
                  bias: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same inputs on every rank: drawn on rank 0 and broadcast."""
    x, w, t, g = shape_inputs(tokens, hidden, vocab, device, dtype, seed=seed, requires_grad=False)
    b = (torch.randn(vocab, device=device, generator=g) * 0.5).to(dtype) if bias else None
    for tensor in (x, w, t, b):
        if tensor is not None:
            dist.broadcast(tensor, src=0)
    return x, w, t, b


# --------------------------------------------------------------------------- correctness

def run(fn: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None,
        upstream: dict[str, torch.Tensor]) -> tuple[flce.LCEOutput, dict[str, torch.Tensor]]:
    leaves = {"hidden": x.detach().clone().requires_grad_(), "weight": w.detach().clone().requires_grad_()}
    if b is not None:
        leaves["bias"] = b.detach().clone().requires_grad_()
    out = fn(leaves["hidden"], leaves["weight"], t, leaves.get("bias"))
    out = out if isinstance(out, flce.LCEOutput) else flce.LCEOutput(loss=out)
    total = (out.loss.double() * upstream["loss"]).sum()
    if out.logprobs is not None:
        total = total + (out.logprobs.double() * upstream["logprobs"]).sum()
    if out.entropy is not None:
        total = total + (out.entropy.double() * upstream["entropy"]).sum()
    total.backward()
    return out, {name: leaf.grad for name, leaf in leaves.items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.norm()
    return float((a - b).norm() / scale) if scale > 0 else float((a - b).norm())


def materialised_loss_and_grad(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None,
                               g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain mean cross-entropy in float64 and its grad_hidden (upstream g)."""
    x64 = x.detach().double().requires_grad_()
    logits = x64 @ w.detach().double().t()
    if b is not None:
        logits = logits + b.detach().double()
    loss = F.cross_entropy(logits, t, ignore_index=-100)
    (loss * g).backward()
    return loss.detach(), x64.grad


def correctness_checks(device: torch.device, backend: str | None) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    tokens, hidden, vocab = 257, 64, 3001
    sizes = shard_sizes(vocab, world, uneven=True)
    rows = shard_slice(sizes, rank)
    for dtype in (torch.float32, torch.bfloat16):
        for name, options in CHECK_OPTION_SETS.items():
            bias = "bias" in name
            seed = zlib.crc32(f"{name}/{dtype}".encode())  # the same on every rank, unlike hash()
            x, w, t, b = random_inputs(tokens, hidden, vocab, dtype, device, seed, bias=bias)
            g = torch.Generator(device=device).manual_seed(seed + 1)
            shape = (tokens,) if options["reduction"] == "none" else ()
            upstream = {k: torch.rand(s, device=device, generator=g, dtype=torch.float64) + 0.5
                        for k, s in (("loss", shape), ("logprobs", (tokens,)), ("entropy", (tokens,)))}
            impl = flce.get_impl(device, backend=backend)
            sharded = impl(process_group=dist.group.WORLD, **options)
            unsharded = impl(**options)
            got, got_grads = run(sharded, x, w[rows], t, None if b is None else b[rows], upstream)
            want, want_grads = run(unsharded, x, w, t, b, upstream)
            errors: dict[str, float] = {}
            for field in flce.LCEOutput._fields:
                a, e = getattr(got, field), getattr(want, field)
                if a is None:
                    continue
                if field == "predicted_tokens":
                    errors[field] = float((a != e).float().mean())
                else:
                    errors[field] = relative_error(a, e)
            errors["grad_hidden"] = relative_error(got_grads["hidden"], want_grads["hidden"])
            errors["grad_weight shard"] = relative_error(got_grads["weight"], want_grads["weight"][rows])
            if b is not None:
                errors["grad_bias shard"] = relative_error(got_grads["bias"], want_grads["bias"][rows])
            if name == "plain/mean":
                loss64, grad64 = materialised_loss_and_grad(x, w, t, b, upstream["loss"])
                errors["loss vs float64"] = relative_error(got.loss, loss64)
                errors["grad_hidden vs float64"] = relative_error(got_grads["hidden"], grad64)
            limit = 1e-5 if dtype == torch.float32 else 2e-2
            # A near-tie may flip an argmax between differently shaped GEMMs: one token in fp32, 1% in bf16.
            argmax_limit = 1.0 / tokens if dtype == torch.float32 else 0.01
            ok = all(v <= (argmax_limit if k == "predicted_tokens" else limit) for k, v in errors.items())
            results.append({"case": f"{name} {str(dtype).removeprefix('torch.')} shards={sizes}", "ok": ok,
                            "worst": max(errors.values()), "errors": errors})
    return results


# --------------------------------------------------------------------------- the benchmark

def benchmark(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    x, w, t, _ = random_inputs(args.tokens, args.hidden, args.vocab, dtype, device, seed=1234)
    sizes = shard_sizes(args.vocab, world, uneven=False)
    rows = shard_slice(sizes, rank)
    w_shard = w[rows].detach().clone()
    impl = flce.get_impl(device, backend=args.backend)
    tp1, tp1_full, tp2 = impl(), flce.get_impl(device, backend=args.backend, variant="full")(), \
        impl(process_group=dist.group.WORLD)

    x_leaf = x.detach().clone().requires_grad_()
    w_full_leaf = w.detach().clone().requires_grad_()
    w_shard_leaf = w_shard.requires_grad_()

    def step(loss_fn: torch.nn.Module, weight: torch.Tensor) -> Callable[[], None]:
        def go() -> None:
            x_leaf.grad, weight.grad = None, None
            loss_fn(x_leaf, weight, t).backward()
        return go

    def floor(weight: torch.Tensor) -> Callable[[], None]:
        """The three GEMMs of a forward + backward (logits, grad_hidden, grad_weight), nothing else."""
        weight, hidden = weight.detach(), x.detach()
        grad_logits = torch.empty(args.tokens, weight.shape[0], device=device, dtype=dtype)

        def go() -> None:
            torch.mm(hidden, weight.t(), out=grad_logits)
            torch.mm(grad_logits, weight)
            torch.mm(grad_logits.t(), hidden)
        return go

    result: dict[str, Any] = {}
    # Same inputs, TP=2 vs TP=1: the big-shape correctness check.
    loss1 = tp1(x_leaf, w_full_leaf, t)
    loss1.backward()
    g_hidden1, g_weight1 = x_leaf.grad.clone(), w_full_leaf.grad[rows].clone()
    x_leaf.grad = None
    with record_collectives() as records:
        loss2 = tp2(x_leaf, w_shard_leaf, t)
        loss2.backward()
    result["check at benchmark shape"] = {
        "loss TP=1": float(loss1), "loss TP=2": float(loss2),
        "loss relative difference": abs(float(loss2) - float(loss1)) / abs(float(loss1)),
        "grad_hidden relative error": relative_error(x_leaf.grad, g_hidden1),
        "grad_weight shard relative error": relative_error(w_shard_leaf.grad, g_weight1),
    }
    del g_hidden1, g_weight1
    collectives = [r for r in records if r.kind != "all_gather"]  # the layout exchange is first-call only
    measured_bytes = sum(r.bytes for r in collectives)
    formula_bytes = payload_bytes_per_step(LCEConfig(), args.tokens, args.hidden, dtype)
    result["communication"] = {
        "collectives per step": len(collectives),
        "payload bytes per step (measured)": measured_bytes,
        "payload bytes per step (formula)": formula_bytes,
        "of which grad_hidden all-reduce": args.tokens * args.hidden * x.element_size(),
        "wire bytes per rank (ring all-reduce, 2(p-1)/p x payload)": int(measured_bytes * 2 * (world - 1) / world),
        "by kind": _by_kind(collectives),
    }

    times = {
        "TP=1 (whole vocabulary, auto variant)": timed(step(tp1, w_full_leaf), device, args.warmup, args.iters),
        "TP=1 (whole vocabulary, full variant)": timed(step(tp1_full, w_full_leaf), device, args.warmup, args.iters),
        f"TP={world} (vocab shard, full variant + collectives)": timed(step(tp2, w_shard_leaf), device,
                                                                      args.warmup, args.iters),
        "3-GEMM floor, whole vocabulary": timed(floor(w), device, args.warmup, args.iters),
        "3-GEMM floor, vocab shard": timed(floor(w_shard), device, args.warmup, args.iters),
    }

    def replay() -> None:
        for r in collectives:
            buffer = torch.ones(r.numel, dtype=r.dtype, device=device)
            dist.all_reduce(buffer, op=getattr(dist.ReduceOp, r.kind[len("all_reduce("):-1]))

    times[f"collectives of one TP={world} step, replayed alone"] = timed(replay, device, args.warmup, args.iters)
    medians = {name: statistics.median(v) for name, v in times.items()}
    per_rank = {name: gather_floats(m, device) for name, m in medians.items()}
    result["median ms per rank"] = per_rank
    result["communication"][COMM_PROFILE_KEY] = \
        gather_floats(_profiled_comm_ms(step(tp2, w_shard_leaf), device), device)
    t1 = max(per_rank["TP=1 (whole vocabulary, auto variant)"])
    t2 = max(per_rank[f"TP={world} (vocab shard, full variant + collectives)"])
    result["TP ratio (slowest rank TP=2 / slowest rank TP=1)"] = t2 / t1
    peak = torch.cuda.max_memory_allocated(device) / MiB if device.type == "cuda" else None
    result["peak MiB (whole run, this rank)"] = gather_floats(peak or 0.0, device)
    return result


def _by_kind(records: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        entry = out.setdefault(f"{r.kind} {str(r.dtype).removeprefix('torch.')}", {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += r.bytes
    return out


def _profiled_comm_ms(fn: Callable[[], None], device: torch.device) -> float:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        synchronize(device)
    total_us = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        if device.type == "cuda" and "nccl" in name and "kernel" in name:
            total_us += getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
        elif device.type == "cpu" and name.startswith("gloo:"):
            total_us += event.cpu_time_total
    return total_us / 1e3


# --------------------------------------------------------------------------- report

def markdown(summary: dict[str, Any]) -> str:
    bench = summary["benchmark"]
    lines = [f"### Vocab-parallel flce, {summary['shape']} {summary['dtype']}, {summary['world_size']} x "
             f"{summary['device']} (backend {summary['backend']}, git {summary['git']})", "",
             "| what | median ms per rank |", "|---|---|"]
    for name, values in bench["median ms per rank"].items():
        lines.append(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} |")
    comm = bench["communication"]
    big = bench["check at benchmark shape"]
    checks = summary["checks"]
    failed = [f"{c['case']} (rank {c['rank']}, worst {c['worst']:.2e})" for c in checks if not c["ok"]]
    lines += [
        "", f"TP ratio (slowest rank): **{bench['TP ratio (slowest rank TP=2 / slowest rank TP=1)']:.3f}** "
        "(target <= 0.6)", "",
        f"Communication per step: {comm['collectives per step']} collectives, "
        f"{comm['payload bytes per step (measured)']:,} payload bytes measured "
        f"(formula {comm['payload bytes per step (formula)']:,}, of which grad_hidden "
        f"{comm['of which grad_hidden all-reduce']:,}); collective time in a profiled step "
        f"{' / '.join(f'{v:.2f}' for v in comm[COMM_PROFILE_KEY])} ms.", "",
        f"TP=2 vs TP=1 at this shape: loss relative difference {big['loss relative difference']:.2e}, "
        f"grad_hidden {big['grad_hidden relative error']:.2e}, grad_weight shard "
        f"{big['grad_weight shard relative error']:.2e} (relative norms).", "",
        f"Correctness checks: {len(checks) - len(failed)}/{len(checks)} ok"
        + (": FAILED " + "; ".join(failed) if failed else "."),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("vocab_parallel.py needs at least 2 ranks: "
              "torchrun --nproc-per-node 2 tools/distributed/vocab_parallel.py", file=sys.stderr)
        return 2
    checks = [] if args.skip_checks else correctness_checks(device, args.backend)
    all_checks = [None] * world
    dist.all_gather_object(all_checks, checks)
    flat_checks = [dict(c, rank=r) for r, cs in enumerate(all_checks) for c in cs]
    bench = benchmark(args, device)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world,
        "backend": candidates_for(device.type, args.backend).backends[0].name,
        "torch": torch.__version__,
        "flce": flce.__version__,
        "git": _git_revision(),
        "shape": f"{args.tokens}x{args.hidden}x{args.vocab}",
        "dtype": args.dtype,
        "iters": args.iters,
        "checks": flat_checks,
        "benchmark": bench,
    }
    failed = [c for c in flat_checks if not c["ok"]]
    if rank == 0:
        print(json.dumps(summary, indent=2))
        out = Path(args.out) if args.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "vocab_parallel.json").write_text(json.dumps(summary, indent=2))
        publish(markdown(summary).rstrip("\n"), str(out / "vocab_parallel.md") if out is not None else None)
        if failed:
            print(f"{len(failed)} correctness checks FAILED", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
