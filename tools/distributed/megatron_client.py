"""flce's Megatron-core adapter against Megatron's own vocab-parallel cross-entropy, on several GPUs.

    torchrun --nproc-per-node 2 tools/distributed/megatron_client.py --out DIR       # NCCL, TP=2, sequence parallel
    torchrun --nproc-per-node 2 tools/distributed/megatron_client.py --device cpu --out DIR   # gloo smoke run

A GPTModel (learned absolute positions, megatron-core's local layer spec: attention and MLP
tensor-parallel, layer norms as ``torch.nn.LayerNorm`` through a small spec class because neither
Apex nor Transformer Engine is installed) is built once in float32 and copied into a bf16 model.
Per rank:

1. **Agreement.** One forward + backward with a random per-token upstream gradient (a loss mask's
   role), three times from the same weights: Megatron's head and loss in float32 (the reference),
   Megatron's in bf16, and flce's adapter (``flce.integrations.megatron.apply``) in bf16. The
   per-token loss and every parameter's gradient (this rank's shard; the gradients of
   sequence-parallel parameters all-reduced over the TP group, as ``finalize_model_grads`` does)
   are compared with the float32 reference. flce passes when its error is within 1.5x Megatron's
   bf16 error (plus a small floor) for the loss and for every gradient.
2. **Cost of the loss.** The decoder runs once; then the post-processing step alone (the output
   layer + cross-entropy, forward + backward into the hidden states and the head weight) is timed
   for both, median of ``--iters`` after ``--warmup``, with its peak memory above what was allocated
   before the step.

``--device cpu`` is a smoke run of the same code with gloo: MLP-only layers (megatron-core's local
attention allocates with ``torch.cuda``), no sequence parallelism (it needs the CUDA RNG tracker),
float32, small shapes. Rank 0 prints a table and writes megatron_client.json / .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Apex / Transformer Engine not installed, falling back to torch"
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

from flce.integrations import megatron as flce_megatron
from flce.testing.measure import MiB, publish


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for a layer spec, usable under sequence parallelism.

    Megatron's WrappedTorchNorm refuses sequence parallelism only because the norm's gradient is
    then partial per rank; marking the parameters ``sequence_parallel`` (as Megatron's fused norms
    do) tells the gradient finalisation to all-reduce them over the tensor-parallel group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_spec_options: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Megatron's local attention path hands some fp32 activations to the norms of a bf16 model
        # (its Apex/TE norms accept mixed dtypes; torch's refuses them): normalise in the params' dtype.
        return super().forward(x.to(self.weight.dtype))


def build_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> GPTModel:
    on_gpu = device.type == "cuda"
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sequence_parallel, attention_dropout=0.0, hidden_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not on_gpu,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    if not on_gpu:
        spec.submodules.input_layernorm = IdentityOp
        spec.submodules.self_attention = IdentityOp
        spec.submodules.self_attn_bda = IdentityFuncOp
    block = TransformerBlockSubmodules(layer_specs=[spec] * args.layers, layer_norm=SequenceParallelLayerNorm)
    torch.manual_seed(args.seed)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=args.vocab,
                     max_sequence_length=args.seq, share_embeddings_and_output_weights=False)
    return model.to(device)


def batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """The same batch on every rank (tensor parallelism), with a causal mask (True = masked out)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    upstream = torch.rand(args.batch, args.seq, generator=gen) + 0.25
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    return {name: t.to(device) for name, t in
            dict(ids=ids, labels=labels, upstream=upstream, mask=mask, positions=positions).items()}


def finalize_sequence_parallel_grads(model: GPTModel) -> None:
    """All-reduce the partial gradients of sequence-parallel parameters (norms, row-parallel biases)."""
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def full_step(model: GPTModel, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(data["ids"], data["positions"], data["mask"], labels=data["labels"])  # [b, s]
    (loss.float() * data["upstream"]).sum().backward()
    finalize_sequence_parallel_grads(model)
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def agreement(args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> tuple[dict[str, Any], GPTModel, dict[str, torch.Tensor]]:
    """The three runs of step 1; also returns the bf16 model (unpatched) and the batch, for the timing."""
    data = batch(args, device)
    reference_model = build_model(args, torch.float32, device)
    reference = full_step(reference_model, data)
    model = build_model(args, dtype, device)
    model.load_state_dict(reference_model.state_dict())
    del reference_model
    runs = {"megatron": full_step(model, data)}
    flce_megatron.apply(model)
    runs["flce"] = full_step(model, data)
    flce_megatron.remove(model)
    result: dict[str, Any] = {}
    for name, (loss, grads) in runs.items():
        assert grads.keys() == reference[1].keys(), f"{name}: grads for {sorted(grads)} vs {sorted(reference[1])}"
        errors = {key: relative_error(grads[key], want) for key, want in reference[1].items()}
        worst = max(errors, key=errors.get)
        result[name] = {"loss_max_abs_error": float((loss - reference[0]).abs().max()),
                        "loss_mean": float(loss.mean()), "grad_errors": errors,
                        "worst_grad": worst, "worst_grad_error": errors[worst]}
    floor = 1e-3 if dtype != torch.float32 else 1e-5
    failing = [key for key, err in result["flce"]["grad_errors"].items()
               if err > 1.5 * result["megatron"]["grad_errors"][key] + floor]
    loss_ok = result["flce"]["loss_max_abs_error"] <= 1.5 * result["megatron"]["loss_max_abs_error"] + 10 * floor
    result["flce_within_tolerance"] = loss_ok and not failing
    result["failing_grads"] = failing
    return result, model, data


def time_postprocess(args: argparse.Namespace, model: GPTModel, data: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, dict[str, float]]:
    """The output layer + cross-entropy alone, forward + backward, per variant."""
    with torch.no_grad():
        hidden = model.decoder(model.embedding(data["ids"], data["positions"]), data["mask"])
    timings = {}
    for variant in ("megatron", "flce"):
        if variant == "flce":
            flce_megatron.apply(model)
        leaf = hidden.detach().requires_grad_()

        def step(leaf: torch.Tensor = leaf) -> None:
            model.zero_grad(set_to_none=True)
            leaf.grad = None
            loss = model._postprocess(hidden_states=leaf, input_ids=data["ids"], position_ids=data["positions"],
                                      labels=data["labels"], rotary_pos_emb=None, rotary_pos_cos=None,
                                      rotary_pos_sin=None)
            (loss.float() * data["upstream"]).sum().backward()

        for _ in range(args.warmup):
            step()
        times, peaks = [], []
        for _ in range(args.iters):
            model.zero_grad(set_to_none=True)
            leaf.grad = None
            _synchronize(device)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            step()
            _synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
            if device.type == "cuda":
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / MiB)
        timings[variant] = {"median_ms": statistics.median(times), "min_ms": min(times),
                            "peak_mib_above_start": max(peaks) if peaks else float("nan")}
        flce_megatron.remove(model)
    return timings


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(header: str, result: dict[str, Any], timings: dict[str, dict[str, float]]) -> str:
    lines = [header, "",
             "| loss | per-token loss max abs err vs fp32 | worst grad rel err vs fp32 | "
             "loss step ms (median / min) | peak MiB above start |",
             "|---|---|---|---|---|"]
    for variant in ("megatron", "flce"):
        r, t = result[variant], timings[variant]
        lines.append(f"| {variant} | {r['loss_max_abs_error']:.3e} | {r['worst_grad_error']:.3e} ({r['worst_grad']}) | "
                     f"{t['median_ms']:.2f} / {t['min_ms']:.2f} | {t['peak_mib_above_start']:.0f} |")
    verdict = "yes" if result["flce_within_tolerance"] else f"NO: {result['failing_grads']}"
    lines += ["", f"flce within 1.5x Megatron's error for the loss and every gradient: {verdict}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", type=int, default=None, help="default: the world size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (GPU), 32 (CPU)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=None, help="default 128256 (GPU), 64 (CPU)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (GPU), 8 (CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in full precision
    args.hidden = args.hidden or (2048 if on_gpu else 32)
    args.vocab = args.vocab or (128256 if on_gpu else 64)
    args.seq = args.seq or (4096 if on_gpu else 8)
    args.heads = args.heads if on_gpu else 4
    args.sequence_parallel = on_gpu
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dist.init_process_group("nccl" if on_gpu else "gloo")
    args.tp = args.tp or dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    result, model, data = agreement(args, device, dtype)
    timings = time_postprocess(args, model, data, device)
    if dist.get_rank() == 0:
        from megatron.core import __version__ as megatron_version

        name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
        header = (f"{dist.get_world_size()} x {name}, {dist.get_backend()}, torch {torch.__version__}, megatron-core "
                  f"{megatron_version}, TP={args.tp}, sequence_parallel={args.sequence_parallel}, {dtype}, "
                  f"layers={args.layers} hidden={args.hidden} heads={args.heads} vocab={args.vocab} "
                  f"seq={args.seq} batch={args.batch}, {'attention + MLP' if on_gpu else 'MLP-only'} layers")
        out = Path(args.out) if args.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            payload = {"header": header, "agreement": result, "timings": timings, "args": vars(args)}
            (out / "megatron_client.json").write_text(json.dumps(payload, indent=1, default=str))
        publish(markdown(header, result, timings), str(out / "megatron_client.md") if out is not None else None)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
