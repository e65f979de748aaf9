"""A real client: a small Llama-style model trained with the parallelism torchtitan applies, flce as the loss.

    torchrun --nproc-per-node 2 tools/distributed/dtensor_client.py --out DIR       # NCCL on 2 GPUs (or gloo on CPUs)
    torchrun --nproc-per-node 2 tools/distributed/dtensor_client.py --device cpu --steps 2 --out DIR   # gloo smoke

The model and its parallelisation are written here by hand, the way torchtitan's Llama applies
them (the ``torchtitan`` package itself needs ``spmd_types``, ``torchdata``, ``datasets``, ``wandb``
... and is not installed here):

* **TP** (``parallelize_module`` over a 1-D ``tp`` mesh): embeddings ``RowwiseParallel`` to a
  sequence-sharded output, ``SequenceParallel`` norms, attention and MLP ``ColwiseParallel`` in /
  ``RowwiseParallel`` out, and the output layer ``ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Shard(-1), use_local_output=False)``, as torchtitan does with ``loss_parallel``.
  Reference: the model's DTensor logits and ``F.cross_entropy`` under ``loss_parallel()``. flce: the
  final norm's sequence-sharded DTensor and ``model.output.weight`` (a ``Shard(0)`` DTensor).
* **FSDP2** (``fully_shard`` per block, on the output layer, then on the root, over a 1-D ``dp``
  mesh; each rank its own batch). Reference: the model's logits and ``F.cross_entropy``. flce: the
  final norm's output and ``model.output.weight`` outside the output unit's forward, so flce
  receives the sharded DTensor.

Each mode trains ``--steps`` SGD steps from the same initial weights twice, once per loss; rank 0
reports, per mode, the largest loss difference over the steps, the largest relative error of
every parameter's gradient at the first step and of every parameter after the last step, and the
median step time and peak memory of each loss. Writes dtensor_client.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
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
from flce.testing.measure import publish


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


def apply_fsdp(model: Transformer, mesh: Any) -> None:
    """fully_shard per block, on the output layer, then on the root (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model.output, mesh=mesh)
    fully_shard(model, mesh=mesh)


def loss_of(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """The training loss: PyTorch's cross-entropy on the model's logits ("torch"), or flce on its
    hidden states and output weight ("flce"). Under TP the torch loss runs inside loss_parallel."""
    if kind == "flce":
        return flce.linear_cross_entropy(model(tokens, hidden_only=True), model.output.weight, labels)
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _batch(args: ModelArgs, seed: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train(mode: str, kind: str, args: ModelArgs, mesh: Any, steps: int, device: torch.device,
          lr: float = 0.5) -> dict[str, Any]:
    """``steps`` SGD steps of a freshly built model (same seed everywhere) in ``mode`` with ``kind`` loss."""
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    model = Transformer(args).to(device)
    (apply_tp if mode == "tp" else apply_fsdp)(model, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # TP: every rank the same batch; FSDP: each rank its own.
    seed = 1 if mode == "tp" else 1 + dist.get_rank()
    losses, times, peaks, first_grads = [], [], [], {}
    for step in range(steps):
        tokens, labels = _batch(args, seed, step, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if mode == "tp" and kind == "torch":
            with loss_parallel():
                loss = loss_of(model, tokens, labels, kind)
                loss.backward()
        else:
            loss = loss_of(model, tokens, labels, kind)
            loss.backward()
        if step == 0:
            first_grads = {name: _full(p.grad).detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**20)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(_full(loss.detach())))
    params = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    weight_grad = model.output.weight.grad
    return {"losses": losses, "grads": first_grads, "params": params, "times_ms": times, "peaks_mib": peaks,
            "output_grad_type": type(weight_grad).__name__,
            "output_grad_placements": [repr(p) for p in getattr(weight_grad, "placements", ())]}


def _max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, reference in want.items():
        error = float((got[name].double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))
        if error >= worst:
            worst, where = error, name
    return worst, where


def compare_mode(mode: str, args: ModelArgs, mesh: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """Train with torch's loss and with flce's; what differs between the two runs."""
    runs = {kind: train(mode, kind, args, mesh, steps, device) for kind in ("torch", "flce")}
    grad_error, grad_where = _max_relative_error(runs["flce"]["grads"], runs["torch"]["grads"])
    param_error, param_where = _max_relative_error(runs["flce"]["params"], runs["torch"]["params"])
    timed = slice(1, None) if steps > 1 else slice(None)  # the first step warms up
    summary: dict[str, Any] = {
        "mode": mode,
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
        summary[f"peak_mib_{kind}"] = max(run["peaks_mib"]) if run["peaks_mib"] else None
    return summary


def run(args: ModelArgs, steps: int, device: torch.device) -> list[dict[str, Any]]:
    """Both modes on every rank of the default group (already initialised); every rank returns the summaries."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    results = []
    for mode in ("tp", "fsdp"):
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(mode,))
        results.append(compare_mode(mode, args, mesh, steps, device))
    return results


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| mode | max loss diff | max grad rel err (step 1) | max param rel err (last) | "
             "step ms torch / flce | peak MiB torch / flce |",
             "|---|---|---|---|---|---|"]
    for r in results:
        peaks = "n/a" if r["peak_mib_torch"] is None else f"{r['peak_mib_torch']:.0f} / {r['peak_mib_flce']:.0f}"
        lines.append(
            f"| {r['mode']} | {r['max_loss_diff']:.2e} | {r['max_grad_rel_error']:.2e} ({r['worst_grad']}) | "
            f"{r['max_param_rel_error']:.2e} ({r['worst_param']}) | {r['step_ms_torch']:.1f} / "
            f"{r['step_ms_flce']:.1f} | {peaks} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    options = parser.parse_args()
    device = torch.device(options.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        # fp32 matmuls in full precision: the two runs are compared at fp32 tolerances.
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    args = ModelArgs(vocab=options.vocab, dim=options.dim, layers=options.layers, heads=options.heads,
                     ffn=4 * options.dim, seq=options.seq, batch=options.batch)
    results = run(args, options.steps, device)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        header = (f"{dist.get_world_size()} x {name}, {dist.get_backend()}, torch {torch.__version__}, fp32, "
                  f"{options.steps} steps, {asdict(args)}")
        out = Path(options.out) if options.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "dtensor_client.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
        publish(markdown(results, header), str(out / "dtensor_client.md") if out is not None else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
