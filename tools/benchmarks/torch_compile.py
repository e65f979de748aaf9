"""torch.compile vs eager flce, and the Hugging Face adapter's memory, on one GPU.

    python tools/benchmarks/torch_compile.py                   # both parts at their default sizes
    python tools/benchmarks/torch_compile.py --skip-hf --tokens 4096 --vocab 32000

Part 1, compiled step: forward+backward of flce at tokens x hidden x vocab in --dtype, eager (the
module) vs ``torch.compile(fullgraph=True)`` of the same forward (AOTAutograd compiles the
backward). Median ms (triton.testing.do_bench through flce.testing.measure), ratio to the 3-GEMM
floor measured here, peak memory above the gradients ((V*H + BT*H) * element size), and
``torch._dynamo.explain``'s graph and graph-break counts for the step.

Part 2, Hugging Face: forward+backward of a small random Llama (vocab 128256, bf16) with labels:
peak memory and time, unpatched vs ``flce.integrations.transformers.apply``, and their losses.

Prints a table; with $OUT set, writes $OUT/bench_compile.json and $OUT/bench_compile.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from collections.abc import Callable
from typing import Any

import torch

import flce
from flce.testing.measure import floor_gradient, median_ms, peak_mib_above, shape_inputs


def compiled_step(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, warmup: int, rep: int) -> dict[str, Any]:
    x, w, t, g = shape_inputs(tokens, hidden, vocab, "cuda", dtype)
    loss_fn = flce.get_impl("cuda")()

    def forward(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(x, w, t)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(forward)(x, w, t)
    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True)

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            x.grad = w.grad = None
            loss = fn(x, w, t)
            loss.backward()
            return loss
        return run

    eager_loss, compiled_loss = step(forward)().detach(), step(compiled)().detach()  # the second one compiles
    row: dict[str, Any] = {
        "shape": f"{tokens}x{hidden}x{vocab}", "dtype": str(dtype).removeprefix("torch."),
        "graph_count": explanation.graph_count, "graph_break_count": explanation.graph_break_count,
        "break_reasons": [str(r.reason) for r in explanation.break_reasons],
        "loss_abs_diff": float((eager_loss.float() - compiled_loss.float()).abs()),
    }
    for name, fn in (("eager", step(forward)), ("compiled", step(compiled))):
        row[f"{name}_ms"] = median_ms(fn, warmup_ms=warmup, rep_ms=rep)
        x.grad = w.grad = None
        gc.collect()
        row[f"{name}_peak_mib_above_grads"] = peak_mib_above(fn)  # fn leaves the gradients in .grad

    # The floor: the three GEMMs every forward+backward needs, on the same shapes.
    grad_logits = floor_gradient(tokens, vocab, dtype, "cuda", generator=g)
    xd, wd = x.detach(), w.detach()

    def gemms() -> None:
        torch.mm(xd, wd.t())
        torch.mm(grad_logits, wd)
        torch.mm(grad_logits.t(), xd)

    row["floor_ms"] = median_ms(gemms, warmup_ms=warmup, rep_ms=rep)
    row["eager_vs_floor"] = row["eager_ms"] / row["floor_ms"]
    row["compiled_vs_floor"] = row["compiled_ms"] / row["floor_ms"]
    row["compiled_vs_eager"] = row["compiled_ms"] / row["eager_ms"]
    return row


def hf_llama_memory(batch: int, seq: int, hidden: int, layers: int, vocab: int, rep: int) -> dict[str, Any]:
    import transformers

    from flce.integrations import transformers as flce_hf

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), max_position_embeddings=seq,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise on the GPU: the 128k-row embeddings are slow to fill on the CPU
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    g = torch.Generator(device="cuda").manual_seed(1)
    input_ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    labels = input_ids.clone()
    labels[:, :8] = -100

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    def measure() -> dict[str, float]:
        loss = float(step())  # also the warm-up: cuBLAS workspaces, Triton compilation
        model.zero_grad(set_to_none=True)
        gc.collect()
        peak = peak_mib_above(step, include_kept=True)  # the whole step: gradients included
        model.zero_grad(set_to_none=True)
        return {"loss": loss, "peak_mib": peak, "ms": median_ms(step, warmup_ms=1, rep_ms=rep)}

    row: dict[str, Any] = {
        "model": f"Llama {layers} layers, hidden {hidden}, vocab {vocab}, bf16",
        "batch_x_seq": f"{batch}x{seq}", "transformers": transformers.__version__,
    }
    unpatched = measure()
    flce_hf.apply(model)
    patched = measure()
    flce_hf.remove(model)
    for name, result in (("unpatched", unpatched), ("patched", patched)):
        for key, value in result.items():
            row[f"{name}_{key}"] = value
    row["peak_reduction"] = 1.0 - patched["peak_mib"] / unpatched["peak_mib"]
    row["loss_abs_diff"] = abs(patched["loss"] - unpatched["loss"])
    return row


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"Measured {results['date']} on {results['device']}, torch {results['torch']}.", ""]
    if "compile" in results:
        c = results["compile"]
        lines += [
            f"Compiled step, {c['shape']} {c['dtype']}, forward+backward "
            f"(torch._dynamo.explain: {c['graph_count']} graph, {c['graph_break_count']} breaks):",
            "",
            "| | ms | x floor | peak MiB above grads |",
            "|---|---|---|---|",
            f"| 3-GEMM floor | {c['floor_ms']:.2f} | 1.00 | |",
            f"| flce eager | {c['eager_ms']:.2f} | {c['eager_vs_floor']:.2f} | {c['eager_peak_mib_above_grads']:.0f} |",
            f"| flce torch.compile | {c['compiled_ms']:.2f} | {c['compiled_vs_floor']:.2f} "
            f"| {c['compiled_peak_mib_above_grads']:.0f} |",
            "",
        ]
    if "hf" in results:
        h = results["hf"]
        lines += [
            f"Hugging Face {h['model']}, batch x seq {h['batch_x_seq']}, forward+backward with labels "
            f"(transformers {h['transformers']}):",
            "",
            "| | peak MiB | ms | loss |",
            "|---|---|---|---|",
            f"| unpatched | {h['unpatched_peak_mib']:.0f} | {h['unpatched_ms']:.1f} | {h['unpatched_loss']:.4f} |",
            f"| flce_hf.apply | {h['patched_peak_mib']:.0f} | {h['patched_ms']:.1f} | {h['patched_loss']:.4f} |",
            "",
            f"Peak memory {100 * h['peak_reduction']:.0f}% lower.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=1000)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-batch", type=int, default=4)
    parser.add_argument("--hf-seq", type=int, default=2048)
    parser.add_argument("--hf-hidden", type=int, default=2048)
    parser.add_argument("--hf-layers", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py needs a CUDA GPU")

    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "flce": flce.__version__,
    }
    if not args.skip_compile:
        results["compile"] = compiled_step(args.tokens, args.hidden, args.vocab, getattr(torch, args.dtype),
                                           args.warmup_ms, args.rep_ms)
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_hf:
        results["hf"] = hf_llama_memory(args.hf_batch, args.hf_seq, args.hf_hidden, args.hf_layers, 128256,
                                        args.rep_ms)
    markdown = _markdown(results)
    print(markdown)
    print(json.dumps(results, indent=2))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_compile.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(out, "bench_compile.md"), "w") as f:
            f.write(markdown)


if __name__ == "__main__":
    main()
