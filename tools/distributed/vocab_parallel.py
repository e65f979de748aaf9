"""Vocab-parallel flce on several GPUs: correctness against the unsharded op, then TP = 1, 2, 4 ... time and memory.

    torchrun --nproc-per-node 4 tools/distributed/vocab_parallel.py        # NCCL, the two default shapes, TP 1/2/4
    torchrun --nproc-per-node 2 tools/distributed/vocab_parallel.py --device cpu --shapes 512x64x4000:even \
        --iters 2 --warmup 1                                               # gloo smoke run on a CPU

1. Checks (small shapes, uneven shards, fp32 and bf16, plain and full options, every reduction,
   random upstream gradients) over all ranks: on every rank, the sharded outputs, grad_hidden and
   this rank's slice of grad_weight/grad_bias against the unsharded flce op on the same device, and
   the loss and grad_hidden against float64 materialised logits. Then tokens sharded across all
   ranks with the whole weight on each (flce.distributed.token_sharded_mean) against the unsharded
   mean over all tokens.
2. Per shape of ``--shapes`` (``TOKENSxHIDDENxVOCAB:even`` or ``:uneven``; default the two
   16384x4096x128256 with even shards and 16384x4096x151936 with uneven ones: every shard a whole
   number of 128-row tiles, the last one shorter) and per TP size of ``--tp`` (default 1, 2, 4 ... up
   to the world size; for TP < world the ranks form world / TP groups that run side by side, as
   data-parallel replicas do): TP=t against TP=1 on the same inputs (loss, grad_hidden, grad_weight
   shard), then forward + backward per rank, median of --iters after --warmup, ranks aligned by a
   barrier before each step, with its peak memory above the step's start (the gradients it returns
   included) and beside it the 3-GEMM floor on the shard and, at TP >= 2 where megatron-core
   imports, Megatron's own head + vocab_parallel_cross_entropy (tools/distributed/megatron_peer.py:
   materialised logits, Megatron's vocabulary padding). Communication per TP >= 2: the bytes of one
   step against flce.distributed.payload_bytes_per_step, and the NCCL kernels' time in a profiled step.

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
from flce.distributed import payload_bytes_per_step, record_collectives, token_sharded_mean
from flce.registry import candidates_for
from flce.testing.measure import MiB, parse_shape, publish, shape_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling megatron_peer.py, however this is run
import megatron_peer

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
    p.add_argument("--shapes", default="16384x4096x128256:even,16384x4096x151936:uneven",
                   help="comma-separated TOKENSxHIDDENxVOCAB:even|uneven")
    p.add_argument("--tp", default=None, help="comma-separated TP sizes (default: 1, 2, 4 ... up to the world size)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", default=None, help="flce backend (default: the registry's choice)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--no-peer", action="store_true", help="skip Megatron's vocab-parallel cross-entropy")
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
    """The correctness checks' layouts: equal shards, or (uneven) the first a third smaller than the others."""
    if not uneven:
        base = [vocab // world] * world
        base[-1] += vocab - sum(base)
        return base
    first = vocab // world - vocab // (3 * world)
    rest = vocab - first
    sizes = [first] + [rest // (world - 1)] * (world - 1)
    sizes[-1] += vocab - sum(sizes)
    return sizes


TILE_ROWS = 128


def benchmark_shard_sizes(vocab: int, tp: int, layout: str) -> list[int]:
    """The benchmark's layouts: "even" (equal shards, the last taking the remainder) or "uneven" (every
    shard a whole number of TILE_ROWS-row tiles, ceil(V / tp) rounded up to them, the last one shorter)."""
    if layout == "even" or tp == 1:
        return shard_sizes(vocab, tp, uneven=False)
    size = -(-vocab // (tp * TILE_ROWS)) * TILE_ROWS
    sizes = [size] * (tp - 1) + [vocab - size * (tp - 1)]
    if sizes[-1] <= 0:
        raise ValueError(f"vocab={vocab}: too small for {tp} shards of whole {TILE_ROWS}-row tiles")
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


def token_sharded_check(device: torch.device, backend: str | None) -> list[dict[str, Any]]:
    """Tokens split unevenly across all ranks, the whole weight on each: token_sharded_mean of each rank's
    summed loss against the unsharded flce mean over every token, on this rank's device; grad_hidden
    rows and the weight gradients summed over the ranks against the unsharded ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [1024 + 512 * r for r in range(world)]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w, t, _ = random_inputs(sum(counts), 256, 8000, dtype, device, seed=99)
        impl = flce.get_impl(device, backend=backend)
        _, want = run(impl(), x, w, t, None, {"loss": torch.ones((), device=device, dtype=torch.float64)})
        want_loss = impl()(x, w, t)
        h = x[mine].detach().clone().requires_grad_()
        wl = w.detach().clone().requires_grad_()
        loss = token_sharded_mean(impl(reduction="sum")(h, wl, t[mine]), t[mine], dist.group.WORLD,
                                  gradient_reduction="sum")
        loss.backward()
        grad_weight = wl.grad.float()
        dist.all_reduce(grad_weight)
        errors = {"loss": relative_error(loss.detach(), want_loss.detach()),
                  "grad_hidden rows": relative_error(h.grad, want["hidden"][mine]),
                  "grad_weight (summed over ranks)": relative_error(grad_weight, want["weight"])}
        limit = 1e-5 if dtype == torch.float32 else 2e-2
        results.append({"case": f"token-sharded {str(dtype).removeprefix('torch.')} tokens={counts}",
                        "ok": all(v <= limit for v in errors.values()), "worst": max(errors.values()),
                        "errors": errors})
    return results


# --------------------------------------------------------------------------- the benchmark

def tp_groups(sizes: list[int]) -> dict[int, tuple[Any, int]]:
    """TP size -> (the group of this rank, its rank there); None for TP=1. Every rank makes every group."""
    world = dist.get_world_size()
    groups: dict[int, tuple[Any, int]] = {}
    for tp in sizes:
        if tp == 1:
            groups[tp] = (None, 0)
        elif tp == world:
            groups[tp] = (dist.group.WORLD, dist.get_rank())
        else:
            group, _ = dist.new_subgroups(group_size=tp)
            groups[tp] = (group, dist.get_rank(group))
    return groups


def measured(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> dict[str, list[float]]:
    """Median ms of each rank (ranks aligned before every call), and the peak MiB of one more call above
    what was allocated before it (the gradients it leaves included)."""
    median = statistics.median(timed(fn, device, warmup, iters))
    peak = 0.0
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / MiB
    return {"median ms per rank": gather_floats(median, device), "peak MiB per rank": gather_floats(peak, device)}


def floor_step(hidden: torch.Tensor, weight: torch.Tensor) -> Callable[[], None]:
    """The three GEMMs of a forward + backward (logits, grad_hidden, grad_weight), nothing else."""
    weight, hidden = weight.detach(), hidden.detach()
    grad_logits = torch.empty(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)

    def go() -> None:
        torch.mm(hidden, weight.t(), out=grad_logits)
        torch.mm(grad_logits, weight)
        torch.mm(grad_logits.t(), hidden)
    return go


def flce_step(loss_fn: torch.nn.Module, hidden: torch.Tensor, weight: torch.Tensor,
              target: torch.Tensor) -> Callable[[], None]:
    def go() -> None:
        hidden.grad, weight.grad = None, None
        loss_fn(hidden, weight, target).backward()
    return go


def megatron_shard(weight: torch.Tensor, vocab: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of Megatron's padded vocabulary: the real rows, then random padding rows."""
    padded = megatron_peer.padded_vocab(vocab, tp)
    size = padded // tp
    start = rank * size
    shard = torch.randn(size, weight.shape[1], device=weight.device, dtype=weight.dtype) * weight.shape[1] ** -0.5
    real = weight[start:min(start + size, vocab)]
    shard[: real.shape[0]] = real
    return shard


def benchmark_shape(args: argparse.Namespace, label: str, groups: dict[int, tuple[Any, int]],
                    device: torch.device) -> dict[str, Any]:
    shape, _, layout = label.partition(":")
    layout = layout or "even"
    tokens, hidden, vocab = parse_shape(shape)
    dtype = DTYPES[args.dtype]
    x, w, t, _ = random_inputs(tokens, hidden, vocab, dtype, device, seed=1234)
    impl = flce.get_impl(device, backend=args.backend)
    x_leaf = x.detach().clone().requires_grad_()
    w_full = w.detach().clone().requires_grad_()
    loss1 = impl()(x_leaf, w_full, t)
    loss1.backward()
    g_hidden1, g_weight1 = x_leaf.grad.clone(), w_full.grad.clone()
    peer_ok, peer_why = megatron_peer.available() if not args.no_peer else (False, "--no-peer")
    per_tp: dict[str, Any] = {}
    for tp, (group, group_rank) in groups.items():
        sizes = benchmark_shard_sizes(vocab, tp, layout)
        rows = shard_slice(sizes, group_rank)
        entry: dict[str, Any] = {"shard sizes": sizes}
        if tp == 1:
            loss_fn, weight = impl(), w_full
        else:
            loss_fn = impl(process_group=group)
            weight = w[rows].detach().clone().requires_grad_()
            x_leaf.grad = None
            with record_collectives() as records:
                loss = loss_fn(x_leaf, weight, t)
                loss.backward()
            entry["check vs TP=1"] = {
                "loss relative difference": abs(float(loss) - float(loss1)) / abs(float(loss1)),
                "grad_hidden relative error": relative_error(x_leaf.grad, g_hidden1),
                "grad_weight shard relative error": relative_error(weight.grad, g_weight1[rows]),
            }
            collectives = [r for r in records if r.kind != "all_gather"]  # the layout exchange is first-call only
            entry["communication"] = {
                "payload bytes per step (measured)": sum(r.bytes for r in collectives),
                "payload bytes per step (formula)": payload_bytes_per_step(LCEConfig(), tokens, hidden, dtype),
                "by kind": _by_kind(collectives),
                COMM_PROFILE_KEY: gather_floats(_profiled_comm_ms(flce_step(loss_fn, x_leaf, weight, t), device),
                                                device),
            }
        entry["flce"] = measured(flce_step(loss_fn, x_leaf, weight, t), device, args.warmup, args.iters)
        entry["3-GEMM floor"] = measured(floor_step(x, weight), device, args.warmup, args.iters)
        if tp > 1 and peer_ok:
            shard = megatron_shard(w, vocab, tp, group_rank)
            entry["megatron"] = measured(megatron_peer.step(x, shard, t, -100, group), device, args.warmup, args.iters)
            entry["megatron"]["padded vocab"] = megatron_peer.padded_vocab(vocab, tp)
            del shard
        if tp > 1:
            del weight
        per_tp[str(tp)] = entry
    base = max(per_tp["1"]["flce"]["median ms per rank"]) if "1" in per_tp else None
    for entry in per_tp.values():
        slowest = max(entry["flce"]["median ms per rank"])
        entry["flce slowest rank ms"] = slowest
        entry["fraction of TP=1"] = None if base is None else slowest / base
        entry["flce / 3-GEMM floor"] = slowest / max(entry["3-GEMM floor"]["median ms per rank"])
    return {"shape": shape, "layout": layout, "dtype": args.dtype, "megatron peer": peer_why, "per TP": per_tp}


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

TARGETS = {2: 0.52, 4: 0.27}  # the scaling targets, as a fraction of TP=1


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"### Vocab-parallel flce, {summary['world_size']} x {summary['device']}, {summary['dtype']} "
             f"(backend {summary['backend']}, torch {summary['torch']}, git {summary['git']}, {summary['date']})"]
    for bench in summary["benchmarks"]:
        lines += ["", f"**{bench['shape']}, {bench['layout']} shards** (Megatron peer: {bench['megatron peer']})", "",
                  "| TP | shard rows | flce ms (slowest rank) | x TP=1 (target) | flce / 3-GEMM floor | "
                  "flce peak MiB / GPU | Megatron ms | Megatron peak MiB / GPU | vs TP=1: loss, grad_hidden, "
                  "grad_weight |", "|---|---|---|---|---|---|---|---|---|"]
        for tp, entry in bench["per TP"].items():
            fraction = entry["fraction of TP=1"]
            target = TARGETS.get(int(tp))
            frac = "" if fraction is None else f"{fraction:.3f}" + (f" (<= {target})" if target else "")
            peer = entry.get("megatron")
            peer_ms = f"{max(peer['median ms per rank']):.2f}" if peer else ""
            peer_mib = f"{max(peer['peak MiB per rank']):.0f}" if peer else ""
            check = entry.get("check vs TP=1")
            check_text = "" if check is None else ", ".join(f"{v:.1e}" for v in check.values())
            sizes = entry["shard sizes"]
            rows = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(str(v) for v in sizes)
            lines.append(f"| {tp} | {rows} | {entry['flce slowest rank ms']:.2f} | {frac} | "
                         f"{entry['flce / 3-GEMM floor']:.3f} | {max(entry['flce']['peak MiB per rank']):.0f} | "
                         f"{peer_ms} | {peer_mib} | {check_text} |")
        for tp, entry in bench["per TP"].items():
            comm = entry.get("communication")
            if comm:
                lines.append(f"\nTP={tp}: {comm['payload bytes per step (measured)']:,} payload bytes a step "
                             f"(formula {comm['payload bytes per step (formula)']:,}); NCCL kernels in a profiled "
                             f"step {' / '.join(f'{v:.2f}' for v in comm[COMM_PROFILE_KEY])} ms per rank.")
    checks = summary["checks"]
    failed = [f"{c['case']} (rank {c['rank']}, worst {c['worst']:.2e})" for c in checks if not c["ok"]]
    lines += ["", f"Correctness checks (small shapes, token-sharded): {len(checks) - len(failed)}/{len(checks)} ok"
              + (": FAILED " + "; ".join(failed) if failed else ".")]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = [] if args.skip_checks else correctness_checks(device, args.backend) + token_sharded_check(
        device, args.backend)
    all_checks = [None] * world
    dist.all_gather_object(all_checks, checks)
    flat_checks = [dict(c, rank=r) for r, cs in enumerate(all_checks) for c in cs]
    sizes = [int(v) for v in args.tp.split(",")] if args.tp else [t for t in (1, 2, 4, 8, 16) if t <= world]
    groups = tp_groups(sizes)
    benchmarks = []
    for label in (s.strip() for s in args.shapes.split(",") if s.strip()):
        benchmarks.append(benchmark_shape(args, label, groups, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world,
        "backend": candidates_for(device.type, args.backend).backends[0].name,
        "torch": torch.__version__,
        "flce": flce.__version__,
        "git": _git_revision(),
        "dtype": args.dtype,
        "iters": args.iters,
        "checks": flat_checks,
        "benchmarks": benchmarks,
    }
    failed = [c for c in flat_checks if not c["ok"]]
    if rank == 0:
        out = Path(args.out) if args.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "vocab_parallel.json").write_text(json.dumps(summary, indent=1))
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
