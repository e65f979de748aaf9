"""Gradient schedules of the CUDA backend side by side, one GPU, bf16, one process.

For each shape and memory budget: forward+backward with token chunks (each chunk read-modify-writes
the V x H weight gradient) and with vocabulary blocks over all rows (statistics first, then each
block's logits recomputed and its weight-gradient rows written once), as ratios to the 3-GEMM floor
with peak MiB above the gradients; Liger-Kernel's fused linear cross-entropy beside them when it is
importable. Plain loss and the RL objective (log-probs and entropy at temperature 0.7).

    python tools/benchmarks/schedules.py --markdown out.md [--calls rl] [--knob forward_logits=fused ...]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime

import torch
import triton

import flce
from flce.autotune import override_params
from flce.testing.measure import MiB, median_ms, parse_shape, peak_mib_above, publish, shape_inputs

CASES = (  # shape, call, budgets in MiB (None: the default)
    ("8192x4096x128256", "plain", (64, 128, 256, None)),
    ("16384x2048x151936", "plain", (64, 128, 256, None)),
    # The logits are 4.6 GiB: from 6 GiB on all are kept, below that the leading chunks that fit.
    ("16384x4096x151936", "rl", (512, 1024, 2048, 4096, 6144, None)),
)
RL = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--calls", default="plain,rl", help="which calls to run: plain, rl or both")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="an autotune knob set in every run, e.g. forward_logits=fused")
    args = parser.parse_args()
    extra = {name: int(value) if value.isdigit() else value
             for name, value in (knob.split("=", 1) for knob in args.knob)}
    dev = torch.device("cuda")
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    except ImportError:
        liger = None
    rows = ["| shape | call | budget | token chunks | vocabulary blocks | logits kept (planner) | Liger |",
            "|---|---|---|---|---|---|---|"]
    for label, call, budgets in (case for case in CASES if case[1] in args.calls.split(",")):
        x, w, t, g = shape_inputs(*parse_shape(label), dev)
        advantages = torch.randn(x.shape[0], device=dev, generator=g)

        def floor(x=x, w=w) -> None:
            logits = x.detach() @ w.detach().t()
            logits @ w.detach()
            logits.t() @ x.detach()

        floor_ms = median_ms(floor, warmup_ms=100, rep_ms=600)
        for budget in budgets:
            cells = []
            # (grad_schedule, logits-save limit): the two recompute schedules with nothing kept, and
            # for RL the planner's own choice where the budget (or the default limit) keeps logits.
            runs = [("token_chunks", 0), ("vocab_blocks", 0)]
            if call == "rl":
                runs.append((None, None if budget is None else budget * MiB))
            for schedule, limit in runs:
                options = dict(RL if call == "rl" else {}, memory_budget=None if budget is None else budget * MiB)

                def step(x=x, w=w, t=t, options=options, advantages=advantages):
                    out = flce.linear_cross_entropy(x, w, t, **options)
                    objective = out if isinstance(out, torch.Tensor) else (
                        -(advantages * out.logprobs).mean() - 0.01 * out.entropy.mean())
                    return torch.autograd.grad(objective, (x, w))

                # The planner with the default budget: exactly what a user gets (shipped cache included).
                as_shipped = schedule is None and limit is None and not extra
                knobs = dict(extra, **({} if schedule is None else {"grad_schedule": schedule}))
                with contextlib.nullcontext() if as_shipped else override_params(
                        knobs, logits_save_limit_bytes=limit, backend="cuda"):
                    ms = median_ms(step, warmup_ms=100, rep_ms=600)
                    mib = peak_mib_above(step)
                cells.append(f"{ms / floor_ms:.3f}x / {mib:.0f}")
            if call != "rl":
                cells.append("")
            if liger is not None and call == "plain" and budget == 64:
                def liger_step(x=x, w=w, t=t):
                    return torch.autograd.grad(liger(w, x, t), (x, w))

                liger_ms = median_ms(liger_step, warmup_ms=100, rep_ms=600)
                cells.append(f"{liger_ms / floor_ms:.3f}x / {peak_mib_above(liger_step):.0f}")
            else:
                cells.append("")
            rows.append(f"| {label} | {call} | {'default' if budget is None else f'{budget} MiB'} | "
                        + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
        del x, w, t
        torch.cuda.empty_cache()
    text = "\n".join([f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
                      f"{datetime.date.today()}, `python tools/benchmarks/schedules.py "
                      f"--calls {args.calls}{''.join(' --knob ' + k for k in args.knob)}`", "",
                      "forward+backward, ratio to the 3-GEMM floor / peak MiB above the gradients "
                      "(logits kept only in the last RL column; RL: -(adv * logp).mean() - 0.01 * entropy.mean()):",
                      "", *rows])
    publish(text, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
