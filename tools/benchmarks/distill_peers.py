"""Side-by-side GPU benchmark of linear distillation: flce, Liger-Kernel's fused linear JSD, torch.compile.

One process, one GPU, every method interleaved round by round. Per shape (tokens x student H x teacher H x V)
and round: the cuBLAS 4-GEMM floor (the teacher's logits, the student's logits, the student's two gradient
products G @ W_s and G.T @ x_s), then each method's forward + backward (median ms over 1.5 s); a method's
ratio is to its own round's floor, reported as the median over rounds and their range, beside the peak
memory above the gradients it returns (the student's hidden and weight gradients).

    python tools/benchmarks/distill_peers.py                     # both shapes, 4 rounds, bf16 (~5 min on an H200)
    python tools/benchmarks/distill_peers.py --quick             # a smoke run: one small shape, one round
    python tools/benchmarks/distill_peers.py --json h100.json --markdown h100.md
    python tools/benchmarks/distill_peers.py --loss forward_kl                 # KL(P || Q) instead of JSD

Methods: ``flce``, the CUDA backend (by name: a row saying "fails: ..." where it cannot run) as a call plans it
with nothing cached (the default memory budget, on Hopper both softmaxes' statistics from the logits GEMMs,
forward's passes over a chunk's logits in one kernel, one program a row, at most 64 registers a thread);
``flce_512MiB`` (memory_budget=512 MiB, the default's bound named); the other paths, as flce-autotune would time
them (docs/distillation.md): ``flce_separate`` (one kernel a pass, pair_passes=separate), ``flce_cublas_logits``
(forward_logits=cublas: the logits from cuBLAS, their statistics from a first sweep of the pair kernel),
``flce_gemm_statistics`` (forward_logits=fused: both softmaxes' statistics from the logits GEMMs, where the call
has them only when asked: reverse KL's E_q[s - t] from the student's GEMM, reading the teacher's logits),
``flce_uncapped`` (pair_registers=255: the passes' kernel without the register cap) and ``flce_2GiB``
(memory_budget=2 GiB: 2 chunks at 8192 tokens, fewer read-modify-writes of the weight gradient); ``flce_entropy``
(the default call returning the student's entropy too, return_entropy); ``liger_jsd``,
Liger-Kernel's ``LigerFusedLinearJSDLoss`` (weight_hard_loss=0, weight_soft_loss=1, beta 0.5; its chunked
torch.compile loop, which computes the unweighted cross-entropy too), where liger-kernel imports (a row saying
"fails: ..." otherwise); ``torch_compile``, torch.compile of the formula on materialised logits (the teacher's
under no_grad); ``trl_divergence``, TRL 1.16's own kernel (trl.kernels.chunked_divergence, its
DistillationTrainer's), where trl imports, and ``flce_trl_dropin``, flce's drop-in for that trainer's loss function
(its entropy too); with ``--loss jsd``, ``liger_defaults``, Liger's class at its defaults (weight_hard_loss =
weight_soft_loss = 0.5: JSD and the hard-label term), and ``flce_liger_dropin``, flce's drop-in of it
(flce.integrations.liger) at the same. Inputs are flce.testing.measure's draw (logits of std 1, every 17th target
ignored); the teacher takes no gradient. The loss: ``--loss`` jsd (beta 0.5, the default), forward_kl or reverse_kl,
Liger's class with the beta that makes it that divergence (0: KL(P || Q), 1: KL(Q || P), as its distillation_loss_fn
reads them).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import flce
from flce.autotune import override_params
from flce.testing.measure import (
    MiB,
    floor_gradient,
    median_ms,
    peak_mib_above,
    publish,
    round_order,
    shape_inputs,
)

DEFAULT_SHAPES = ("8192x4096x4096x128256", "8192x4096x8192x128256")
QUICK_SHAPES = ("2048x1024x2048x32000",)
BETA = 0.5
LIGER_BETA = {"jsd": BETA, "forward_kl": 0.0, "reverse_kl": 1.0}  # the beta of Liger's JSD class for each loss
FLOOR = "4-GEMM floor"


@dataclass(frozen=True)
class Case:
    tokens: int
    student: int
    teacher: int
    vocab: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.student}x{self.teacher}x{self.vocab}"


def parse_case(text: str, dtype: torch.dtype) -> Case:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes {text!r}: expected TOKENSxSTUDENT_HxTEACHER_HxVOCAB, e.g. 8192x4096x8192x128256")
    return Case(*(int(p) for p in parts), dtype)


@dataclass
class Inputs:
    student_hidden: torch.Tensor  # requires grad
    student_weight: torch.Tensor  # requires grad
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    target: torch.Tensor


def make_inputs(case: Case, device: str) -> Inputs:
    xs, ws, target, _ = shape_inputs(case.tokens, case.student, case.vocab, device, case.dtype)
    xt, wt, _, _ = shape_inputs(case.tokens, case.teacher, case.vocab, device, case.dtype, seed=1,
                                requires_grad=False)
    return Inputs(xs, ws, xt, wt, target)


# Each method: Inputs -> the loss's mean over the non-ignored tokens, differentiable w.r.t. the student.

def divergence_formula(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor,
                       loss: str = "jsd", beta: float = BETA) -> torch.Tensor:
    """The divergence of the logits (fp32 log-softmax; JSD the generalized one), averaged over the tokens whose
    target counts."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    if loss == "forward_kl":
        rows = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif loss == "reverse_kl":
        rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        rows = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
    valid = target != -100
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp(min=1)


def materialised(inputs: Inputs, loss: str = "jsd") -> torch.Tensor:
    with torch.no_grad():
        teacher_logits = inputs.teacher_hidden @ inputs.teacher_weight.t()
    return divergence_formula(inputs.student_hidden @ inputs.student_weight.t(), teacher_logits, inputs.target, loss)


def torch_compile_method(loss: str = "jsd") -> Callable[[Inputs], torch.Tensor]:
    """torch.compile of the formula on materialised logits (torch.compile compiles at the first call)."""
    compiled = torch.compile(materialised)
    return lambda inputs: compiled(inputs, loss)


def flce_method(budget: int | None, knobs: Callable[[], dict] | None = None, loss: str = "jsd",
                entropy: bool = False) -> Callable[[Inputs], torch.Tensor]:
    """flce's CUDA backend; ``knobs()``: autotune knobs the call plans with, as a cache entry would give them;
    ``entropy``: the call returns the student's entropy too (return_entropy)."""
    def call(inputs: Inputs) -> torch.Tensor:
        with override_params(knobs() if knobs else None, backend="cuda"):
            out = flce.linear_distillation_loss(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                                inputs.teacher_weight, inputs.target, loss=loss, beta=BETA,
                                                memory_budget=budget, backend="cuda", return_entropy=entropy)
        return out.loss if entropy else out
    return call


def liger_method(loss: str = "jsd") -> Callable[[Inputs], torch.Tensor]:
    """Liger-Kernel's LigerFusedLinearJSDLoss as the same loss (raises where liger-kernel does not load)."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    module = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=LIGER_BETA[loss])
    return lambda inputs: module(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                 inputs.teacher_weight, inputs.target)


def trl_divergence_method(loss: str = "jsd") -> Callable[[Inputs], torch.Tensor]:
    """TRL 1.16's own kernel, ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (what its
    DistillationTrainer's ``_chunked_divergence_loss`` runs), at the beta that makes it the loss (its mixture is
    (1 - beta) q + beta p, flce's), over the rows whose target counts (that function projects only those), their
    mean. What the kernel imports from the rest of TRL is its ZeRO-3 gather, a no-op here (tests/trainer_code.py's
    import_trl_kernel stubs it, as the tests load the kernel), so TRL installs without its dependencies."""
    tests = str(Path(__file__).resolve().parents[2] / "tests")  # not a package: on the path
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from trainer_code import import_trl_kernel

    module = import_trl_kernel("trl.kernels.chunked_divergence")

    def call(inputs: Inputs) -> torch.Tensor:
        valid = inputs.target != -100
        divergence, _entropy = module.ChunkedDivergenceFunction.apply(
            inputs.student_hidden[valid], inputs.student_weight, None, inputs.teacher_hidden[valid],
            inputs.teacher_weight, None, LIGER_BETA[loss])
        return divergence.sum() / valid.sum().clamp(min=1)
    return call


def trl_dropin_method(loss: str = "jsd") -> Callable[[Inputs], torch.Tensor]:
    """flce's drop-in for TRL's DistillationTrainer loss (flce.integrations.trl.chunked_divergence_loss) as that
    trainer calls it: [1, N, H] hidden states, the counted rows as the completion mask, the student's entropy too."""
    from flce.integrations.trl import chunked_divergence_loss

    def call(inputs: Inputs) -> torch.Tensor:
        mask = (inputs.target != -100).unsqueeze(0)
        loss_value, _entropy, _count = chunked_divergence_loss(
            inputs.student_hidden.unsqueeze(0), inputs.teacher_hidden.unsqueeze(0), inputs.student_weight,
            inputs.teacher_weight, mask, LIGER_BETA[loss])
        return loss_value
    return call


def liger_defaults_method(dropin: bool) -> Callable[[Inputs], torch.Tensor]:
    """Liger's class at its defaults (weight_hard_loss = weight_soft_loss = 0.5, beta 0.5: JSD and the hard-label
    term), or flce's drop-in of it (flce.integrations.liger) at the same."""
    if dropin:
        from flce.integrations.liger import LigerFusedLinearJSDLoss
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    module = LigerFusedLinearJSDLoss()
    return lambda inputs: module(inputs.student_hidden, inputs.student_weight, inputs.teacher_hidden,
                                 inputs.teacher_weight, inputs.target)


def all_methods(loss: str = "jsd") -> dict[str, Callable[[Inputs], torch.Tensor] | str]:
    """Every method by name, in the order they run; a method that cannot load here is its "fails: ..." cell."""
    methods: dict[str, Callable[[Inputs], torch.Tensor] | str] = {
        "flce": flce_method(None, loss=loss), "flce_512MiB": flce_method(512 * MiB, loss=loss),
        "flce_separate": flce_method(None, lambda: {"pair_passes": "separate"}, loss),
        "flce_cublas_logits": flce_method(None, lambda: {"forward_logits": "cublas"}, loss),
        "flce_gemm_statistics": flce_method(None, lambda: {"forward_logits": "fused"}, loss),
        "flce_uncapped": flce_method(None, lambda: {"pair_registers": 255}, loss),
        "flce_2GiB": flce_method(2048 * MiB, loss=loss),
        "flce_entropy": flce_method(None, loss=loss, entropy=True)}
    methods["liger_jsd"] = loaded(liger_method, loss)
    methods["torch_compile"] = torch_compile_method(loss)
    methods["trl_divergence"] = loaded(trl_divergence_method, loss)
    methods["flce_trl_dropin"] = trl_dropin_method(loss)
    if loss == "jsd":  # Liger's class as its users call it, and the drop-in that replaces it
        methods["flce_liger_dropin"] = liger_defaults_method(dropin=True)
        methods["liger_defaults"] = loaded(liger_defaults_method, False)
    return methods


def loaded(make: Callable[..., Callable[[Inputs], torch.Tensor]],
           *args: object) -> Callable[[Inputs], torch.Tensor] | str:
    """``make(*args)``, a peer's method, or its "fails: ..." cell where the peer does not load here."""
    try:
        return make(*args)
    except Exception as exc:
        return failure(exc)


def failure(exc: BaseException) -> str:
    """A table cell for a method that raised: the exception's type and its first line."""
    lines = str(exc).strip().splitlines() or [""]
    return f"fails: {type(exc).__name__}: {lines[0][:140]}"


def floor_call(inputs: Inputs) -> Callable[[], tuple]:
    """The four cuBLAS products of the floor as one call (G: flce.testing.measure's N(0, 1) gradient)."""
    xs, ws = inputs.student_hidden.detach(), inputs.student_weight.detach()
    xt, wt = inputs.teacher_hidden, inputs.teacher_weight
    g = floor_gradient(xs.shape[0], ws.shape[0], xs.dtype, xs.device)
    return lambda: (xt @ wt.t(), xs @ ws.t(), g @ ws, g.t() @ xs)


def measure(method: Callable[[Inputs], torch.Tensor] | str, inputs: Inputs, bench: Callable) -> dict:
    """One method's fwd+bwd median ms and its peak MiB above the gradients it returns, or its error."""
    if isinstance(method, str):
        return {"error": method}

    def step() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(method(inputs), (inputs.student_hidden, inputs.student_weight))

    try:
        step()  # compiling and tuning outside the measurement
        gc.collect()
        torch.cuda.empty_cache()
        peak = peak_mib_above(step)
        return {"ms": bench(step), "peak_mib": peak}
    except Exception as exc:
        return {"error": failure(exc)}
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def run_rounds(case: Case, methods: dict, rounds: int, device: str, bench: Callable) -> dict[str, list[dict]]:
    """``rounds`` rounds of the floor and then every method, in turn: per method, its rows (each with its round's
    floor), so that its ratios are to the floors of its own round (the clock drifts under the power cap). Every other
    round runs the methods in the reverse order (flce.testing.measure.round_order says why)."""
    measured: dict[str, list[dict]] = {FLOOR: [], **{name: [] for name in methods}}
    for number in range(rounds):
        inputs = make_inputs(case, device)
        floor_ms = bench(floor_call(inputs))
        measured[FLOOR].append({"ms": floor_ms, "peak_mib": 0.0, "floor_ms": floor_ms})
        for name, method in round_order(methods.items(), number):
            start = time.perf_counter()
            row = {**measure(method, inputs, bench), "floor_ms": floor_ms,
                   "wall_s": round(time.perf_counter() - start, 1)}
            measured[name].append(row)
            print(json.dumps({"shape": case.label, "method": name, **row}), flush=True)
        del inputs
    return measured


def summary(shape: str, method: str, rows: list[dict]) -> dict:
    """A table row from a method's rounds: the median ms, the median and range of the per-round ratios to that
    round's floor, the largest peak; an error in any round is the row's error."""
    errors = [r["error"] for r in rows if "error" in r]
    if errors:
        return {"shape": shape, "method": method, "error": errors[0]}
    ratios = [r["ms"] / r["floor_ms"] for r in rows]
    return {"shape": shape, "method": method, "ms": statistics.median(r["ms"] for r in rows),
            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
            "peak_mib": max(r["peak_mib"] for r in rows)}


def ratio_cell(row: dict) -> str:
    low, high = row["ratio_range"]
    return f"{row['ratio']:.3f}x" + (f" ({low:.3f}-{high:.3f})" if high > low else "")


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| shape (tokens x student H x teacher H x V) | method | fwd+bwd ms | x 4-GEMM floor | "
             "MiB above grads |", "|---|---|---|---|---|"]
    for r in rows:
        cells = (f"{r['error']} | | |" if "error" in r else
                 f"{r['ms']:.2f} | {ratio_cell(r)} | {r['peak_mib']:.0f}")
        lines.append(f"| {r['shape']} | {r['method']} | {cells} |")
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__}
    for package in ("triton", "liger-kernel"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated TOKENSxSTUDENT_HxTEACHER_HxVOCAB")
    parser.add_argument("--methods", default=None, help="comma-separated method names, run in this order")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--loss", choices=sorted(LIGER_BETA), default="jsd", help="the divergence (default jsd)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per shape, every other one in the reverse order (default 4; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one small shape, one round, short timings")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--json", default=None, help="also write the rows, with the GPU, date, versions, command")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or ",".join(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    args.rounds = (1 if args.quick else 4) if args.rounds is None else args.rounds
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected an int >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cases = [parse_case(s, dtype) for s in args.shapes.split(",")]
    methods = all_methods(args.loss)
    if args.methods:
        wanted = args.methods.split(",")
        methods = {k: methods.get(k, f"fails: no method {k!r} here") for k in wanted}
    rep_ms = 300 if args.quick else 1500

    def bench(fn: Callable[[], object]) -> float:
        return median_ms(fn, warmup_ms=100 if args.quick else 200, rep_ms=rep_ms)

    rows = []
    for case in cases:
        measured = run_rounds(case, methods, args.rounds, "cuda", bench)
        rows += [summary(case.label, name, measured_rows) for name, measured_rows in measured.items()]
    gpu = torch.cuda.get_device_name()
    command = "python tools/benchmarks/distill_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    what = f"JSD, beta {BETA}" if args.loss == "jsd" else args.loss
    header = (f"### Linear distillation ({what}), {gpu}, {args.dtype}, {datetime.date.today()}, "
              f"{args.rounds} round(s) — {', '.join(f'{k} {v}' for k, v in versions().items())}\n\n"
              f"Command: `{command.strip()}`")
    publish(markdown(rows, header).rstrip("\n"), args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "date": str(datetime.date.today()), "dtype": args.dtype, "loss": args.loss,
                       "versions": versions(),
                       "command": command.strip(), "floor": "cuBLAS x_t @ W_t.T, x_s @ W_s.T, G @ W_s, G.T @ x_s",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    raise SystemExit(main())
