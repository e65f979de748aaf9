"""bf16 single-token losses against float64: torch eager, flce (precision "fast" and "accurate"),
and flce's bound for "fast" (docs/precision.md).

The inputs are drawn as PyTorch's own linear_cross_entropy tests draw theirs (OpInfo
``sample_inputs_linear``: one token, hidden and weight uniform in [-2, 2), in/out features 3/4 and
8/8, a bias or none), and many more at a vocabulary where the softmax is not nearly flat. Each
loss is compared with the float64 loss of the same bf16 values:

* torch eager: ``F.cross_entropy(F.linear(x, W, b), t)`` in bf16 (logits rounded to bf16, the loss
  rounded to bf16);
* flce "fast": the logits rounded to bf16 (as the GEMM writes them), softmax statistics in fp32;
* flce "accurate": fp32 logits from the bf16 operands.

flce's bound for "fast": each logit is off by at most half a bf16 ulp, ``2**-9 |z_c|`` relative, so
``|loss - loss64| <= 2**-9 (max_c |z_c| + |z_y|)`` plus fp32 rounding (a relative ``1e-6``).
torch's tests compare bf16 outputs elementwise with ``rtol=1.6e-2, atol=1e-5``.

    python tools/benchmarks/precision_single_token.py [--device cpu] [--samples 2000] [--vocab 1000]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

import flce

BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5  # torch.testing's defaults for bfloat16
HALF_ULP = 2.0**-9


def single_token_cases(generator: torch.Generator, samples: int, vocab: int):
    """(hidden [1, H], weight [V, H], bias [V] or None, target [1]) in bf16: torch's OpInfo shapes, then
    ``samples`` draws at H = 64 and ``vocab`` classes, uniform in [-2, 2) as torch's make_tensor draws."""
    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 4 - 2).to(torch.bfloat16)

    shapes = [(h, v, bias) for (h, v), bias in itertools.product([(3, 4), (8, 8)], [False, True])]
    shapes += [(64, vocab, bool(i % 2)) for i in range(samples)]
    for h, v, bias in shapes:
        target = torch.randint(0, v, (1,), generator=generator)
        yield uniform(1, h), uniform(v, h) / (h**0.5 if v == vocab else 1.0), uniform(v) if bias else None, target


def errors(hidden, weight, bias, target, device: torch.device) -> dict[str, float]:
    """Absolute errors against float64, the bound for "fast", and torch's bf16 tolerance at this loss."""
    z64 = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    want = F.cross_entropy(z64, target).item()
    on = [None if a is None else a.to(device) for a in (hidden, weight, bias, target)]
    eager = F.cross_entropy(F.linear(on[0], on[1], on[2]), on[3]).item()
    fast = flce.linear_cross_entropy(on[0], on[1], on[3], on[2]).item()
    accurate = flce.linear_cross_entropy(on[0], on[1], on[3], on[2], precision="accurate").item()
    bound = HALF_ULP * (z64.abs().max().item() + z64[0, target.item()].abs().item()) + 1e-6 * abs(want) + 1e-6
    return {"torch eager": abs(eager - want), "flce fast": abs(fast - want), "flce accurate": abs(accurate - want),
            "fast bound": bound, "torch tolerance": BF16_ATOL + BF16_RTOL * abs(want), "loss": abs(want)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    rows = [errors(*case, device) for case in single_token_cases(generator, args.samples, args.vocab)]
    print(f"{len(rows)} single-token bf16 losses on {device}, against float64 of the same bf16 values; "
          f"torch {torch.__version__}")
    print("| method | max abs error | max error / torch's tolerance | beyond torch's tolerance "
          "| max error / fast bound |")
    print("|---|---|---|---|---|")
    for method in ("torch eager", "flce fast", "flce accurate"):
        worst = max(r[method] for r in rows)
        ratio = max(r[method] / r["torch tolerance"] for r in rows)
        beyond = sum(r[method] > r["torch tolerance"] for r in rows)
        of_bound = "-" if method == "torch eager" else f"{max(r[method] / r['fast bound'] for r in rows):.3g}"
        print(f"| {method} | {worst:.3g} | {ratio:.3g} | {beyond} of {len(rows)} | {of_bound} |")


if __name__ == "__main__":
    main()
