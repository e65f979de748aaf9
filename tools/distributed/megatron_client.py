"""megatron-core's own GPTModel, trained with Megatron's vocab-parallel cross-entropy and with flce's adapter.

    torchrun --nproc-per-node 4 tools/distributed/megatron_client.py --out DIR       # NCCL, TP = 1, 2, 4
    torchrun --nproc-per-node 2 tools/distributed/megatron_client.py --device cpu --out DIR   # gloo smoke run

A GPTModel (learned absolute positions, megatron-core's local layer spec: attention and MLP
tensor-parallel, layer norms as ``torch.nn.LayerNorm`` through a small spec class because neither
Apex nor Transformer Engine is installed) is built in float32 and copied into a bf16 model, for
every tensor-parallel size of ``--tp`` (default: 1, 2, 4 ... up to the world size; the other ranks
are data-parallel replicas of the same batch), sequence parallelism on where TP > 1. Per TP:

1. **Agreement, the loss.** One forward + backward with a random per-token upstream gradient (a
   loss mask's role) from the same weights: Megatron's head and vocab-parallel cross-entropy in
   float32 (the reference) and twice in bf16 (run-to-run), flce's adapter
   (``flce.integrations.megatron.apply``) in bf16. Per-token losses and every parameter's gradient
   (this rank's shard; sequence-parallel parameters' gradients all-reduced over TP, as
   ``finalize_model_grads`` does) against the float32 reference.
2. **Agreement, RL.** Per-token log-probs and entropy at temperature ``--temperature`` with random
   upstream gradients on both, through megatron-core's ``output_processor`` hook: Megatron's native
   path (the head's logits, ``-vocab_parallel_cross_entropy(logits / T)`` and a vocab-parallel entropy
   over the same logits, as Megatron-LM's RL code computes them) in fp32 and bf16, and
   ``flce.integrations.megatron.output_processor`` in bf16.
3. **Training.** ``--steps`` steps (a new batch each) of SGD on fp32 master weights copied into the
   bf16 model, once per loss, from the same weights: the mean loss per step, the step time (median
   after the first) and the step's peak memory above its start.
4. **The loss alone.** The post-processing step (output layer + loss, forward + backward into the
   hidden states and the head) timed for both, CE and RL, median of ``--iters`` after ``--warmup``,
   with its peak memory above its start.

Targets (checked by rank 0 over all TP sizes): flce's per-token loss differs from Megatron's at the
same TP by no more than Megatron's own bf16 runs differ from one another (the same run twice; each TP
size initialises its own weights, so sizes are not compared per token), reported beside Megatron's bf16
error against its fp32 run; every gradient's error against fp32 within 1.5x Megatron's bf16 error (plus
1e-3). ``--device cpu``: MLP-only layers (megatron-core's local attention allocates
with ``torch.cuda``), no sequence parallelism, small shapes. Rank 0 writes megatron_client.json / .md
to --out after every TP size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
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

import flce
from flce.integrations import megatron as flce_megatron
from flce.testing.measure import MiB, publish

GRAD_FLOOR = 1e-3  # bf16: errors this small are rounding of the gradient itself


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


def build_model(args: argparse.Namespace, tp: int, dtype: torch.dtype, device: torch.device) -> GPTModel:
    on_gpu = device.type == "cuda"
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, tensor_model_parallel_size=tp,
        sequence_parallel=on_gpu and tp > 1, attention_dropout=0.0, hidden_dropout=0.0,
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


def batch(args: argparse.Namespace, device: torch.device, step: int = 0) -> dict[str, torch.Tensor]:
    """The same batch on every rank, with a causal mask (True = masked out) and upstream gradients."""
    gen = torch.Generator().manual_seed(args.seed + 1 + 1000 * step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    upstream = torch.rand(3, args.batch, args.seq, generator=gen) + 0.25
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    return {name: t.to(device) for name, t in
            dict(ids=ids, labels=labels, upstream=upstream, mask=mask, positions=positions).items()}


# --------------------------------------------------------------------------- Megatron's native RL outputs

def vocab_parallel_entropy(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """Entropy of softmax(logits) over the vocabulary split across ``group``: [..., V/tp] -> [...],
    differentiable (the sums' all-reduces pass gradients through unchanged, as Megatron's mappings do)."""
    row_max = logits.detach().amax(-1, keepdim=True)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max
    exp = shifted.exp()
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(exp.sum(-1), group=group)
    sum_exp_z = tensor_parallel.reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1), group=group)
    return sum_exp.log() - sum_exp_z / sum_exp


def megatron_rl_processor(temperature: float) -> Callable[..., flce.LCEOutput]:
    """An ``output_processor`` with Megatron's own head: its logits, then per-token log-probs and entropy
    at ``temperature`` in fp32 with the vocab-parallel cross-entropy and entropy, [b, s] each."""

    def process(*, hidden_states: torch.Tensor, output_layer: torch.nn.Module, output_weight: torch.Tensor | None,
                labels: torch.Tensor, **_context: Any) -> flce.LCEOutput:
        logits, _ = output_layer(hidden_states, weight=output_weight)  # [s, b, V/tp]
        scaled = logits.float() / temperature
        group = output_layer.tp_group
        entropy = vocab_parallel_entropy(scaled, group)
        # Megatron's cross-entropy overwrites its logits in place (with their exponentials): a copy, as
        # RL trainers on Megatron (verl) pass it.
        logprobs = -tensor_parallel.vocab_parallel_cross_entropy(scaled.clone(), labels.t().contiguous(),
                                                                 tp_group=group)
        return flce.LCEOutput(loss=None, logprobs=logprobs.t().contiguous(), entropy=entropy.t().contiguous())

    return process


# --------------------------------------------------------------------------- steps

def finalize_sequence_parallel_grads(model: GPTModel) -> None:
    """All-reduce the partial gradients of sequence-parallel parameters (norms, row-parallel biases)."""
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    finalize_sequence_parallel_grads(model)
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


Outputs = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # per-token outputs, every parameter's grad


def loss_step(model: GPTModel, data: dict[str, torch.Tensor]) -> Outputs:
    model.zero_grad(set_to_none=True)
    loss = model(data["ids"], data["positions"], data["mask"], labels=data["labels"])  # [b, s]
    (loss.float() * data["upstream"][0]).sum().backward()
    return {"loss": loss.detach().float()}, _grads(model)


def rl_step(model: GPTModel, data: dict[str, torch.Tensor], processor: Callable[..., Any]) -> Outputs:
    model.zero_grad(set_to_none=True)
    out = model(data["ids"], data["positions"], data["mask"], labels=data["labels"], output_processor=processor)
    ((out.logprobs.float() * data["upstream"][1]).sum() + (out.entropy.float() * data["upstream"][2]).sum()).backward()
    return {"logprobs": out.logprobs.detach().float(), "entropy": out.entropy.detach().float()}, _grads(model)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def errors_against(reference: tuple[dict, dict], run: tuple[dict, dict]) -> dict[str, Any]:
    """Max abs error of each per-token output and relative error of every gradient, against ``reference``."""
    outputs = {name: float((run[0][name] - want).abs().max()) for name, want in reference[0].items()}
    grads = {name: relative_error(run[1][name], want) for name, want in reference[1].items()}
    worst = max(grads, key=grads.get)
    return {"outputs_max_abs_error": outputs, "grad_errors": grads, "worst_grad": worst,
            "worst_grad_error": grads[worst]}


def agreement(args: argparse.Namespace, tp: int, device: torch.device,
              dtype: torch.dtype) -> tuple[dict[str, Any], GPTModel]:
    """Sections 1 and 2 at one TP size; also the model (unpatched)."""
    data = batch(args, device)
    reference_model = build_model(args, tp, torch.float32, device)
    model = build_model(args, tp, dtype, device)
    model.load_state_dict(reference_model.state_dict())
    rl_megatron = megatron_rl_processor(args.temperature)
    rl_flce = flce_megatron.output_processor(temperature=args.temperature, return_logprobs=True, return_entropy=True)
    reference = {"loss": loss_step(reference_model, data), "rl": rl_step(reference_model, data, rl_megatron)}
    del reference_model
    runs = {"loss": {"megatron": loss_step(model, data), "megatron (second run)": loss_step(model, data)},
            "rl": {"megatron": rl_step(model, data, rl_megatron), "flce": rl_step(model, data, rl_flce)}}
    flce_megatron.apply(model)
    runs["loss"]["flce"] = loss_step(model, data)
    flce_megatron.remove(model)
    result: dict[str, Any] = {}
    for path, by_method in runs.items():
        result[path] = {method: errors_against(reference[path], run) for method, run in by_method.items()}
        result[path]["flce vs megatron, max abs per-token difference"] = {
            name: float((by_method["flce"][0][name] - by_method["megatron"][0][name]).abs().max())
            for name in by_method["flce"][0]}
        failing = [name for name, err in result[path]["flce"]["grad_errors"].items()
                   if err > 1.5 * result[path]["megatron"]["grad_errors"][name] + GRAD_FLOOR]
        result[path]["grads within 1.5x of Megatron's bf16 error"] = not failing
        result[path]["failing_grads"] = failing
    result["loss"]["megatron run-to-run max abs per-token difference"] = float(
        (runs["loss"]["megatron"][0]["loss"] - runs["loss"]["megatron (second run)"][0]["loss"]).abs().max())
    return result, model


def train(args: argparse.Namespace, model: GPTModel, state: dict[str, torch.Tensor], use_flce: bool,
          device: torch.device) -> dict[str, Any]:
    """Section 3: ``args.steps`` SGD steps on fp32 masters from ``state``, a new batch each step."""
    model.load_state_dict(state)
    if use_flce:
        flce_megatron.apply(model)
    masters = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    losses, times, peaks = [], [], []
    for step in range(args.steps):
        data = batch(args, device, step=1 + step)
        _synchronize(device)
        base = _reset_peak(device)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = model(data["ids"], data["positions"], data["mask"], labels=data["labels"]).float().mean()
        loss.backward()
        finalize_sequence_parallel_grads(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                masters[name].add_(param.grad.float(), alpha=-args.lr)
                param.copy_(masters[name])
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        peaks.append(_peak_mib(device, base))
        losses.append(float(loss))
    if use_flce:
        flce_megatron.remove(model)
    return {"losses": losses, "step_ms_median": statistics.median(times[1:] or times), "peak_mib": max(peaks)}


def time_postprocess(args: argparse.Namespace, model: GPTModel, state: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, dict[str, float]]:
    """Section 4: the output layer + loss alone, forward + backward, CE and RL, each method."""
    model.load_state_dict(state)
    data = batch(args, device)
    with torch.no_grad():
        hidden = model.decoder(model.embedding(data["ids"], data["positions"]), data["mask"])
    leaf = hidden.detach().requires_grad_()
    processors = {"CE megatron": None, "CE flce": None,
                  "RL megatron": megatron_rl_processor(args.temperature),
                  "RL flce": flce_megatron.output_processor(temperature=args.temperature, return_logprobs=True,
                                                            return_entropy=True)}
    timings = {}
    for name, processor in processors.items():
        if name == "CE flce":
            flce_megatron.apply(model)

        def step(processor: Any = processor) -> None:
            model.zero_grad(set_to_none=True)
            leaf.grad = None
            out = model._postprocess(hidden_states=leaf, input_ids=data["ids"], position_ids=data["positions"],
                                     labels=data["labels"], rotary_pos_emb=None, rotary_pos_cos=None,
                                     rotary_pos_sin=None, output_processor=processor)
            total = (out.float() * data["upstream"][0]).sum() if processor is None else \
                (out.logprobs.float() * data["upstream"][1]).sum() + (out.entropy.float() * data["upstream"][2]).sum()
            total.backward()

        for _ in range(args.warmup):
            step()
        times, peaks = [], []
        for _ in range(args.iters):
            _synchronize(device)
            dist.barrier()
            base = _reset_peak(device)
            start = time.perf_counter()
            step()
            _synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
            peaks.append(_peak_mib(device, base))
        timings[name] = {"median_ms": statistics.median(times), "min_ms": min(times),
                         "peak_mib_above_start": max(peaks)}
        flce_megatron.remove(model)
    return timings


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_mib(device: torch.device, base: int) -> float:
    return (torch.cuda.max_memory_allocated(device) - base) / MiB if device.type == "cuda" else float("nan")


# --------------------------------------------------------------------------- across TP sizes

def verdicts(per_tp: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """flce's per-token difference from Megatron at the same TP against Megatron's own bf16 run-to-run spread
    (the same run twice) and against Megatron's bf16 error from its fp32 run; the gradient verdicts of every TP
    size. Each TP size initialises its own weights (Megatron's model-parallel RNG), so losses are compared within
    a TP size only; across sizes only the training curves' spread is reported, as a scale."""
    run_to_run = max(r["agreement"]["loss"]["megatron run-to-run max abs per-token difference"]
                     for r in per_tp.values())
    flce_diff = {tp: r["agreement"]["loss"]["flce vs megatron, max abs per-token difference"]["loss"]
                 for tp, r in per_tp.items()}
    bf16_error = {tp: r["agreement"]["loss"]["megatron"]["outputs_max_abs_error"]["loss"] for tp, r in per_tp.items()}
    layouts = sorted(per_tp)
    curves = {tp: max(abs(a - b) for a, b in zip(r["training"]["megatron"]["losses"], r["training"]["flce"]["losses"],
                                                  strict=True)) for tp, r in per_tp.items()}
    curve_spread = max((abs(a - b) for x in layouts for y in layouts if x < y
                        for a, b in zip(per_tp[x]["training"]["megatron"]["losses"],
                                        per_tp[y]["training"]["megatron"]["losses"], strict=True)), default=0.0)
    return {
        "megatron bf16 spread, per-token loss (max abs): run to run": run_to_run,
        "megatron bf16 per-token loss error vs its fp32 run (max abs), per TP": bf16_error,
        "flce vs megatron per-token loss (max abs), per TP": flce_diff,
        "loss within Megatron's bf16 run-to-run spread": all(d <= run_to_run for d in flce_diff.values()),
        "flce vs megatron per-token loss, as a fraction of Megatron's bf16 error vs fp32, per TP": {
            tp: flce_diff[tp] / bf16_error[tp] if bf16_error[tp] else float("nan") for tp in flce_diff},
        "training mean loss: flce vs megatron (max abs over steps), per TP": curves,
        "training mean loss: megatron across TP sizes (max abs over steps)": curve_spread,
        "grads within 1.5x of Megatron's bf16 error (CE and RL), every TP": all(
            r["agreement"][path]["grads within 1.5x of Megatron's bf16 error"]
            for r in per_tp.values() for path in ("loss", "rl")),
    }


def markdown(header: str, per_tp: dict[int, dict[str, Any]], verdict: dict[str, Any]) -> str:
    lines = [header, "", "| TP | path | method | per-token max abs err vs fp32 | worst grad rel err vs fp32 | "
             "train step ms | train peak MiB | loss step ms (median) | loss step peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tp, r in sorted(per_tp.items()):
        for path, label in (("loss", "CE"), ("rl", "RL")):
            for method in ("megatron", "flce"):
                err = r["agreement"][path][method]
                outs = ", ".join(f"{k} {v:.2e}" for k, v in err["outputs_max_abs_error"].items())
                train = r["training"][method] if path == "loss" else {}
                step_ms = f"{train['step_ms_median']:.1f}" if train else ""
                step_mib = f"{train['peak_mib']:.0f}" if train else ""
                timing = r["loss step"][f"{label} {method}"]
                lines.append(
                    f"| {tp} | {label} | {method} | {outs} | {err['worst_grad_error']:.2e} ({err['worst_grad']}) | "
                    f"{step_ms} | {step_mib} | {timing['median_ms']:.2f} | {timing['peak_mib_above_start']:.0f} |")
    lines += [""] + [f"- {name}: {value}" for name, value in verdict.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", default=None, help="comma-separated TP sizes (default: 1, 2, 4 ... <= world)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (GPU), 32 (CPU)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=None, help="default 128256 (GPU), 64 (CPU)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (GPU), 8 (CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 (GPU), fp32 (CPU)")
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
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    world = dist.get_world_size()
    sizes = [int(t) for t in args.tp.split(",")] if args.tp else [t for t in (1, 2, 4, 8, 16) if t <= world]
    out = Path(args.out) if args.out else None
    from megatron.core import __version__ as megatron_version

    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    header = (f"{world} x {name}, {dist.get_backend()}, torch {torch.__version__}, megatron-core {megatron_version}, "
              f"{dtype} (reference fp32), layers={args.layers} hidden={args.hidden} heads={args.heads} "
              f"vocab={args.vocab} seq={args.seq} batch={args.batch}, sequence parallel where TP > 1, "
              f"{'attention + MLP' if on_gpu else 'MLP-only'} layers, RL temperature {args.temperature}")
    per_tp: dict[int, dict[str, Any]] = {}
    for tp in sizes:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        if on_gpu:
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        result, model = agreement(args, tp, device, dtype)
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
        per_tp[tp] = {"agreement": result,
                      "training": {method: train(args, model, state, method == "flce", device)
                                   for method in ("megatron", "flce")},
                      "loss step": time_postprocess(args, model, state, device)}
        del model, state
        parallel_state.destroy_model_parallel()
        verdict = verdicts(per_tp)
        if dist.get_rank() == 0:
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                payload = {"header": header, "per_tp": per_tp, "verdicts": verdict, "args": vars(args)}
                (out / "megatron_client.json").write_text(json.dumps(payload, indent=1, default=str))
            print(f"megatron_client: TP={tp} done", flush=True)
    if dist.get_rank() == 0:
        publish(markdown(header, per_tp, verdict), str(out / "megatron_client.md") if out is not None else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
