"""The RL trainers' policy loss side by side on one GPU: flce's policy loss against how trainers compute it today.

One process; every round measures the cuBLAS 3-GEMM floor (``x @ W.T``, ``G @ W``, ``G.T @ x``) and then every
method at every importance-sampling level in turn, so each ratio is to its own round's floor and the methods
alternate (the GPU's clock under its power cap drifts over a run). Each cell: forward + backward into hidden and
weight, the median over the rounds of the per-round ratio to the floor with its range, and the peak memory above
the gradients the step returns (MiB). Timing and memory come from flce.testing.measure and peers.py.

The loss (stated in the header of the output): TRL 1.16 GRPOTrainer's ``loss_type="dapo"``, epsilon_low 0.2,
epsilon_high 0.28, the k3 KL to reference log-probs at beta 0.04, an entropy bonus of 0.01 (the masked mean
entropy), temperature 0.7, ``num_items_in_batch`` = the mask's sum; old and reference log-probs are the policy's
own plus N(0, 0.1) and N(0, 0.2) noise; one advantage per sequence; every 17th token masked. Methods:

* ``flce policy loss``: flce.linear_policy_loss, default memory budget, within 512 MiB, and with 6 GiB (the
  sequence level then keeps every row's logits: three GEMMs);
* ``flce log-probs + TRL formula``: flce.linear_cross_entropy's per-token log-probs and entropy (differentiable),
  TRL's formula in PyTorch outside (what the trainers do with flce's drop-ins);
* ``torch.compile TRL formula``: the logits materialised and TRL's formula, compiled (Inductor);
* ``Liger GRPO``: Liger-Kernel's LigerFusedLinearGRPOLoss at its defaults (chunk_size 1, compiled); it has no
  entropy term, so it does that much less work. Where it does not load, its row says why.

    python tools/benchmarks/policy_peers.py                      # 16 x 1024 tokens x 4096 x 151936, bf16, 3 rounds
    python tools/benchmarks/policy_peers.py --quick              # a small smoke run, one round
    python tools/benchmarks/policy_peers.py --methods "flce policy loss" --levels sequence --markdown out.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import flce
from flce.testing.measure import MiB, floor_gradient, floor_products, peak_mib_above, publish, round_order

LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Setting:
    """The shape and the loss's settings (the module docstring's)."""

    batch: int = 16
    length: int = 1024
    hidden: int = 4096
    vocab: int = 151936
    dtype: torch.dtype = torch.bfloat16
    temperature: float = 0.7
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.04
    entropy_weight: float = 0.01
    warmup_ms: float = 200
    rep_ms: float = 1500

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def text(self) -> str:
        return (f"{self.batch} x {self.length} tokens x H {self.hidden} x V {self.vocab}, "
                f"{str(self.dtype).removeprefix('torch.')}; dapo, epsilon_low {self.epsilon_low}, epsilon_high "
                f"{self.epsilon_high}, beta {self.beta} (k3), entropy_weight {self.entropy_weight}, temperature "
                f"{self.temperature}, num_items_in_batch = the mask's sum")


QUICK = Setting(batch=4, length=256, hidden=512, vocab=8192, warmup_ms=20, rep_ms=100)


@dataclass
class Batch:
    """One step's inputs: x [B, T, H] and W [V, H] (leaves), and the per-token tensors [B, T] (advantages [B])."""

    x: torch.Tensor
    w: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor


def make_batch(setting: Setting, device: str, seed: int = 0) -> Batch:
    """Logits of std 1 (a weight of N(0, 1/H)), uniform targets, every 17th token masked; old and reference
    log-probs the policy's own plus noise (so that some ratios clip and most do not)."""
    gen = torch.Generator(device=device).manual_seed(seed + setting.tokens + setting.vocab)
    b, t, h, v = setting.batch, setting.length, setting.hidden, setting.vocab
    x = torch.randn(b, t, h, device=device, dtype=setting.dtype, generator=gen)
    w = torch.randn(v, h, device=device, dtype=setting.dtype, generator=gen).mul_(h**-0.5)
    target = torch.randint(0, v, (b, t), device=device, generator=gen)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask.view(-1)[::17] = False
    with torch.no_grad():
        own = flce.linear_cross_entropy(x, w, target, reduction="none", temperature=setting.temperature,
                                        return_logprobs=True).logprobs
    noise = torch.randn(2, b, t, device=device, generator=gen)
    return Batch(x.requires_grad_(), w.requires_grad_(), target, mask,
                 torch.randn(b, device=device, generator=gen), own + 0.1 * noise[0], own + 0.2 * noise[1])


def trl_formula(logp: torch.Tensor, entropy: torch.Tensor, batch: Batch, level: str, setting: Setting) -> torch.Tensor:
    """TRL 1.16 GRPOTrainer's dapo loss with the k3 KL and the entropy bonus, on per-token log-probs [B, T]."""
    mask = batch.mask.to(logp.dtype)
    log_ratio = logp - batch.old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - setting.epsilon_low, 1 + setting.epsilon_high)
    advantages = batch.advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token = per_token + setting.beta * (torch.exp(batch.ref - logp) - (batch.ref - logp) - 1)
    count = mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / count - setting.entropy_weight * (entropy * mask).sum() / count


# A method: (setting, level) -> step(batch) -> loss, differentiable into batch.x and batch.w.
Step = Callable[[Batch], torch.Tensor]


def flce_policy(budget: int | None = None) -> Callable[[Setting, str], Step]:
    def build(setting: Setting, level: str) -> Step:
        options = {} if budget is None else {"memory_budget": budget}

        def step(batch: Batch) -> torch.Tensor:
            return flce.linear_policy_loss(
                batch.x, batch.w, batch.target, batch.advantages, mask=batch.mask, old_logprobs=batch.old,
                ref_logprobs=batch.ref, loss_type="dapo", epsilon_low=setting.epsilon_low,
                epsilon_high=setting.epsilon_high, beta=setting.beta, importance_sampling_level=level,
                temperature=setting.temperature, entropy_weight=setting.entropy_weight, **options).loss

        return step

    return build


def flce_logprobs_then_formula(budget: int | None = None) -> Callable[[Setting, str], Step]:
    def build(setting: Setting, level: str) -> Step:
        options = {} if budget is None else {"memory_budget": budget}

        def step(batch: Batch) -> torch.Tensor:
            out = flce.linear_cross_entropy(batch.x, batch.w, batch.target, reduction="none",
                                            temperature=setting.temperature, return_logprobs=True,
                                            return_entropy=True, **options)
            return trl_formula(out.logprobs, out.entropy, batch, level, setting)

        return step

    return build


def materialised_formula(setting: Setting, level: str) -> Callable[[torch.Tensor, torch.Tensor, Batch], torch.Tensor]:
    """TRL's formula on the materialised logits (a float32 softmax of 16-bit ones), as its non-fused path computes
    it."""
    def loss(x: torch.Tensor, w: torch.Tensor, batch: Batch) -> torch.Tensor:
        logits = (x @ w.T).to(torch.promote_types(x.dtype, torch.float32)) / setting.temperature
        log_p = torch.log_softmax(logits, dim=-1)
        logp = log_p.gather(-1, batch.target.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return trl_formula(logp, entropy, batch, level, setting)

    return loss


def torch_compile_formula(setting: Setting, level: str) -> Step:
    compiled = torch.compile(materialised_formula(setting, level))
    return lambda batch: compiled(batch.x, batch.w, batch)


def liger_grpo(setting: Setting, level: str) -> Step:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=setting.beta, epsilon_low=setting.epsilon_low,
                                       epsilon_high=setting.epsilon_high, loss_type="dapo",
                                       importance_sampling_level=level, temperature=setting.temperature,
                                       use_ref_model=True)

    def step(batch: Batch) -> torch.Tensor:
        out = loss_fn(batch.x, batch.w, batch.target, batch.mask.long(), batch.advantages,
                      ref_per_token_logps=batch.ref, old_per_token_logps=batch.old)
        return out[0] if isinstance(out, tuple) else out

    return step


METHODS: dict[str, Callable[[Setting, str], Step]] = {
    "flce policy loss": flce_policy(),
    "flce policy loss, 512 MiB": flce_policy(512 * MiB),
    "flce policy loss, 6 GiB": flce_policy(6 << 30),
    "flce log-probs + TRL formula": flce_logprobs_then_formula(),
    "flce log-probs + TRL formula, 512 MiB": flce_logprobs_then_formula(512 * MiB),
    "torch.compile TRL formula": torch_compile_formula,
    "Liger GRPO (no entropy term)": liger_grpo,
}


def failure(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"fails: {type(exc).__name__}: {lines[0][:140]}"


def bench_ms(fn: Callable[[], object], setting: Setting) -> float:
    from flce.testing.measure import median_ms

    return median_ms(fn, warmup_ms=setting.warmup_ms, rep_ms=setting.rep_ms)


def measure(step: Step, batch: Batch, setting: Setting) -> dict:
    """{"ms", "peak_mib"} of one forward + backward (the gradients it returns excluded from the peak)."""
    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(step(batch), (batch.x, batch.w))

    fwd_bwd()  # compile and tune outside the measurement
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    peak = peak_mib_above(fwd_bwd)
    return {"ms": bench_ms(fwd_bwd, setting), "peak_mib": peak}


def floor_ms(batch: Batch, setting: Setting) -> float:
    x, w = batch.x.detach().reshape(setting.tokens, setting.hidden), batch.w.detach()
    grad = floor_gradient(setting.tokens, setting.vocab, setting.dtype, x.device)
    ms = bench_ms(floor_products(x, w, grad), setting)
    del grad
    return ms


def run_rounds(setting: Setting, methods: dict[str, Callable[[Setting, str], Step]], levels: tuple[str, ...],
               rounds: int, device: str = "cuda") -> list[dict]:
    """Every round: the floor, then each (level, method), every other round in the reverse order
    (flce.testing.measure.round_order says why); the per-round measurements, each with its round's floor
    (``floor_ms``) or its error."""
    batch = make_batch(setting, device)
    steps: dict[tuple[str, str], Step | str] = {}
    for level in levels:
        for name, build in methods.items():
            try:
                steps[(level, name)] = build(setting, level)
            except Exception as exc:  # a peer that does not load is reported, not fatal
                steps[(level, name)] = failure(exc)
    measured = []
    for round_index in range(rounds):
        floor = floor_ms(batch, setting)
        measured.append({"round": round_index, "level": "-", "method": "3-GEMM floor", "ms": floor,
                         "floor_ms": floor, "peak_mib": 0.0})
        for (level, name), step in round_order(steps.items(), round_index):
            row = {"round": round_index, "level": level, "method": name, "floor_ms": floor}
            start = time.perf_counter()
            if isinstance(step, str):
                row["error"] = step
            else:
                try:
                    row.update(measure(step, batch, setting))
                except Exception as exc:  # a method that fails at this shape is reported, not fatal
                    row["error"] = failure(exc)
            row["wall_s"] = round(time.perf_counter() - start, 1)
            measured.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    return measured


def summary(measured: list[dict]) -> list[dict]:
    """One row per (level, method): the median ms, the median and range of the per-round ratios to the floor,
    the largest peak; an error in any round is the row's."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for row in measured:
        rows.setdefault((row["level"], row["method"]), []).append(row)
    out = []
    for (level, method), runs in rows.items():
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            out.append({"level": level, "method": method, "error": errors[0]})
            continue
        ratios = [r["ms"] / r["floor_ms"] for r in runs]
        out.append({"level": level, "method": method, "ms": statistics.median(r["ms"] for r in runs),
                    "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
                    "peak_mib": max(r["peak_mib"] for r in runs), "rounds": len(runs)})
    return out


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| level | method | fwd+bwd ms | x 3-GEMM floor, median (range) | MiB above the gradients |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['level']} | {r['method']} | {r['error']} | | |")
            continue
        low, high = r["ratio_range"]
        spread = f" ({low:.3f}-{high:.3f})" if high > low else ""
        lines.append(f"| {r['level']} | {r['method']} | {r['ms']:.2f} | {r['ratio']:.3f}{spread} | "
                     f"{r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small shape, one round, short timings (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    parser.add_argument("--methods", default=None, help="method names separated by ';' (default: all)")
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--json", default=None, help="also write every round's measurements")
    args = parser.parse_args()
    setting = QUICK if args.quick else Setting()
    rounds = args.rounds or (1 if args.quick else 3)
    methods = METHODS
    if args.methods:
        unknown = [m for m in args.methods.split(";") if m not in METHODS]
        if unknown:
            parser.error(f"--methods: unknown {unknown}; expected names among {list(METHODS)}")
        methods = {m: METHODS[m] for m in args.methods.split(";")}
    levels = tuple(args.levels.split(","))
    if not set(levels) <= set(LEVELS):
        parser.error(f"--levels {args.levels}: expected names among {LEVELS}")
    started = time.perf_counter()
    measured = run_rounds(setting, methods, levels, rounds)
    header = (f"### {torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}: "
              f"{setting.text()}; {rounds} rounds, {time.perf_counter() - started:.0f} s")
    publish(markdown(summary(measured), header), args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "setting": setting.text(), "rounds": measured}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    if not torch.cuda.is_available():
        sys.exit("policy_peers.py measures on a CUDA GPU")
    main()
