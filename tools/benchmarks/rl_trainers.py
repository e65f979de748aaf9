"""flce against the RL trainers' fused log-prob kernels: verl's, AReaL's, TRL's and Liger's (one GPU, bf16).

For each shape N x H x V, at temperature 0.7, every implementation computes per-token log-probs and
entropy of ``hidden @ weight.T / T``:

* forward only (reference / rollout log-probs, under ``torch.no_grad``);
* forward + backward through the policy loss ``-(adv * logp).mean() - 0.01 * entropy.mean()``
  into ``hidden`` and ``weight``;

and the table gives the median time (ms, CUDA events), the ratio to the floor (one cuBLAS GEMM for
a forward, the three GEMMs ``x @ W.T``, ``G @ W``, ``G.T @ x`` for a step, timed in the same
process), the peak memory above inputs and what the call returns (MiB), and the agreement with
float64 (relative norm error of log-probs and entropy on the first 1024 tokens, of ``grad_hidden``
on those tokens, and of ``grad_weight``, float64 over all tokens in chunks).

The peers run from their PyPI wheels, carried: ``verl`` 0.9.1 and ``trl`` 1.16.0 without their
dependencies (only the kernel modules are loaded, with the handful of names they import from
their packages stubbed), ``liger-kernel`` 0.8.5 (its scaled cross-entropy needs the CUTLASS DSL
on SM90; without it Liger is reported as unavailable), and AReaL's kernel from its pull request
1322 (``areal/models/kernel``: ``--areal-kernel-dir``), which no release contains yet.

    python tools/benchmarks/rl_trainers.py [--shapes 16384x4096x151936,8192x4096x151936]
        [--areal-kernel-dir DIR] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import flce
from flce.testing.measure import MiB, median_ms, peak_mib_above, publish, relative_difference

TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
CHECKED_ROWS = 1024
# TRL's add_fused_lm_head passes this vocabulary tile width (trl/trainer/utils.py).
TRL_CHUNK_SIZE = 32768

# An implementation: (hidden, weight, targets) -> (logprobs [N] fp32, entropy [N] fp32).
LogprobFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- the peers

def _stub_package(name: str, path: Path | None) -> None:
    module = types.ModuleType(name)
    if path is not None:
        module.__path__ = [str(path)]
    sys.modules[name] = module


def verl_kernel() -> LogprobFn:
    """verl's Triton ``linear_cross_entropy``; ``import verl`` needs ray, so its package and the
    four device helpers its kernel module imports are stubbed."""
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    _stub_package("verl", root)
    _stub_package("verl.utils", root / "utils")
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_capability = torch.cuda.get_device_capability
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    sys.modules["verl.utils.device"] = device
    entry = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    return lambda x, w, t: entry.linear_cross_entropy(x, w, t, TEMPERATURE, "none")


def areal_kernel(kernel_dir: Path) -> LogprobFn:
    """AReaL's ``areal.models.kernel.linear_cross_entropy`` from its PR 1322 files in ``kernel_dir``
    (``kernels.py``, ``linear_cross_entropy.py``); the package __init__ (which imports the rest of
    AReaL) is stubbed."""
    _stub_package("areal", None)
    _stub_package("areal.models", None)
    _stub_package("areal.models.kernel", kernel_dir)
    entry = importlib.import_module("areal.models.kernel.linear_cross_entropy")
    return lambda x, w, t: entry.linear_cross_entropy(x, w, t, TEMPERATURE, "none")


def trl_function() -> LogprobFn:
    module = importlib.import_module("trl.kernels.chunked_logprob")
    utils = types.ModuleType("trl.trainer.utils")  # what its backward imports: the ZeRO-3 gather, a no-op here
    utils.maybe_gather_lm_head_ctx = lambda *params: __import__("contextlib").nullcontext()
    sys.modules["trl.trainer.utils"] = utils

    def call(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = module.ChunkedLogProbFunction.apply(x, w, None, t, TEMPERATURE, TRL_CHUNK_SIZE, None, 1.0,
                                                  ("log_probs", "entropy"))
        return out[0], out[1]

    return call


def liger_function() -> LogprobFn:
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction

    def call(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, t, TEMPERATURE, -100, 1, True)
        return -nll, entropy

    return call


def flce_function(**options: Any) -> LogprobFn:
    """flce with ``options`` beside the RL call's (memory_budget, return_logit_stats, batch_invariant)."""
    def call(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = flce.linear_cross_entropy(x, w, t, reduction="none", temperature=TEMPERATURE, return_logprobs=True,
                                        return_entropy=True, **options)
        return out.logprobs, out.entropy

    return call


def flce_areal_dropin() -> LogprobFn:
    """flce.integrations.areal as AReaL's engine calls it (max logits on every call)."""
    from flce.integrations.areal import linear_cross_entropy_logprobs_entropy

    def call(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy, _max_logits = linear_cross_entropy_logprobs_entropy(x, w, t, TEMPERATURE, None, True)
        return logprobs, entropy

    return call


def peers(areal_dir: Path | None, only: str | None = None) -> dict[str, LogprobFn | str]:
    """name -> implementation, or the reason it could not be loaded; ``only``: comma-separated
    names separated by ";", the others are left out."""
    loaders: dict[str, Callable[[], LogprobFn] | None] = {
        "flce": flce_function,
        "flce, memory_budget 128 MiB": lambda: flce_function(memory_budget=128 * MiB),
        "flce, memory_budget 256 MiB": lambda: flce_function(memory_budget=256 * MiB),
        "flce, memory_budget 512 MiB": lambda: flce_function(memory_budget=512 * MiB),
        "flce, memory_budget 2 GiB": lambda: flce_function(memory_budget=2048 * MiB),
        "flce + return_logit_stats": lambda: flce_function(return_logit_stats=True),
        "flce, batch_invariant": lambda: flce_function(batch_invariant=True),
        "flce's AReaL drop-in (return_max_logits)": flce_areal_dropin,
        "verl (Triton)": verl_kernel,
        "AReaL (Triton, PR 1322)": (lambda: areal_kernel(areal_dir)) if areal_dir else None,
        "TRL chunked": trl_function,
        "Liger scaled CE": liger_function,
    }
    found: dict[str, LogprobFn | str] = {}
    for name, load in loaders.items():
        if only and name not in only.split(";"):
            continue
        if load is None:
            found[name] = "no --areal-kernel-dir"
            continue
        try:
            found[name] = load()
        except Exception as exc:  # a peer that fails to load is reported, not fatal
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


# --------------------------------------------------------------------------- float64 reference

@torch.no_grad()
def float64_reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, adv: torch.Tensor,
                      chunk: int = 1024) -> dict[str, torch.Tensor]:
    """Log-probs and entropy of the first CHECKED_ROWS tokens, grad_hidden of those tokens and
    grad_weight over all tokens of the policy loss, in float64, ``chunk`` tokens at a time."""
    n = x.shape[0]
    w64 = w.double()
    grad_w = torch.zeros_like(w64)
    ref: dict[str, torch.Tensor] = {}
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        x64 = x[rows].double()
        z = (x64 @ w64.T) / TEMPERATURE
        log_p = torch.log_softmax(z, dim=-1)
        p = log_p.exp()
        entropy = -(p * log_p).sum(-1)
        logp = log_p.gather(1, t[rows, None]).squeeze(1)
        # d loss / d z: logp part -adv/n (onehot - p), entropy part -coef/n * (-p (log p + H)).
        g_logp = (-adv[rows].double() / n)[:, None]
        g_ent = -ENTROPY_COEF / n
        grad_z = g_logp * (torch.zeros_like(p).scatter_(1, t[rows, None], 1.0) - p)
        grad_z -= g_ent * p * (log_p + entropy[:, None])
        grad_z /= TEMPERATURE
        grad_w += grad_z.T @ x64
        if start < CHECKED_ROWS:
            ref.setdefault("logit_stats", []).append(torch.stack([z.amax(-1), z.amin(-1), z.mean(-1)], -1))
            ref.setdefault("logprobs", []).append(logp)
            ref.setdefault("entropy", []).append(entropy)
            ref.setdefault("grad_hidden", []).append(grad_z @ w64)
    out = {k: torch.cat(v)[:CHECKED_ROWS] for k, v in ref.items()}
    out["grad_weight"] = grad_w
    return out


# --------------------------------------------------------------------------- timing

def shape_rows(label: str, implementations: dict[str, LogprobFn | str]) -> list[str]:
    n, h, v = (int(p) for p in label.split("x"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + h + v)
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    # logits of std ~2 at T = 0.7: peaked enough that log-probs and entropy vary per token.
    w = (torch.randn(v, h, device=dev, generator=g) * (1.4 / h**0.5)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    adv = torch.randn(n, device=dev, generator=g)
    xd, wd = x.detach(), w.detach()
    gemm_ms = median_ms(lambda: xd @ wd.T, warmup_ms=100, rep_ms=500)

    def three_gemms() -> None:
        logits = xd @ wd.T
        logits @ wd
        logits.T @ xd

    floor_ms = median_ms(three_gemms, warmup_ms=100, rep_ms=500)
    ref = float64_reference(xd, wd, t, adv)
    rows = [f"| {label} | floor (cuBLAS) | {gemm_ms:.2f} | 1.00x | - | {floor_ms:.2f} | 1.00x | - | - |"]
    for name, fn in implementations.items():
        if isinstance(fn, str):
            rows.append(f"| {label} | {name} | unavailable: {fn[:120]} | | | | | | |")
            continue

        def forward(fn: LogprobFn = fn) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                return fn(xd, wd, t)

        def step(fn: LogprobFn = fn) -> tuple[torch.Tensor, ...]:
            logp, entropy = fn(x, w, t)
            loss = -(adv * logp).mean() - ENTROPY_COEF * entropy.mean()
            return torch.autograd.grad(loss, (x, w)) + (logp.detach(), entropy.detach())

        try:
            fwd_ms, fwd_mib = median_ms(forward), peak_mib_above(forward)
            step_ms, step_mib = median_ms(step), peak_mib_above(step)
            grad_x, grad_w, logp, entropy = step()
            agreement = (f"{relative_difference(logp[:CHECKED_ROWS], ref['logprobs']):.1e} / "
                         f"{relative_difference(entropy[:CHECKED_ROWS], ref['entropy']):.1e} / "
                         f"{relative_difference(grad_x[:CHECKED_ROWS], ref['grad_hidden']):.1e} / "
                         f"{relative_difference(grad_w, ref['grad_weight']):.1e}")
            del grad_x, grad_w, logp, entropy
        except Exception as exc:  # a peer that fails at this shape is reported, not fatal
            rows.append(f"| {label} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | | | |")
            torch.cuda.empty_cache()
            continue
        rows.append(f"| {label} | {name} | {fwd_ms:.2f} | {fwd_ms / gemm_ms:.2f}x | {fwd_mib:.0f} | {step_ms:.2f} | "
                    f"{step_ms / floor_ms:.2f}x | {step_mib:.0f} | {agreement} |")
        torch.cuda.empty_cache()
    with torch.no_grad():
        stats = flce.linear_cross_entropy(xd[:CHECKED_ROWS], wd, t[:CHECKED_ROWS], reduction="none",
                                          temperature=TEMPERATURE, return_logit_stats=True).logit_stats
    errors = " / ".join(f"{relative_difference(stats[:, i], ref['logit_stats'][:, i]):.1e}" for i in range(3))
    rows.append(f"| {label} | return_logit_stats vs float64 (max / min / mean of z) | {errors} | | | | | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x4096x151936,8192x4096x151936")
    parser.add_argument("--areal-kernel-dir", type=Path, default=None)
    parser.add_argument("--only", default=None, help="implementation names separated by \";\" (default: all)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    implementations = peers(args.areal_kernel_dir, args.only)
    header = [
        f"{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, bf16, "
        f"temperature {TEMPERATURE}, loss -(adv*logp).mean() - {ENTROPY_COEF}*entropy.mean()",
        "",
        "| N x H x V | implementation | fwd ms | fwd / GEMM | fwd MiB | fwd+bwd ms | fwd+bwd / 3 GEMMs | fwd+bwd MiB "
        "| rel. err. vs float64: logp / entropy / grad_hidden / grad_weight |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [row for label in args.shapes.split(",") for row in shape_rows(label, implementations)]
    publish("\n".join(header + rows), args.markdown)


if __name__ == "__main__":
    main()
