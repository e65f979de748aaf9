"""Vocab-parallel linear distillation on 2 GPUs: agreement with the unsharded call, then TP = 2 against TP = 1.

    torchrun --nproc-per-node 2 tools/distributed/distill_tp.py --out $OUT        # NCCL, bf16, JSD, ~2 min
    torchrun --nproc-per-node 2 tools/distributed/distill_tp.py --device cpu --shapes 256x32x48x1000 \
        --rounds 1 --calls 2 --warmup 1                                            # gloo smoke run on a CPU

1. Agreement (small shapes, uneven shards, fp32 and bf16, every loss at temperature 0.9 and forward KL at 1, a
   hard-label term, the teacher's gradient asked once): on every rank the sharded loss, the student's grad_hidden,
   this rank's slice of grad_weight and the student's entropy the call returns against the unsharded call on the
   same device, and (fp32) the loss and the entropy against the float64 oracle. Then the same calls with both
   heads' weights as tensor-parallel frameworks hold them, ``Shard(0)`` DTensors on a mesh of the two ranks (no
   ``process_group``: the mesh's group is taken): the loss, grad_hidden and the whole grad_weight (a DTensor in the
   weight's placement, gathered) against the unsharded call.
2. Time, per shape of ``--shapes`` (``TOKENSxSTUDENT_HxTEACHER_HxVOCAB``; default 8192 x 4096 x {4096, 8192}
   x 128256, bf16, JSD beta 0.5, the default memory budget): TP = 1 (each rank the whole call, side by side as
   data-parallel replicas run) and TP = 2 (both heads' vocabulary halved), forward + backward, after --warmup
   calls of each, in --rounds rounds that alternate the two. A round times each configuration two ways:
   ``alone``, --alone steps each from a barrier to a synchronisation (host clock; each step starts from an idle
   GPU and carries the wait for the host's first launches), and ``back to back``, --calls calls queued without a
   synchronisation between them (CUDA events on the GPU's clock; throughput, as in a training loop). The target:
   TP = 2 at most 0.53x TP = 1 (half the GEMMs, plus the per-chunk statistics all-reduce and grad_hidden's).

Rank 0 prints the summary and writes distill_tp.json and distill_tp.md to --out (default $OUT, if set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import flce
from flce.testing.distillation import reference_distillation_loss, reference_student_entropy

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TARGET_RATIO = 0.53


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8192x4096x4096x128256,8192x4096x8192x128256",
                   help="comma-separated TOKENSxSTUDENT_HxTEACHER_HxVOCAB")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--loss", default="jsd")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each configuration first")
    p.add_argument("--rounds", type=int, default=5, help="rounds alternating TP = 1 and TP = 2")
    p.add_argument("--alone", type=int, default=2, help="steps timed alone from a barrier, a round")
    p.add_argument("--calls", type=int, default=10, help="calls timed back to back, a round")
    p.add_argument("--backend", default=None, help="flce backend (default: the registry's choice)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for distill_tp.json / .md")
    args = p.parse_args(argv)
    for name in ("rounds", "alone", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes {text!r}: expected TOKENSxSTUDENT_HxTEACHER_HxVOCAB, e.g. 8192x4096x8192x128256")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def halves(vocab: int, uneven: bool) -> list[int]:
    """Two shards: equal, or (uneven) the first a third smaller."""
    first = vocab // 2 - (vocab // 6 if uneven else 0)
    return [first, vocab - first]


def inputs(tokens: int, student: int, teacher: int, vocab: int, dtype: torch.dtype, device: torch.device,
           seed: int) -> dict[str, torch.Tensor]:
    """The same inputs on every rank (drawn with one seed on each): logits O(1), every 17th target ignored."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(device, dtype)

    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[::17] = -100
    return {"xs": draw(tokens, student), "ws": draw(vocab, student, std=student**-0.5), "xt": draw(tokens, teacher),
            "wt": draw(vocab, teacher, std=teacher**-0.5), "target": target.to(device)}


def call(data: dict[str, torch.Tensor], rows: slice | None, group: object, options: dict,
         entropy: bool = False) -> tuple:
    """Loss and the gradients of (xs, ws[rows], xt, wt[rows]) of one call (the shard's weights with ``rows``), and
    with ``entropy`` the student's entropy the call returns (return_entropy)."""
    leaves = {k: (v if rows is None or not k.startswith("w") else v[rows]).detach().clone().requires_grad_()
              for k, v in data.items() if k != "target"}
    out = flce.linear_distillation_loss(leaves["xs"], leaves["ws"], leaves["xt"], leaves["wt"], data["target"],
                                        process_group=group, return_entropy=entropy, **options)
    loss = out.loss if entropy else out
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items()}
    return (loss.detach(), grads, out.entropy) if entropy else (loss.detach(), grads)


def relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def check_agreement(device: torch.device, backend: str | None) -> list[dict]:
    """Section 1 of the module docstring; every rank checks, rank 0 reports."""
    rank = dist.get_rank()
    results = []
    cases = [{"loss": loss, "hard_label_weight": 0.2, "temperature": 0.9, "teacher_grad": loss == "jsd"}
             for loss in ("forward_kl", "reverse_kl", "jsd")]
    # at temperature 1 forward KL may take the logits GEMMs' statistics (its E_p[t - s] from the gradient's sweep)
    cases.append({"loss": "forward_kl", "hard_label_weight": 0.2, "temperature": 1.0, "teacher_grad": False})
    for dtype in (torch.float32, torch.bfloat16):
        for case in cases:
            options = {**case, "backend": backend}
            loss = case["loss"]
            data = inputs(257, 64, 96, 3001, dtype, device, seed=11)
            sizes = halves(3001, uneven=True)
            rows = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
            sharded, grads, entropy = call(data, rows, dist.group.WORLD, options, entropy=True)
            whole, full, whole_entropy = call(data, None, None, options, entropy=True)
            errors = {"loss": relative(sharded, whole), "grad xs": relative(grads["xs"], full["xs"]),
                      "grad ws shard": relative(grads["ws"], full["ws"][rows]),
                      "entropy": relative(entropy, whole_entropy)}
            if options["teacher_grad"]:
                errors["grad wt shard"] = relative(grads["wt"], full["wt"][rows])
            if dtype == torch.float32:
                math = {k: v for k, v in options.items() if k not in ("backend", "teacher_grad")}
                oracle = reference_distillation_loss(data["xs"], data["ws"], data["xt"], data["wt"], data["target"],
                                                     **math)
                errors["loss vs float64 oracle"] = relative(sharded, oracle)
                errors["entropy vs float64 oracle"] = relative(entropy, reference_student_entropy(
                    data["xs"], data["ws"], data["target"], temperature=case["temperature"]))
            results.append(_checked(f"{loss}, T {case['temperature']}", dtype, errors, device))
    return results


def check_dtensor_heads(device: torch.device, backend: str | None) -> list[dict]:
    """Section 1's DTensor calls: both heads' weights Shard(0) DTensors (torch's even split of the vocabulary)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for loss in ("forward_kl", "reverse_kl", "jsd"):
            options = {"loss": loss, "hard_label_weight": 0.2, "temperature": 0.9, "backend": backend}
            data = inputs(257, 64, 96, 3001, dtype, device, seed=12)
            whole, full = call(data, None, None, options)
            leaves = {k: v.detach().clone().requires_grad_() for k, v in data.items() if k != "target"}
            weights = {k: torch.nn.Parameter(distribute_tensor(leaves[k].detach(), mesh, [Shard(0)]),
                                             requires_grad=k == "ws") for k in ("ws", "wt")}
            got = flce.linear_distillation_loss(leaves["xs"], weights["ws"], leaves["xt"].detach(), weights["wt"],
                                                data["target"], **options)
            got.backward()
            grad_weight = weights["ws"].grad
            placed = isinstance(grad_weight, DTensor) and grad_weight.placements == (Shard(0),)
            errors = {"loss": relative(got.detach(), whole), "grad xs": relative(leaves["xs"].grad, full["xs"]),
                      "grad ws": relative(grad_weight.full_tensor() if placed else None, full["ws"])}
            results.append(_checked(f"{loss}, T 0.9, DTensor heads", dtype, errors, device))
    return results


def _checked(what: str, dtype: torch.dtype, errors: dict[str, float], device: torch.device) -> dict:
    """One agreement check's record: its worst error over the ranks against the dtype's limit."""
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    worst_all = torch.tensor([max(errors.values())], device=device)
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    return {"dtype": str(dtype).removeprefix("torch."), "loss": what, "errors": errors,
            "worst over ranks": float(worst_all), "limit": limit, "passed": float(worst_all) <= limit}


def aligned(device: torch.device) -> None:
    """Every rank idle and at the same point: the GPU's queue drained, then a barrier."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_alone(fn: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of one call from aligned ranks to its end, on the host's clock."""
    aligned(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_back_to_back(fn: Callable[[], None], device: torch.device, calls: int) -> float:
    """Milliseconds a call over ``calls`` calls queued with no synchronisation between them (the GPU's clock)."""
    aligned(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) * 1e3 / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / calls


def summary(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples), "range_ms": [min(samples), max(samples)], "samples": samples}


def time_shape(shape: tuple[int, int, int, int], args: argparse.Namespace, device: torch.device) -> dict:
    tokens, student, teacher, vocab = shape
    rank = dist.get_rank()
    dtype = DTYPES[args.dtype]
    data = inputs(tokens, student, teacher, vocab, dtype, device, seed=5)
    options = {"loss": args.loss, "backend": args.backend}
    sizes = halves(vocab, uneven=False)
    rows = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    leaves = {k: v.detach().clone().requires_grad_() for k, v in data.items() if k in ("xs", "ws")}
    shard = leaves["ws"].detach()[rows].clone().requires_grad_()
    teacher_shard = data["wt"][rows].contiguous()

    def step(weight: torch.Tensor, teacher_weight: torch.Tensor, group: object) -> None:
        leaves["xs"].grad = weight.grad = None
        flce.linear_distillation_loss(leaves["xs"], weight, data["xt"], teacher_weight, data["target"],
                                      process_group=group, **options).backward()

    configs = {"tp1": lambda: step(leaves["ws"], data["wt"], None),
               "tp2": lambda: step(shard, teacher_shard, dist.group.WORLD)}
    alone: dict[str, list[float]] = {name: [] for name in configs}
    back_to_back: dict[str, list[float]] = {name: [] for name in configs}
    for fn in configs.values():
        for _ in range(args.warmup):
            fn()
    for _ in range(args.rounds):
        for name, fn in configs.items():
            alone[name] += [time_alone(fn, device) for _ in range(args.alone)]
            back_to_back[name].append(time_back_to_back(fn, device, args.calls))
    result: dict = {"shape": "x".join(map(str, shape))}
    for mode, samples in (("alone", alone), ("back_to_back", back_to_back)):
        tp1, tp2 = summary(samples["tp1"]), summary(samples["tp2"])
        ratio = tp2["median_ms"] / tp1["median_ms"]
        result[mode] = {"tp1": tp1, "tp2": tp2, "ratio": ratio, "meets_target": ratio <= TARGET_RATIO}
    return result


def markdown(report: dict) -> str:
    lines = [f"# Vocab-parallel linear distillation ({report['device']}, {report['dtype']}, loss {report['loss']})", ""]
    if report["checks"]:
        lines += ["| dtype | loss | worst relative error over ranks | limit | |", "|---|---|---|---|---|"]
        lines += [f"| {c['dtype']} | {c['loss']} | {c['worst over ranks']:.2e} | {c['limit']:.0e} | "
                  f"{'ok' if c['passed'] else 'FAILED'} |" for c in report["checks"]]
        lines.append("")
    lines += [f"| shape (tokens x student H x teacher H x V) | timing | TP=1 ms | TP=2 ms | TP=2 / TP=1 (target <= "
              f"{TARGET_RATIO}) |", "|---|---|---|---|---|"]
    for t in report["timings"]:
        for mode, label in (("alone", f"alone ({report['alone']} a round)"),
                            ("back_to_back", f"back to back ({report['calls']} a round)")):
            m = t[mode]
            cells = [f"{m[k]['median_ms']:.2f} ({m[k]['range_ms'][0]:.2f}-{m[k]['range_ms'][1]:.2f})"
                     for k in ("tp1", "tp2")]
            lines.append(f"| {t['shape']} | {label} | {cells[0]} | {cells[1]} | {m['ratio']:.3f}"
                         f"{'' if m['meets_target'] else ' (over target)'} |")
    lines += ["", f"Medians and ranges over {report['rounds']} rounds alternating TP = 1 and TP = 2, after "
              f"{report['warmup']} calls of each."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    if dist.get_world_size() != 2:
        raise SystemExit(f"distill_tp.py runs on 2 ranks (torchrun --nproc-per-node 2), got {dist.get_world_size()}")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
              "loss": args.loss, "rounds": args.rounds, "alone": args.alone, "calls": args.calls,
              "warmup": args.warmup, "checks": [] if args.skip_checks else (check_agreement(device, args.backend)
                                                     + check_dtensor_heads(device, args.backend)),
              "timings": [time_shape(shape, args, device) for shape in shapes]}
    failed = [c for c in report["checks"] if not c["passed"]]
    if dist.get_rank() == 0:
        text = markdown(report)
        print(text)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "distill_tp.json").write_text(json.dumps(report, indent=1))
            Path(args.out, "distill_tp.md").write_text(text)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
