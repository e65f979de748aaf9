"""Where an fp32 tensor-parallel step's loss time goes: the output layer and its loss alone, torch against flce, at
tools/distributed/dtensor_client.py's fp32 shape (batch 4 x seq 1024, dim 1024, V 32000), on every rank of a
1-D ``tp`` mesh and of a 2-D ``(dp=1, tp)`` mesh with FSDP2 over the ``dp`` dimension (torchtitan's FSDP2 x TP
layout, with no second data-parallel replica: what the 2-D placements cost by themselves).

    torchrun --nproc-per-node 2 tools/distributed/tp_fp32_probe.py --out DIR
    torchrun --nproc-per-node 2 tools/distributed/tp_fp32_probe.py --device cpu --batch 2 --seq 16 --dim 32 \
        --vocab 96 --iters 2 --warmup 1                                    # gloo smoke run

Variants, each one forward + backward of the loss from the sequence-sharded hidden states (as the final norm hands
them over) to the gradients of the hidden states and of the output weight:

* ``torch``: the client's reference, the output layer ``ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Shard(-1))`` (an all-gather of the hidden states, the logits GEMM on this rank's columns) and
  ``F.cross_entropy`` under ``loss_parallel()``;
* ``flce DTensor``: the client's flce call, ``flce.linear_cross_entropy(hidden DTensor, weight DTensor, labels)``
  (flce all-gathers the hidden states and runs its vocab-parallel path on the local shard);
* ``flce local``: the same without DTensors (the full hidden states, the local weight shard and the mesh's
  group): what the DTensor handling costs;
* ``torch 2-D`` and ``flce 2-D``: the output layer under FSDP2 on the ``dp`` dimension of a ``(1, tp)`` mesh after
  TP (the client's fsdp_tp mode): torch through the FSDP2 module's forward, flce on the FSDP2 parameter outside
  it (flce gathers it over ``dp`` and reduce-scatters its gradient back).

Each under ``torch.backends.cuda.matmul.allow_tf32 = False`` (the client's setting: both sides' cuBLAS GEMMs in
full fp32; flce's fp32 calls run cuBLAS GEMMs here) and ``True`` (TF32 tensor cores for both): the median of
``--iters`` steps after ``--warmup``, the ranks aligned by a barrier before each, CUDA events around the step, and
the loss (the same on every variant). With ``--profile`` (the default on GPUs), rank 0 also writes the top CUDA
kernels of one step of ``torch`` and ``flce DTensor`` at TF32 off. Writes tp_fp32_probe.md/.json to --out.
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
import torch.nn.functional as F
from torch import nn

import flce
from flce.testing.measure import publish


def _output_layer(weight: torch.Tensor, mesh: object, fsdp_mesh: object | None) -> nn.Linear:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
    parallelize_module(layer, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                    use_local_output=False))
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(layer, mesh=fsdp_mesh)
    return layer


def variants(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, device: torch.device
             ) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one forward + backward step returning the loss (gradients cleared before)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    world = dist.get_world_size()
    tp = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    two_d = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
    group = tp.get_group()
    rank = dist.get_rank()
    shard = weight.shape[0] // world
    local_weight = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    full_hidden = hidden.clone().requires_grad_()
    layers = {"1-D": _output_layer(weight, tp, None), "2-D": _output_layer(weight, two_d["tp"], two_d["dp"])}
    meshes = {"1-D": tp, "2-D": two_d["tp"]}

    def sharded_hidden(mesh: object) -> torch.Tensor:
        return distribute_tensor(hidden, mesh, [Shard(1)]).requires_grad_()

    def torch_step(kind: str) -> torch.Tensor:
        layer, h = layers[kind], sharded_hidden(meshes[kind])
        layer.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = F.cross_entropy(layer(h).flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        return loss.detach().full_tensor()

    def flce_step(kind: str) -> torch.Tensor:
        layer, h = layers[kind], sharded_hidden(meshes[kind])
        layer.zero_grad(set_to_none=True)
        loss = flce.linear_cross_entropy(h, layer.weight, labels)
        loss.backward()
        return loss.detach()

    def flce_local() -> torch.Tensor:
        full_hidden.grad = local_weight.grad = None
        loss = flce.linear_cross_entropy(full_hidden, local_weight, labels, process_group=group)
        loss.backward()
        return loss.detach()

    return {"torch": lambda: torch_step("1-D"), "flce DTensor": lambda: flce_step("1-D"), "flce local": flce_local,
            "torch 2-D": lambda: torch_step("2-D"), "flce 2-D": lambda: flce_step("2-D")}


def timed(step: Callable[[], torch.Tensor], device: torch.device, warmup: int, iters: int) -> tuple[list[float], float]:
    """Per-step milliseconds (CUDA events on GPUs, the wall clock on CPUs) and the last loss."""
    loss = None
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - began) * 1e3)
    return times, float(loss)


def profile_table(step: Callable[[], torch.Tensor]) -> str:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device)
    weight = (torch.randn(args.vocab, args.dim, generator=gen) / args.dim ** 0.5).to(device)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    steps = variants(hidden, weight, labels, device)
    rows, results = [], []
    for tf32 in (False, True):
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
        for name, step in steps.items():
            times, loss = timed(step, device, args.warmup, args.iters)
            median = statistics.median(times)
            results.append({"variant": name, "tf32": tf32, "ms": times, "loss": loss})
            rows.append(f"| {name} | {'on' if tf32 else 'off'} | {median:.2f} ({min(times):.2f}-{max(times):.2f}) | "
                        f"{loss:.6f} |")
    tables = {}
    if device.type == "cuda" and not args.no_profile:
        torch.backends.cuda.matmul.allow_tf32 = False
        tables = {name: profile_table(steps[name]) for name in ("torch", "flce DTensor")}
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        header = (f"{dist.get_world_size()} x {name}, {dist.get_backend()}, torch {torch.__version__}, fp32, "
                  f"batch {args.batch} x seq {args.seq}, dim {args.dim}, V {args.vocab}; median (min-max) of "
                  f"{args.iters} steps after {args.warmup}")
        lines = [header, "", "| variant | TF32 | ms a step, loss forward + backward | loss |", "|---|---|---|---|",
                 *rows]
        for variant, table in tables.items():
            lines += ["", f"Top CUDA kernels of one `{variant}` step (TF32 off, rank 0):", "", "```", table, "```"]
        out = Path(args.out) if args.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "tp_fp32_probe.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
        publish("\n".join(lines), str(out / "tp_fp32_probe.md") if out is not None else None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
