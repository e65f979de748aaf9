"""Forward-only benchmark of the CUDA backend's fused forward, one GPU, bf16.

For each shape: one cuBLAS GEMM ``x @ W.T`` (the floor of a forward), the fused statistics kernel
alone for each tile configuration (TFLOP/s beside cuBLAS's), and flce's no-grad calls (plain loss;
RL statistics: reduction="none", log-probs and entropy at temperature 0.7) on the fused path and
on the cuBLAS + row-kernel path, as ratios to the GEMM, with peak working memory above the outputs.
Medians of triton.testing.do_bench, all in one process.

    python tools/benchmarks/fused_forward.py --markdown out.md [--shapes 8192x4096x128256,...] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

import flce
from flce.autotune import override_params
from flce.backends.cuda.configs import GemmConfig, default_gemm_config
from flce.backends.cuda.gemm_ops import gemm_row_stats
from flce.backends.cuda.hardware import describe_device
from flce.config import LCEConfig
from flce.testing.measure import median_ms, parse_shape, peak_mib_above, publish, shape_inputs

SHAPES = ("8192x4096x128256", "16384x2048x151936", "16384x4096x151936")
CONFIGS = (
    GemmConfig(128, 256, 64, 8, 8, 3),
    GemmConfig(128, 256, 64, 8, 8, 4),
    GemmConfig(128, 256, 64, 16, 8, 3),
    GemmConfig(128, 256, 64, 4, 8, 3),
    GemmConfig(256, 128, 64, 8, 8, 4),
    GemmConfig(128, 256, 64, 8, 8, 3, tma=False),
)
RL = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}


def training_rows(label: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, tiles: dict) -> list[str]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()

    def floor() -> None:
        logits = x.detach() @ w.detach().t()
        logits @ w.detach()
        logits.t() @ x.detach()

    floor_ms = median_ms(floor)
    torch.cuda.empty_cache()
    rows = []
    advantages = torch.randn(t.shape[0], device=t.device)
    for name, options, knob in (("plain loss", {}, "forward_logits"), ("RL log-probs + entropy", RL, "forward_stats")):
        cells = []
        for path in ("fused", "cublas"):
            def step(options=options):
                out = flce.linear_cross_entropy(x, w, t, **options)
                objective = out if isinstance(out, torch.Tensor) else (
                    -(advantages * out.logprobs).mean() - 0.01 * out.entropy.mean())
                return torch.autograd.grad(objective, (x, w))

            with override_params(dict(tiles, **{knob: path}), logits_save_limit_bytes=0, backend="cuda"):
                ms = median_ms(step)
                mib = peak_mib_above(step)  # step returns the gradients: MiB above them
            cells.append(f"{ms / floor_ms:.3f}x / {mib:.0f}")
        rows.append(f"| {label} | {name} | {cells[0]} | {cells[1]} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="only the default tile configuration")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    command = f"python tools/benchmarks/fused_forward.py{' --quick' if args.quick else ''}"
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{datetime.date.today()}, `{command}`", ""]
    kernel_rows = ["| shape | config | fused kernel ms | TFLOP/s | cuBLAS GEMM ms | TFLOP/s | kernel / GEMM |",
                   "|---|---|---|---|---|---|---|"]
    call_rows = ["| shape | call | fused: x GEMM / MiB | cuBLAS + row kernels: x GEMM / MiB |", "|---|---|---|---|"]
    train_rows = ["| shape | call | fused forward: x floor / MiB | cuBLAS + row kernels: x floor / MiB |",
                  "|---|---|---|---|"]
    for label in args.shapes.split(","):
        n, h, v = parse_shape(label)
        x, w, t, _ = shape_inputs(n, h, v, dev, requires_grad=False)
        flops = 2.0 * n * h * v
        gemm_ms = median_ms(lambda x=x, w=w: x @ w.t())
        best = None
        configs = [default_gemm_config(describe_device(x.device), x.dtype)] if args.quick else list(CONFIGS)
        for config in configs:
            try:
                ms = median_ms(lambda x=x, w=w, t=t, c=config: gemm_row_stats(x, w, None, t, LCEConfig(), 0, c))
            except (triton.CompilationError, triton.OutOfResources) as error:
                print(f"{label} {config}: {type(error).__name__}", file=sys.stderr)
                continue
            config_label = (f"{config.block_m}x{config.block_n}x{config.block_k} g{config.group_m} w{config.num_warps} "
                            f"s{config.num_stages}{'' if config.tma else ' no-TMA'}")
            kernel_rows.append(f"| {label} | {config_label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {gemm_ms:.3f} | "
                               f"{flops / gemm_ms / 1e9:.0f} | {ms / gemm_ms:.3f} |")
            if best is None or ms < best[1]:
                best = (config, ms)
            print(kernel_rows[-1], flush=True)
        assert best is not None
        tiles = dict(best[0].as_params())
        for name, options in (("plain loss", {}), ("RL log-probs + entropy", RL)):
            cells = []
            for path in ("fused", "cublas"):
                with override_params(dict(tiles, forward_stats=path), backend="cuda"), torch.no_grad():
                    def call(x=x, w=w, t=t, options=options):
                        return flce.linear_cross_entropy(x, w, t, **options)
                    ms = median_ms(call)
                    mib = peak_mib_above(call)
                cells.append(f"{ms / gemm_ms:.3f}x / {mib:.0f}")
            call_rows.append(f"| {label} | {name} | {cells[0]} | {cells[1]} |")
            print(call_rows[-1], flush=True)
        train_rows += training_rows(label, x, w, t, tiles)
        del x, w, t
        torch.cuda.empty_cache()
    lines += ["Fused statistics kernel alone vs one cuBLAS GEMM (bf16 out):", "", *kernel_rows, "",
              "flce forward-only calls (no_grad), ratio to one cuBLAS GEMM / peak MiB above the outputs "
              "(fused path with the best tile configuration above):", "", *call_rows, "",
              "flce forward+backward, ratio to the 3-GEMM floor / peak MiB above the gradients; plain loss: "
              "statistics and logits of each chunk from the fused GEMM (forward_logits) or cuBLAS; RL: "
              "statistics from the fused GEMM (forward_stats), logits recomputed in backward:", "", *train_rows]
    text = "\n".join(lines)
    publish(text, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
