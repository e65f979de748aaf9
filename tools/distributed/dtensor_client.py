"""A real client: a small Llama-style model trained with the parallelism torchtitan applies, flce as the loss.

    torchrun --nproc-per-node 4 tools/distributed/dtensor_client.py --out DIR          # NCCL, fp32, V=32000
    torchrun --nproc-per-node 4 tools/distributed/dtensor_client.py --realistic --out DIR   # bf16, V=128256, dim 4096
    torchrun --nproc-per-node 2 tools/distributed/dtensor_client.py --device cpu --steps 2   # gloo smoke run

The model and its parallelisation are written here by hand, the way torchtitan's Llama applies
them (the ``torchtitan`` package itself needs ``spmd_types``, ``torchdata``, ``datasets``, ``wandb``
... and is not installed here). Modes (``--modes``):

* **tp** (``parallelize_module`` over a 1-D ``tp`` mesh of every rank): embeddings ``RowwiseParallel``
  to a sequence-sharded output, ``SequenceParallel`` norms, attention and MLP ``ColwiseParallel`` in /
  ``RowwiseParallel`` out, the output layer ``ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Shard(-1), use_local_output=False)``. Reference: the model's DTensor logits and
  ``F.cross_entropy`` under ``loss_parallel()``. flce: the final norm's sequence-sharded DTensor and
  ``model.output.weight`` (a ``Shard(0)`` DTensor). Every rank the same batch.
* **fsdp** (``fully_shard`` per block, on the output layer, then on the root, over a 1-D ``dp``
  mesh; each rank its own batch). Reference: the model's logits and ``F.cross_entropy``. flce: the
  final norm's output and ``model.output.weight`` outside the output unit's forward (the sharded
  DTensor).
* **fsdp_tp** (4 ranks or more): TP as above over ``tp`` = 2 ranks, then FSDP2 over ``dp`` = world / 2,
  a 2-D mesh; each data-parallel group its own batch. flce gets the output weight as a DTensor on the
  2-D mesh.

Precision: fp32 throughout (default), or ``--mixed`` (``--realistic`` implies it): fp32 parameters as
master weights and bf16 compute, as torchtitan sets it up: FSDP2's ``MixedPrecisionPolicy(bf16,
reduce fp32)`` where FSDP2 is applied, ``torch.autocast(bf16)`` for TP alone.

Each mode trains ``--steps`` SGD steps from the same initial weights twice, once per loss. The
comparison copies (every parameter's local shard after the last step, its gradient at the first)
go to the host, so the second run's GPU memory holds nothing of the first; each run's peak is taken
above what was allocated before its model was built. Rank 0 reports, per mode, the largest loss
difference, the largest relative error of any gradient at the first step and of any parameter
after the last, the median step time (the first step warms up) and the peak memory of each loss.
``--snapshot MODE`` records the CUDA allocator's history over one step of each loss in that mode
and writes ``memory_snapshot_MODE_{torch,flce}.pickle.gz`` (open with pytorch.org/memory_viz after
gunzip). Writes dtensor_client.json and .md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flce
from flce.testing.measure import MiB, publish

MODES = ("tp", "fsdp", "fsdp_tp")


@dataclass(frozen=True)
class ModelArgs:
    vocab: int = 96
    dim: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    seq: int = 16
    batch: int = 2


class RMSNorm(nn.Module):
    """In Python, as torchtitan's: SequenceParallel runs it on sequence-sharded DTensors."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them (torchtitan's idiom).
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn, bias=False)
        self.w2 = nn.Linear(args.ffn, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.layers)})
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, *, hidden_only: bool = False) -> torch.Tensor:
        """Logits, or (``hidden_only``) the final norm's output that flce takes instead."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return h if hidden_only else self.output(h)


def apply_tp(model: Transformer, mesh: Any) -> None:
    """torchtitan's Llama tensor/sequence-parallel plan, with loss_parallel's output layout."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_fsdp(model: Transformer, mesh: Any, mixed: bool) -> None:
    """fully_shard per block, on the output layer, then on the root (torchtitan's order); with
    ``mixed``, torchtitan's mixed-precision policy (bf16 parameters for compute, fp32 reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
        MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model.output, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


@dataclass(frozen=True)
class Parallelism:
    """One mode's meshes: ``tp`` (or None), ``dp`` (or None), and which batch this rank trains on."""

    mode: str
    tp: Any
    dp: Any
    batch_seed: int


def parallelism(mode: str, device: torch.device) -> Parallelism:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if mode == "tp":
        return Parallelism(mode, init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)), None, 1)
    if mode == "fsdp":
        return Parallelism(mode, None, init_device_mesh(device.type, (world,), mesh_dim_names=("dp",)),
                           1 + dist.get_rank())
    if world < 4 or world % 2:
        raise ValueError(f"mode fsdp_tp: needs an even world size of at least 4 (dp x tp=2), got {world}")
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return Parallelism(mode, mesh["tp"], mesh["dp"], 1 + mesh["dp"].get_local_rank())


def loss_of(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """The training loss: PyTorch's cross-entropy on the model's logits ("torch"), or flce on its
    hidden states and output weight ("flce"). With a TP mesh the torch loss runs inside loss_parallel."""
    if kind == "flce":
        return flce.linear_cross_entropy(model(tokens, hidden_only=True), model.output.weight, labels)
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _batch(args: ModelArgs, seed: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _host_shards(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's local shards, copied to the host: nothing of one run stays on the GPU for the next."""
    return {name: _local(t).detach().to("cpu", copy=True) for name, t in named.items()}


def build(plan: Parallelism, args: ModelArgs, device: torch.device, mixed: bool,
          lr: float = 0.5) -> tuple[Transformer, torch.optim.Optimizer]:
    """A freshly built model (the same seed everywhere) parallelised as ``plan`` says, and its SGD."""
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: at the realistic size a CPU init takes minutes
        model = Transformer(args)
    if plan.tp is not None:
        apply_tp(model, plan.tp)
    if plan.dp is not None:
        apply_fsdp(model, plan.dp, mixed)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, plan: Parallelism, kind: str,
               tokens: torch.Tensor, labels: torch.Tensor, mixed: bool) -> torch.Tensor:
    """Forward, backward (not the optimizer's step, so the gradients can be read); returns the loss."""
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer.zero_grad(set_to_none=True)
    parallel_loss = loss_parallel() if plan.tp is not None and kind == "torch" else contextlib.nullcontext()
    # torchtitan's mixed precision for TP without FSDP2: autocast (FSDP2's policy covers the rest).
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16) if mixed and plan.dp is None else \
        contextlib.nullcontext()
    with parallel_loss:
        with autocast:
            loss = loss_of(model, tokens, labels, kind)
        loss.backward()
    return loss


def train(plan: Parallelism, kind: str, args: ModelArgs, steps: int, device: torch.device, *, mixed: bool = False,
          snapshot: Path | None = None) -> dict[str, Any]:
    """``steps`` SGD steps of a freshly built model in ``plan.mode`` with ``kind`` loss."""
    on_gpu = device.type == "cuda"
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if on_gpu else 0
    model, optimizer = build(plan, args, device, mixed)
    losses, times, peaks, first_grads = [], [], [], {}
    for step in range(steps):
        tokens, labels = _batch(args, plan.batch_seed, step, device)
        recording = snapshot is not None and step == min(1, steps - 1)
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if recording:
                # Python frames only: symbolising C++ frames when the snapshot is taken can take minutes.
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=8000)
        start = time.perf_counter()
        loss = train_step(model, optimizer, plan, kind, tokens, labels, mixed)
        if step == 0:
            first_grads = _host_shards({name: p.grad for name, p in model.named_parameters()})
        optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - base) / MiB)
            if recording:
                _write_snapshot(snapshot)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(_full(loss.detach())))
    weight_grad = model.output.weight.grad
    return {"losses": losses, "grads": first_grads, "params": _host_shards(dict(model.named_parameters())),
            "times_ms": times, "peaks_mib": peaks, "output_grad_type": type(weight_grad).__name__,
            "output_grad_placements": [repr(p) for p in getattr(weight_grad, "placements", ())]}


def _write_snapshot(path: Path) -> None:
    """The allocator's history of the step, gzipped (rank 0 only; every rank stops recording)."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wb") as f:
            pickle.dump(snapshot, f)


def _max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        device: torch.device) -> tuple[float, str]:
    """Over every rank's shards: the largest ||got - want|| / ||want|| of any parameter, in float64 on
    ``device``. Replicated shards count once per rank in both norms, which leaves the ratio unchanged."""
    names = sorted(want)
    sums = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for row, name in enumerate(names):
        a, b = got[name].to(device).double(), want[name].to(device).double()
        sums[row, 0], sums[row, 1] = (a - b).pow(2).sum(), b.pow(2).sum()
    dist.all_reduce(sums)
    errors = (sums[:, 0] / sums[:, 1].clamp_min(1e-60)).sqrt().tolist()
    worst = max(range(len(names)), key=errors.__getitem__)
    return errors[worst], names[worst]


def compare_mode(mode: str, args: ModelArgs, steps: int, device: torch.device, *, mixed: bool = False,
                 snapshot_dir: Path | None = None) -> dict[str, Any]:
    """Train with torch's loss and with flce's; what differs between the two runs."""
    plan = parallelism(mode, device)
    runs = {}
    for kind in ("torch", "flce"):
        snapshot = None if snapshot_dir is None else snapshot_dir / f"memory_snapshot_{mode}_{kind}.pickle.gz"
        runs[kind] = train(plan, kind, args, steps, device, mixed=mixed, snapshot=snapshot)
    grad_error, grad_where = _max_relative_error(runs["flce"]["grads"], runs["torch"]["grads"], device)
    param_error, param_where = _max_relative_error(runs["flce"]["params"], runs["torch"]["params"], device)
    timed = slice(1, None) if steps > 1 else slice(None)  # the first step warms up
    summary: dict[str, Any] = {
        "mode": mode, "precision": "bf16 compute, fp32 master weights" if mixed else "fp32",
        "losses_torch": runs["torch"]["losses"],
        "losses_flce": runs["flce"]["losses"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(runs["torch"]["losses"], runs["flce"]["losses"], strict=True)),
        "max_grad_rel_error": grad_error, "worst_grad": grad_where,
        "max_param_rel_error": param_error, "worst_param": param_where,
        "output_grad_flce": [runs["flce"]["output_grad_type"], runs["flce"]["output_grad_placements"]],
        "output_grad_torch": [runs["torch"]["output_grad_type"], runs["torch"]["output_grad_placements"]],
    }
    for kind, run in runs.items():
        summary[f"step_ms_{kind}"] = statistics.median(run["times_ms"][timed])
        summary[f"peak_mib_{kind}"] = _max_over_ranks(max(run["peaks_mib"]), device) if run["peaks_mib"] else None
    return summary


def _max_over_ranks(value: float, device: torch.device) -> float:
    held = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return float(held)


def run(args: ModelArgs, steps: int, device: torch.device, modes: tuple[str, ...] = MODES, *, mixed: bool = False,
        snapshot_mode: str | None = None, snapshot_dir: Path | None = None) -> list[dict[str, Any]]:
    """Every mode that fits the world size, on every rank of the default group (already initialised)."""
    world = dist.get_world_size()
    results = []
    for mode in modes:
        if mode == "fsdp_tp" and (world < 4 or world % 2):
            continue
        snapshots = snapshot_dir if mode == snapshot_mode and device.type == "cuda" else None
        results.append(compare_mode(mode, args, steps, device, mixed=mixed, snapshot_dir=snapshots))
    return results


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| mode | precision | max loss diff | max grad rel err (step 1) | max param rel err (last) | "
             "step ms torch / flce | peak MiB torch / flce (above the run's start, max over ranks) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        peaks = "n/a" if r["peak_mib_torch"] is None else (
            f"{r['peak_mib_torch']:.0f} / {r['peak_mib_flce']:.0f} ({r['peak_mib_flce'] / r['peak_mib_torch']:.2f}x)")
        lines.append(
            f"| {r['mode']} | {r['precision']} | {r['max_loss_diff']:.2e} | {r['max_grad_rel_error']:.2e} "
            f"({r['worst_grad']}) | {r['max_param_rel_error']:.2e} ({r['worst_param']}) | "
            f"{r['step_ms_torch']:.1f} / {r['step_ms_flce']:.1f} | {peaks} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--realistic", action="store_true",
                        help="vocab 128256, dim 4096, ffn 14336, 32 heads, 2 layers, seq 4096, batch 2, --mixed")
    parser.add_argument("--mixed", action="store_true", help="bf16 compute with fp32 master weights")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=None, help="default 4 x dim")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--snapshot", default=None, choices=MODES, help="record the allocator's history in MODE")
    parser.add_argument("--tag", default="", help="suffix of the output files (dtensor_client{TAG}.json)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    options = parser.parse_args()
    if options.realistic:
        options.vocab, options.dim, options.ffn, options.heads, options.layers = 128256, 4096, 14336, 32, 2
        options.seq, options.batch, options.mixed = 4096, 2, True
    device = torch.device(options.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        # fp32 matmuls in full precision: the fp32 runs are compared at fp32 tolerances.
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    args = ModelArgs(vocab=options.vocab, dim=options.dim, layers=options.layers, heads=options.heads,
                     ffn=options.ffn or 4 * options.dim, seq=options.seq, batch=options.batch)
    out = Path(options.out) if options.out else None
    modes = tuple(m.strip() for m in options.modes.split(",") if m.strip())
    results = run(args, options.steps, device, modes, mixed=options.mixed, snapshot_mode=options.snapshot,
                  snapshot_dir=out)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        header = (f"{dist.get_world_size()} x {name}, {dist.get_backend()}, torch {torch.__version__}, "
                  f"{'bf16 compute + fp32 master weights' if options.mixed else 'fp32'}, {options.steps} steps, "
                  f"{asdict(args)}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"dtensor_client{options.tag}.json").write_text(
                json.dumps({"header": header, "results": results}, indent=1))
        publish(markdown(results, header), str(out / f"dtensor_client{options.tag}.md") if out is not None else None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
