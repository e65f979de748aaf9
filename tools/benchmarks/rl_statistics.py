"""The RL statistics (log-probs and entropy at a temperature), label smoothing's sum and the logit
options (softcap, bias, class weights) on the warp-specialised statistics GEMM against the fused Triton
one, side by side, one GPU, bf16, one process.

The RL call: ``reduction="none"``, log-probs and entropy at temperature 0.7, objective
``-(adv * logp).mean() - 0.01 * entropy.mean()``. Per shape, in each of ``--rounds`` rounds, the
references first (one cuBLAS ``x @ W.T``; with ``--training`` the three cuBLAS products, the floor),
then each variant in turn, so the kernels alternate:

* forward only (``no_grad``), ratio to one cuBLAS GEMM: the statistics GEMM by ``stats_kernel``, also
  with the predicted tokens (the argmax), the plain loss with label smoothing 0.1 on both, and for
  reference the ws GEMM with the log-probs alone and with the plain loss;
* with ``--training``: the RL call fwd+bwd within 512 MiB (nothing of the logits kept: a statistics
  pass, then recomputed vocabulary blocks) and with the default memory (the logits kept where the
  save limit allows: the chunk GEMM also writes them), ratio to the floor, with MiB above the
  gradients;
* with ``--smoothing`` shapes: the mean loss with label smoothing 0.1, fwd+bwd at the default memory, its
  chunk logits from the ws GEMM, the Triton GEMM or cuBLAS + the row kernel (``forward_logits``);
* with ``--logit-options`` shapes: a softcap of 30 with a bias (a Gemma-2-like head) and label smoothing
  0.1 with class weights, each forward only (ws / Triton statistics GEMM, x one cuBLAS GEMM) and fwd+bwd
  (mean, default memory, chunk logits from each source as for ``--smoothing``, x the floor).

* with ``--objective`` shapes: the same RL objective handed to the call (``token_weights`` = the advantages,
  ``entropy_weight`` = 0.01: a scalar loss, its gradient formed in the forward) fwd+bwd at the default memory,
  chunk logits from each source as for ``--smoothing``, also (ws only) returning the log-probs and the entropy
  detached (``detach_extras=True``), and its loss and gradients against the composed ones; and the objective
  without the entropy term (its gradient a row multiple of softmax - onehot) on the ws GEMM keeping exponentials
  (the default) or its logits.

The last columns: how far the ws variant's outputs (log-probs, entropy; gradients) are from the Triton
one's, as relative Frobenius norms.

    python tools/benchmarks/rl_statistics.py [--shapes 8192x4096x128256,...] [--training 16384x4096x151936]
                                             [--smoothing 16384x2048x151936] [--logit-options 16384x2048x151936]
                                             [--objective 16384x4096x151936] [--rounds 3] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

import flce
from flce.autotune import override_params
from flce.testing.measure import (
    cublas_products_ms,
    median_ms,
    parse_shape,
    peak_mib_above,
    publish,
    relative_difference,
    shape_inputs,
)

RL = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}
SMOOTHING = {"label_smoothing": 0.1}
KERNELS = {"ws": "warp_specialized", "Triton": "triton"}
TRAINING_BUDGETS = {"512 MiB": 512 << 20, "default": None}


def _cell(values: list[float]) -> str:
    """Median ratio with the rounds' range."""
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


# Forward-only variants: (options, statistics GEMM). The RL statistics with the argmax (predicted
# tokens) on both GEMMs; the plain loss and the log-probs alone on the ws GEMM show, in the same
# process, what the temperature and the entropy's sum add to its epilogue.
FORWARD_VARIANTS = {
    "ws": (RL, "warp_specialized"),
    "Triton": (RL, "triton"),
    "ws, + predicted tokens": ({**RL, "return_predicted_tokens": True}, "warp_specialized"),
    "Triton, + predicted tokens": ({**RL, "return_predicted_tokens": True}, "triton"),
    "ws, label smoothing": (SMOOTHING, "warp_specialized"),
    "Triton, label smoothing": (SMOOTHING, "triton"),
    "ws, log-probs only": ({"reduction": "none", "temperature": 0.7, "return_logprobs": True}, "warp_specialized"),
    "ws, plain loss": ({}, "warp_specialized"),
}
# Where a training chunk's logits come from (knobs of the cuda plan). The ws GEMM keeps exponentials instead of
# logits where the gradient is a row multiple of softmax - onehot; "ws, logits kept" asks for the logits there.
CHUNK_LOGITS = {"ws": {"forward_logits": "fused", "logits_kernel": "warp_specialized"},
                "Triton": {"forward_logits": "fused", "logits_kernel": "triton"},
                "cuBLAS + row kernel": {"forward_logits": "cublas"},
                "ws, logits kept": {"forward_logits": "fused", "logits_kernel": "warp_specialized",
                                    "chunk_grad": "logits"}}
SOURCES = ("ws", "Triton", "cuBLAS + row kernel")


def forward_rows(label: str, rounds: int) -> list[str]:
    x, w, t, _ = shape_inputs(*parse_shape(label), requires_grad=False)

    def forward(name: str):
        options, kernel = FORWARD_VARIANTS[name]
        with torch.no_grad(), override_params({"forward_stats": "fused", "stats_kernel": kernel}, backend="cuda"):
            return flce.linear_cross_entropy(x, w, t, **options)

    ratios: dict[str, list[float]] = {name: [] for name in FORWARD_VARIANTS}
    for _ in range(rounds):
        gemm = median_ms(lambda: x @ w.T, rep_ms=600)
        for name in FORWARD_VARIANTS:
            ratios[name].append(median_ms(lambda name=name: forward(name), rep_ms=600) / gemm)
    ws, tri = forward("ws"), forward("Triton")
    diff = f"{relative_difference(ws.logprobs, tri.logprobs):.1e} / {relative_difference(ws.entropy, tri.entropy):.1e}"
    return [f"| {label} | forward only | {name} | {_cell(ratios[name])} | | {diff if name == 'ws' else ''} |"
            for name in FORWARD_VARIANTS]


def training_rows(label: str, rounds: int) -> list[str]:
    x, w, t, g = shape_inputs(*parse_shape(label))
    adv = torch.randn(x.shape[0], device=x.device, generator=g)

    def step(kernel: str, budget: int | None):
        knobs = {"stats_kernel": kernel, "logits_kernel": kernel}
        with override_params(knobs, backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, memory_budget=budget, **RL)
            objective = -(adv * out.logprobs).mean() - 0.01 * out.entropy.mean()
            return (out.logprobs.detach(), out.entropy.detach(), *torch.autograd.grad(objective, (x, w)))

    cases = [(b, k) for b in TRAINING_BUDGETS for k in KERNELS]
    ratios: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for _ in range(rounds):
        floor = sum(cublas_products_ms(x, w))
        for budget, name in cases:
            fn = lambda b=TRAINING_BUDGETS[budget], k=KERNELS[name]: step(k, b)  # noqa: E731
            ratios[(budget, name)].append(median_ms(fn, warmup_ms=200, rep_ms=1500) / floor)
    rows = []
    for budget, limit in TRAINING_BUDGETS.items():
        ws, tri = step(KERNELS["ws"], limit), step(KERNELS["Triton"], limit)
        diff = " / ".join(f"{relative_difference(a, b):.1e}" for a, b in zip(ws, tri, strict=True))
        del ws, tri
        for name, kernel in KERNELS.items():
            peak = peak_mib_above(lambda kernel=kernel, limit=limit: step(kernel, limit))
            rows.append(f"| {label} | RL fwd+bwd, {budget} | {name} | {_cell(ratios[(budget, name)])} | {peak:.0f} | "
                        f"{diff if name == 'ws' else ''} |")
    return rows


def logit_option_sets(vocab: int, generator: torch.Generator) -> dict[str, tuple[dict, torch.Tensor | None]]:
    """The --logit-options calls at one vocabulary: name -> (options, bias or None)."""
    bias = torch.randn(vocab, device="cuda", generator=generator).to(torch.bfloat16).requires_grad_()
    weights = torch.rand(vocab, device="cuda", generator=generator) + 0.5
    return {"softcap 30 + bias": ({"softcap": 30.0}, bias),
            "label smoothing + class weights": ({**SMOOTHING, "class_weight": weights}, None)}


def option_forward_rows(label: str, rounds: int) -> list[str]:
    x, w, t, g = shape_inputs(*parse_shape(label), requires_grad=False)
    variants = {(name, kernel): case for name, case in logit_option_sets(w.shape[0], g).items() for kernel in KERNELS}

    def forward(name: str, kernel: str):
        options, bias = variants[(name, kernel)]
        knobs = {"forward_stats": "fused", "stats_kernel": KERNELS[kernel]}
        with torch.no_grad(), override_params(knobs, backend="cuda"):
            return flce.linear_cross_entropy(x, w, t, bias, reduction="none", **options)

    ratios: dict[tuple[str, str], list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        gemm = median_ms(lambda: x @ w.T, rep_ms=600)
        for variant in variants:
            ratios[variant].append(median_ms(lambda v=variant: forward(*v), rep_ms=600) / gemm)
    rows = []
    for name, kernel in variants:
        diff = ""
        if kernel == "ws":  # once an option set: its two kernels' losses
            diff = f"{relative_difference(forward(name, 'ws'), forward(name, 'Triton')):.1e} (losses)"
        rows.append(f"| {label} | {name}, forward only | {kernel} | {_cell(ratios[(name, kernel)])} | | {diff} |")
    return rows


def chunk_logits_rows(label: str, rounds: int, call: str, options: dict, bias: torch.Tensor | None,
                      inputs: tuple | None = None, sources: tuple[str, ...] = SOURCES) -> list[str]:
    """The mean loss with ``options`` fwd+bwd at the default memory, its chunk logits from each of ``sources`` (names
    in CHUNK_LOGITS), x the floor; the ws variant's loss and gradients against cuBLAS + the row kernel's, else against
    the ws GEMM keeping logits, where ``sources`` has them. With ``return_*`` options only the loss is
    differentiated."""
    x, w, t, _ = inputs or shape_inputs(*parse_shape(label))
    leaves = (x, w) if bias is None else (x, w, bias)

    def step(knobs: dict):
        with override_params(knobs, backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, bias, **options)
            loss = out.loss if isinstance(out, flce.LCEOutput) else out
            return (loss.detach(), *torch.autograd.grad(loss, leaves))

    ratios: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(rounds):
        floor = sum(cublas_products_ms(x, w))
        for name in sources:
            knobs = CHUNK_LOGITS[name]
            ratios[name].append(median_ms(lambda knobs=knobs: step(knobs), warmup_ms=200, rep_ms=1500) / floor)
    diff = ""
    against = next((name for name in ("cuBLAS + row kernel", "ws, logits kept") if name in sources), None)
    if "ws" in sources and against:
        ws, other = step(CHUNK_LOGITS["ws"]), step(CHUNK_LOGITS[against])
        diff = " / ".join(f"{relative_difference(a, b):.1e}" for a, b in zip(ws, other, strict=True))
        del ws, other
    rows = []
    for name in sources:
        knobs = CHUNK_LOGITS[name]
        peak = peak_mib_above(lambda knobs=knobs: step(knobs))
        rows.append(f"| {label} | {call} fwd+bwd, default | {name} | {_cell(ratios[name])} | {peak:.0f} | "
                    f"{diff + f' (loss / grads, against {against})' if name == 'ws' and diff else ''} |")
    return rows


def objective_rows(label: str, rounds: int) -> list[str]:
    """The RL objective handed to the call (token_weights = the advantages, entropy_weight = 0.01: a scalar loss
    whose gradient forms in the forward) fwd+bwd at the default memory, its chunk logits from each of
    CHUNK_LOGITS; and how far its loss and gradients are from the same objective composed from the call's
    log-probs and entropy (training_rows' objective), as relative Frobenius norms."""
    inputs = shape_inputs(*parse_shape(label))
    x, w, t, g = inputs
    adv = torch.randn(x.shape[0], device=x.device, generator=g)
    # training_rows' objective takes .mean() over all rows; the call's mean is over the counted ones.
    share = float((t != -100).sum()) / t.numel()
    options = {"temperature": RL["temperature"], "token_weights": adv * share, "entropy_weight": 0.01 * share}
    rows = chunk_logits_rows(label, rounds, "RL objective in the call", options, None, inputs)
    # A trainer that logs the log-probs and the entropy beside it, detached: still in the forward.
    rows += chunk_logits_rows(label, rounds, "RL objective in the call, log-probs + entropy detached",
                              dict(options, return_logprobs=True, return_entropy=True, detach_extras=True), None,
                              inputs, sources=("ws",))
    # Without the entropy term the gradient is a row multiple of softmax - onehot: kept exponentials, against
    # the same call keeping its logits.
    rows += chunk_logits_rows(label, rounds, "RL objective in the call without the entropy term",
                              dict(options, entropy_weight=0.0), None, inputs, sources=("ws", "ws, logits kept"))
    loss = flce.linear_cross_entropy(x, w, t, **options)
    in_call = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    out = flce.linear_cross_entropy(x, w, t, **RL)
    composed = -(adv * out.logprobs).mean() - 0.01 * out.entropy.mean()
    composed = (composed.detach(), *torch.autograd.grad(composed, (x, w)))
    diff = " / ".join(f"{relative_difference(a, b):.1e}" for a, b in zip(in_call, composed, strict=True))
    return rows + [f"| {label} | RL objective in the call against composed | | | | {diff} (loss / grads) |"]


def option_training_rows(label: str, rounds: int) -> list[str]:
    inputs = shape_inputs(*parse_shape(label))
    rows = []
    for name, (options, bias) in logit_option_sets(inputs[1].shape[0], inputs[3]).items():
        rows += chunk_logits_rows(label, rounds, name, options, bias, inputs)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x4096x128256,16384x2048x151936,16384x4096x151936")
    parser.add_argument("--training", default="16384x4096x151936", help="shapes of the fwd+bwd rows ('' for none)")
    parser.add_argument("--smoothing", default="", help="shapes of the label-smoothing fwd+bwd rows")
    parser.add_argument("--logit-options", default="", help="shapes of the softcap/bias/class-weight rows")
    parser.add_argument("--objective", default="", help="shapes of the rows of the RL objective in the call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp}, {args.rounds} rounds", "",
             "| shape N x H x V | call | statistics GEMM | x one cuBLAS GEMM (forward) / x the floor, median "
             "(range) | MiB above grads | ws vs Triton: rel. diff logp / entropy (/ grad_hidden / grad_weight) |",
             "|---|---|---|---|---|---|"]
    for label in filter(None, args.shapes.split(",")):
        lines += forward_rows(label, args.rounds)
        torch.cuda.empty_cache()
    for label in filter(None, args.training.split(",")):
        lines += training_rows(label, args.rounds)
        torch.cuda.empty_cache()
    for label in filter(None, args.smoothing.split(",")):
        lines += chunk_logits_rows(label, args.rounds, "label smoothing", SMOOTHING, None)
        torch.cuda.empty_cache()
    for label in filter(None, args.objective.split(",")):
        lines += objective_rows(label, args.rounds)
        torch.cuda.empty_cache()
    for label in filter(None, args.logit_options.split(",")):
        lines += option_forward_rows(label, args.rounds) + option_training_rows(label, args.rounds)
        torch.cuda.empty_cache()
    publish("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
