"""TRL's DistillationTrainer loss step on Llama-architecture models: TRL 1.16's ``compute_loss`` over its own
``_chunked_divergence_loss`` against the same ``compute_loss`` over flce's drop-in
``flce.integrations.trl.chunked_divergence_loss`` (one GPU, bf16, random weights).

    python tools/benchmarks/distillation_step.py [--student 2048x16 --teacher 3072x28 --vocab 128256 --batch 4
        --prompt 512 --completion 1536] [--beta 1.0] [--temperature 1.0] [--rounds 8] [--out DIR]
    python tools/benchmarks/distillation_step.py --device cpu --student 32x1 --teacher 48x1 --vocab 300 --batch 2 \\
        --prompt 4 --completion 12 --rounds 1                      # a smoke run on a CPU

A step is what the trainer's training step runs of the models once the completions are generated: its
``compute_loss`` (the student's backbone, the teacher's backbone without a gradient, the loss over the completion
positions, the entropy metric) and the backward into every student parameter (not the optimizer). The default
``--beta`` is DistillationConfig's (1.0: reverse KL). Both methods run TRL's own trainer methods, taken out of
trl/trainer/distillation_trainer.py (tests/trainer_code.py) on a stand-in trainer with one process; they differ only
in the module's ``_chunked_divergence_loss``, which is what a user replaces. Models as tools/benchmarks/gkd_step.py
makes them (the same seeded weights for both methods); a batch of ``--batch`` prompts of ``--prompt`` tokens (one
left-padded by a quarter, as TRL pads prompts) and completions of ``--completion`` tokens (one ending at three
quarters). The methods run in interleaved rounds after a warm-up round; each step's time is wall time from an idle
GPU to the end of its backward. Memory: the step's peak above what was allocated before it, the student's gradients
already allocated by an earlier step. Agreement: the two losses and the two entropy metrics on the same batch
(tests/test_distillation_trainers.py checks the drop-in against float64).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from flce.integrations import trl as flce_trl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or loaded by a test: gkd_step beside it
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/ is not a package
from gkd_step import _Accelerator as _Unwrapping
from gkd_step import add_model_arguments, llama, measure_steps
from trainer_code import trl_chunked_divergence_loss, trl_distillation_trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens a sequence")
    p.add_argument("--completion", type=int, default=1536, help="completion tokens a sequence")
    p.add_argument("--beta", type=float, default=1.0, help="the trainer's beta (0: forward KL, 1: reverse KL)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=None, help="folder for distillation_step.json / distillation_step.md")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.prompt < 4 or args.completion < 4:
        p.error("--prompt and --completion must be at least 4 tokens")
    return args


def batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """What the trainer's generation hands its compute_loss: prompts left-padded, completions right-padded, and
    the completion tokens' count."""
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=g)
    completion_ids = torch.randint(0, args.vocab, (args.batch, args.completion), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :args.prompt // 4] = 0
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[-1, 3 * args.completion // 4:] = 0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "num_items_in_batch": completion_mask.sum().float()}
    return {k: v.to(device) for k, v in inputs.items()}


class _Accelerator(_Unwrapping):
    """One process's: the models unwrapped, the metrics gathered from itself."""

    num_processes = 1

    def gather_for_metrics(self, value: torch.Tensor) -> torch.Tensor:
        return value


def trainer(divergence_loss, student: torch.nn.Module, teacher: torch.nn.Module, args: argparse.Namespace):
    """A stand-in DistillationTrainer of one process whose module-level ``_chunked_divergence_loss`` is
    ``divergence_loss``: the attributes TRL's three methods read, as its __init__ sets them."""
    cls = trl_distillation_trainer(divergence_loss)
    stand_in = cls()
    vars(stand_in).update(
        model=student, teacher_model=teacher, beta=args.beta, temperature=args.temperature,
        accelerator=_Accelerator(), _is_vlm=False,
        model_kwarg_keys=inspect.signature(student.forward).parameters.keys(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        # Accelerate's redirection runs the function inside the wrapper's forward; with no wrapper it is a call.
        _forward_redirection=lambda wrapper, unwrapped, fn, *a, **kw: fn(*a, **kw))
    return stand_in


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = args.prompt + args.completion
    student = llama(*args.student, args.vocab, seq, tied=True, seed=1, device=device, dtype=dtype).train()
    teacher = llama(*args.teacher, args.vocab, seq, tied=False, seed=2, device=device, dtype=dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    inputs = batch(args, device)
    trainers = {"trl": trainer(trl_chunked_divergence_loss(), student, teacher, args),
                "flce": trainer(flce_trl.chunked_divergence_loss, student, teacher, args)}
    losses, memory, timings = measure_steps({name: t.compute_loss for name, t in trainers.items()}, student, inputs,
                                            device, args.rounds)
    # Every step logged the entropy metric; the same batch each time, so the last one stands for all.
    entropies = {name: t._metrics["train"]["entropy"][-1] for name, t in trainers.items()}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
        "student": "x".join(map(str, args.student)), "teacher": "x".join(map(str, args.teacher)),
        "vocab": args.vocab, "batch": args.batch, "prompt": args.prompt, "completion": args.completion,
        "completion_tokens": int(inputs["completion_mask"].sum()), "beta": args.beta,
        "temperature": args.temperature, "rounds": args.rounds, "torch": torch.__version__,
        "methods": {name: {"samples_ms": list(timings.wall[name].samples_ms), "median_ms": timings.wall[name].median_ms,
                           "peak_mib": memory.get(name), "loss": losses[name], "entropy": entropies[name]}
                    for name in trainers},
    }
    report["flce_over_trl"] = report["methods"]["flce"]["median_ms"] / report["methods"]["trl"]["median_ms"]
    report["loss_relative_difference"] = abs(losses["flce"] - losses["trl"]) / abs(losses["trl"])
    report["entropy_relative_difference"] = abs(entropies["flce"] - entropies["trl"]) / abs(entropies["trl"])
    save(report, args.out)
    print(markdown(report))
    return 0


def save(report: dict, out: str | None) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "distillation_step.json").write_text(json.dumps(report, indent=1))
        Path(out, "distillation_step.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"DistillationTrainer loss step, {report['device']}, {report['dtype']}: student {report['student']}, "
             f"teacher {report['teacher']} (HIDDENxLAYERS), vocab {report['vocab']}, {report['batch']} x "
             f"({report['prompt']} prompt + {report['completion']} completion) tokens, {report['completion_tokens']} "
             f"completion tokens counted, beta {report['beta']}, temperature {report['temperature']}, "
             f"{report['rounds']} interleaved rounds", "",
             "| _chunked_divergence_loss | step ms, median (range) | peak MiB above the gradients | loss | entropy |",
             "|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        peak = "n/a" if m["peak_mib"] is None else f"{m['peak_mib']:.0f}"
        lines.append(f"| {name} | {m['median_ms']:.1f} ({min(m['samples_ms']):.1f}-{max(m['samples_ms']):.1f}) | "
                     f"{peak} | {m['loss']:.6g} | {m['entropy']:.6g} |")
    lines += ["", f"flce / TRL step time: {report['flce_over_trl']:.3f} (medians); losses differ by "
                  f"{report['loss_relative_difference']:.2e} relative, entropies by "
                  f"{report['entropy_relative_difference']:.2e}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
