"""TRL's GKD loss step on Llama-architecture models: TRL 1.16's own ``GKDTrainer.compute_loss`` against flce's
``GKDDistillationLossMixin`` (one GPU, bf16, random weights).

    python tools/benchmarks/gkd_step.py [--student 2048x16 --teacher 3072x28 --vocab 128256 --batch 4 --seq 2048]
        [--beta 0.5] [--rounds 8] [--out DIR]
    python tools/benchmarks/gkd_step.py --device cpu --student 32x1 --teacher 48x1 --vocab 300 --batch 2 --seq 16 \
        --rounds 1                                                   # a smoke run on a CPU

A step is what GKDTrainer's training step runs of the model: the teacher's forward (no gradient), the student's
forward, the loss, and the backward into every student parameter (not the optimizer). Models: ``HIDDENxLAYERS`` Llamas
(the default pair has the sizes of Llama 3.2 1B and 3B: heads of 128, 8 KV heads, MLP 4 x hidden up to 8192, the
student's embeddings tied), the same seeded weights for both methods; a batch of ``--batch`` sequences of ``--seq``
tokens, the first eighth of each a prompt (label -100), one sequence padded from three quarters on. The methods run in
interleaved rounds (flce.testing.measure.interleaved_timings, each round's order the last one's reversed) after a
warm-up round; each step's time is wall time from an idle GPU to the end of its backward. Memory: the step's peak
above what was allocated before it, the student's gradients already allocated by an earlier step. Agreement: the two
losses on the same batch, and, with ``--float64-check``, each method's on the batch's first sequence against TRL's
compute_loss on float64 copies of the models.

TRL's two functions are read out of trl/experimental/gkd/gkd_trainer.py (tests/trainer_code.py, as the drop-in's
tests read them), so TRL installs without its dependencies: ``pip install --no-deps trl==1.16.0``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from flce.integrations import trl as flce_trl
from flce.testing.measure import interleaved_timings, peak_mib_above, relative_difference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from trainer_code import trl_gkd_trainer  # tests/ is not a package: on the path above


def parse_model(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HIDDENxLAYERS, e.g. 2048x16")
    return int(parts[0]), int(parts[1])


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The models and the batch's sequences (also tools/benchmarks/distillation_step.py's)."""
    p.add_argument("--student", type=parse_model, default=(2048, 16), help="HIDDENxLAYERS")
    p.add_argument("--teacher", type=parse_model, default=(3072, 28), help="HIDDENxLAYERS")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--beta", type=float, default=0.5, help="GKD's beta (0: forward KL, 1: reverse KL)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--float64-check", action="store_true", help="each method's loss against float64 TRL")
    p.add_argument("--out", default=None, help="folder for gkd_step.json / gkd_step.md")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def llama(hidden: int, layers: int, vocab: int, seq: int, tied: bool, seed: int, device: torch.device,
          dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    heads = max(1, hidden // 128)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=min(4 * hidden, 8192),
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=min(8, heads), max_position_embeddings=seq,
                                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    with device:  # initialised where it runs: billions of parameters initialise in seconds on a GPU
        return transformers.LlamaForCausalLM(config).to(dtype)


def batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, 3 * args.seq // 4:] = 0
    labels = input_ids.clone()
    labels[:, :max(1, args.seq // 8)] = -100
    labels[attention_mask == 0] = -100
    return {k: v.to(device) for k, v in
            {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}.items()}


class _Accelerator:
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def trainers(teacher: torch.nn.Module, beta: float) -> tuple[object, object]:
    """TRL's compute_loss on a stand-in trainer, and the mixin's (tests/test_distillation_trainers.py's way)."""
    base = trl_gkd_trainer()
    attrs = dict(teacher_model=teacher, beta=beta, accelerator=_Accelerator())
    mixed = type("Mixed", (flce_trl.GKDDistillationLossMixin, base), {})
    mixin = mixed.__new__(mixed)
    vars(mixin).update(attrs)
    trl = SimpleNamespace(**attrs, generalized_jsd_loss=base.generalized_jsd_loss)
    return (lambda model, inputs: base.compute_loss(trl, model, inputs)), mixin.compute_loss


def measure_steps(methods: dict, student: torch.nn.Module, inputs: dict[str, torch.Tensor], device: torch.device,
                  rounds: int) -> tuple[dict[str, float], dict[str, float], object]:
    """Each method's step, ``method(student, inputs)`` then its loss's backward: (each one's last loss, its peak MiB
    above what was allocated before it (not on a CPU), the interleaved timings of ``rounds`` rounds)."""
    losses = {}

    def step(name: str):
        def run() -> None:
            loss = methods[name](student, inputs)
            loss.backward()
            losses[name] = float(loss.detach())
        return run

    for name in methods:
        step(name)()  # the gradients allocated before the memory is measured
    memory = {} if device.type == "cpu" else {name: peak_mib_above(step(name), device) for name in methods}
    timings = interleaved_timings({name: step(name) for name in methods}, device, rounds=rounds)
    return losses, memory, timings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    student = llama(*args.student, args.vocab, args.seq, tied=True, seed=1, device=device, dtype=dtype).train()
    teacher = llama(*args.teacher, args.vocab, args.seq, tied=False, seed=2, device=device, dtype=dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    # flce's mixin runs through the patched forward; without flce_policy it is the original one, so TRL's
    # compute_loss runs the same model objects unchanged.
    flce_trl.add_policy_head(student)
    flce_trl.add_policy_head(teacher)
    inputs = batch(args, device)
    trl_loss, flce_loss = trainers(teacher, args.beta)
    methods = {"trl": trl_loss, "flce": flce_loss}
    losses, memory, timings = measure_steps(methods, student, inputs, device, args.rounds)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
        "student": "x".join(map(str, args.student)), "teacher": "x".join(map(str, args.teacher)),
        "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "beta": args.beta, "rounds": args.rounds,
        "torch": torch.__version__,
        "methods": {name: {"samples_ms": list(timings.wall[name].samples_ms), "median_ms": timings.wall[name].median_ms,
                           "peak_mib": memory.get(name), "loss": losses[name]} for name in methods},
    }
    report["flce_over_trl"] = report["methods"]["flce"]["median_ms"] / report["methods"]["trl"]["median_ms"]
    report["loss_relative_difference"] = abs(losses["flce"] - losses["trl"]) / abs(losses["trl"])
    save(report, args.out)  # the timings kept should the float64 check below run out of memory
    if args.float64_check:
        report["float64_relative_error"] = float64_errors(student, teacher, inputs, methods, args.beta)
        save(report, args.out)
    print(markdown(report))
    return 0


def float64_errors(student: torch.nn.Module, teacher: torch.nn.Module, inputs: dict[str, torch.Tensor],
                   methods: dict, beta: float) -> dict[str, float]:
    """Each method's loss on the batch's first sequence against TRL's on float64 copies of the models (one
    sequence: TRL's float64 JSD holds several [tokens, V] float64 tensors at once)."""
    first = {k: v[:1] for k, v in inputs.items()}
    with torch.no_grad():
        got = {name: method(student, first).double().cpu() for name, method in methods.items()}
        wide = {name: copy.deepcopy(m).double() for name, m in (("student", student), ("teacher", teacher))}
        want, _ = trainers(wide["teacher"], beta)
        reference = want(wide["student"], first).cpu()
    return {name: relative_difference(value, reference) for name, value in got.items()}


def save(report: dict, out: str | None) -> None:
    text = markdown(report)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gkd_step.json").write_text(json.dumps(report, indent=1))
        Path(out, "gkd_step.md").write_text(text)


def markdown(report: dict) -> str:
    lines = [f"GKD loss step, {report['device']}, {report['dtype']}: student {report['student']}, teacher "
             f"{report['teacher']} (HIDDENxLAYERS), vocab {report['vocab']}, {report['batch']} x {report['seq']} "
             f"tokens, beta {report['beta']}, {report['rounds']} interleaved rounds", "",
             "| method | step ms, median (range) | peak MiB above the gradients | loss |", "|---|---|---|---|"]
    for name, m in report["methods"].items():
        peak = "n/a" if m["peak_mib"] is None else f"{m['peak_mib']:.0f}"
        lines.append(f"| {name} | {m['median_ms']:.1f} ({min(m['samples_ms']):.1f}-{max(m['samples_ms']):.1f}) | "
                     f"{peak} | {m['loss']:.6g} |")
    lines += ["", f"flce / TRL step time: {report['flce_over_trl']:.3f} (medians); losses differ by "
                  f"{report['loss_relative_difference']:.2e} relative"]
    if "float64_relative_error" in report:
        lines.append("on the first sequence, against TRL's in float64: " + ", ".join(f"{k} {v:.2e}" for k, v in
                                                          report["float64_relative_error"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
