"""Compile, for GPUs this machine does not have, every Triton kernel flce would give them: the calls below are
planned as on the named GPU (its description injected where a call reads its device's, flce/backends/cuda/
hardware.describe_device) and run on meta tensors, with every kernel launch compiled for that GPU's target
instead of launched (Triton's driver replaced by one that reports the target; no GPU, no CUDA driver needed).

The calls cover what the kernel choice gives those GPUs with nothing cached (the heuristic) and what flce-autotune
may store for them (the fused Triton GEMM writing a chunk's logits, the fused gradient GEMM, kept exponentials
from the Triton GEMM), in bf16, fp16 and fp32, forward-only and training, plain, RL and full-variant options; and
linear distillation's pair kernels (forward's passes in one kernel, and one kernel a pass as a vocabulary shard or
the cache's pair_passes=separate runs them).

    python tools/compat/compile_for_gpus.py --gpu "NVIDIA A100-SXM4-80GB" [--json out.json]

Exit status 0 when every launch compiled, within the shared memory a block of that GPU may use, and every Triton
kernel ``python -m flce explain`` names for each call (``--gpu``, the same knobs) was among those compiled for it;
prints one line per distinct kernel variant (kernel, the PTX's target, shared memory) and writes them, and per
call the kernels compiled and named, with --json. Run without TRITON_INTERPRET (it is removed here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # interpreted functions cannot be compiled
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import flce  # noqa: E402
from flce.autotune import override_params  # noqa: E402
from flce.backends import cuda  # noqa: E402
from flce.backends.cuda import hardware  # noqa: E402
from flce.config import LCEConfig  # noqa: E402
from flce.distillation.config import DistillationConfig  # noqa: E402
from flce.distillation.inputs import prepare_pair  # noqa: E402
from flce.engine.distillation.run import run_distillation  # noqa: E402
from flce.engine.run import run_backend  # noqa: E402
from flce.inputs import prepare_inputs  # noqa: E402

SHAPE = (8192, 4096, 128256)
# (label, options, autotune knobs for the shape, dtypes, training)
RL = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "temperature": 0.7}
CALLS = [
    ("default", {}, None, (torch.bfloat16, torch.float16, torch.float32), True),
    ("forward only", {}, None, (torch.bfloat16, torch.float32), False),
    ("rl deferred", RL, None, (torch.bfloat16,), True),
    ("full variant", {"label_smoothing": 0.1, "softcap": 30.0, "lse_square_scale": 1e-4}, None, (torch.bfloat16,),
     True),
    ("64 MiB vocabulary blocks", {"memory_budget": 64 << 20}, None, (torch.bfloat16,), True),
    ("tuned: Triton chunk logits", {}, {"forward_logits": "fused", "logits_kernel": "triton"}, (torch.bfloat16,),
     True),
    ("tuned: kept exponentials", {}, {"chunk_grad": "exponentials", "logits_kernel": "triton"},
     (torch.bfloat16,), True),
    ("tuned: fused gradient GEMM", dict(RL, memory_budget=512 << 20),
     {"forward_stats": "fused", "backward_grad": "fused"}, (torch.bfloat16,), True),
]

# Linear distillation (flce.linear_distillation_loss), student H x teacher H from the shape above: (label, options,
# autotune knobs, dtypes, training). One kernel a pass ("separate") is what a vocabulary shard runs.
DISTILL_HIDDEN = (4096, 8192)
DISTILL_CALLS = [
    ("distillation jsd", {"hard_label_weight": 0.2}, None, (torch.bfloat16, torch.float16, torch.float32), True),
    ("distillation forward kl deferred, teacher", {"loss": "forward_kl", "reduction": "none", "teacher_grad": True,
                                                   "temperature": 2.0}, None, (torch.bfloat16,), True),
    ("distillation one kernel a pass", {"loss": "jsd"}, {"pair_passes": "separate"}, (torch.bfloat16,), True),
    ("distillation reverse kl one kernel a pass", {"loss": "reverse_kl", "hard_label_weight": 0.5},
     {"pair_passes": "separate"}, (torch.bfloat16,), True),
    ("distillation forward only", {}, None, (torch.bfloat16,), False),
]


class _TargetDriver:
    """Triton's active driver for a GPU that is not here: the target to compile for, device 0, no stream."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_calls(gpu: str) -> tuple[list[dict], dict[str, list[str]]]:
    """Every distinct kernel variant the CALLS launch when planned on ``gpu``, compiled for its target, and per
    call the kernels compiled for it."""
    described = hardware.gpu_description(gpu)
    major, minor = described.capability
    target = GPUTarget("cuda", major * 10 + minor, 32)
    compiled: dict[tuple, dict] = {}
    real_run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]
        target_line = next(line for line in ptx.splitlines() if line.startswith(".target"))
        key = (self.__name__, kernel.hash if hasattr(kernel, "hash") else id(kernel))
        compiled.setdefault(key, {"kernel": f"{self.__module__}.{self.__name__}", "target": target_line,
                                  "shared_bytes": kernel.metadata.shared, "registers": None,
                                  "seconds": round(time.perf_counter() - start, 2), "calls": []})
        compiled[key]["calls"].append(current_call[0])
        per_call.setdefault(current_call[0], set()).add(compiled[key]["kernel"])
        return kernel

    current_call = [""]
    per_call: dict[str, set[str]] = {}
    with mock.patch.object(hardware, "describe_device", lambda device: described), \
            mock.patch.object(JITFunction, "run", compile_instead), \
            mock.patch.object(driver, "_active", _TargetDriver(target)):
        for label, options, knobs, dtypes, training in CALLS:
            for dtype in dtypes:
                current_call[0] = f"{label}, {str(dtype).removeprefix('torch.')}"
                _one_call(options, knobs, dtype, training)
        for label, options, knobs, dtypes, training in DISTILL_CALLS:
            for dtype in dtypes:
                current_call[0] = f"{label}, {str(dtype).removeprefix('torch.')}"
                _one_distillation(options, knobs, dtype, training)
    return list(compiled.values()), {call: sorted(kernels) for call, kernels in per_call.items()}


def named_by_explain(gpu: str) -> dict[str, list[str]]:
    """Per call, the Triton kernels (and what takes their place) that explain names for it on ``gpu``."""
    named = {}
    for calls, explain in ((CALLS, lambda dtype, training, options: flce.explain(
            "cuda", gpu=gpu, shape=SHAPE, dtype=dtype, training=training, **options)),
                           (DISTILL_CALLS, lambda dtype, training, options: flce.explain_distillation(
            "cuda", gpu=gpu, shape=(SHAPE[0], *DISTILL_HIDDEN, SHAPE[2]), dtype=dtype, training=training,
            **options))):
        for label, options, knobs, dtypes, training in calls:
            for dtype in dtypes:
                with override_params(knobs, backend="cuda") if knobs else _nothing():
                    record = explain(dtype, training, options)
                named[f"{label}, {str(dtype).removeprefix('torch.')}"] = sorted(
                    name for name in record.kernel_names() if name.startswith("flce.backends.cuda.")
                    and name.rpartition(".")[0].endswith("kernels"))
    return named


def _one_call(options: dict, knobs: dict | None, dtype: torch.dtype, training: bool) -> None:
    n, h, v = SHAPE
    x = torch.empty(n, h, dtype=dtype, device="meta", requires_grad=training)
    w = torch.empty(v, h, dtype=dtype, device="meta", requires_grad=training)
    t = torch.empty(n, dtype=torch.int64, device="meta")
    cfg = LCEConfig(**options)
    variant = "full" if cfg.needs_full else "plain"
    with override_params(knobs, backend="cuda") if knobs else _nothing(), torch.set_grad_enabled(training):
        out = run_backend(cuda.BACKEND, prepare_inputs(x, w, t, None, cfg), cfg, variant)
        if training:
            loss = out.logprobs.sum() + out.entropy.sum() if cfg.return_entropy else out
            loss = loss if isinstance(loss, torch.Tensor) else loss.loss
            torch.autograd.grad(loss.sum(), (x, w))


def _one_distillation(options: dict, knobs: dict | None, dtype: torch.dtype, training: bool) -> None:
    n, _, v = SHAPE
    student, teacher = DISTILL_HIDDEN
    xs = torch.empty(n, student, dtype=dtype, device="meta", requires_grad=training)
    ws = torch.empty(v, student, dtype=dtype, device="meta", requires_grad=training)
    teacher_grad = training and options.get("teacher_grad", False)
    xt = torch.empty(n, teacher, dtype=dtype, device="meta", requires_grad=teacher_grad)
    wt = torch.empty(v, teacher, dtype=dtype, device="meta", requires_grad=teacher_grad)
    t = torch.empty(n, dtype=torch.int64, device="meta")
    cfg = DistillationConfig(**options)
    with override_params(knobs, backend="cuda") if knobs else _nothing(), torch.set_grad_enabled(training):
        loss = run_distillation(cuda.BACKEND, prepare_pair(xs, ws, xt, wt, t, None, None, cfg), cfg)
        if training:
            torch.autograd.grad(loss.sum(), (xs, ws))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, help="a GPU flce knows by name (flce.backends.cuda.hardware)")
    parser.add_argument("--json", default=None, help="write the compiled variants here")
    args = parser.parse_args(argv)
    variants, compiled = compile_calls(args.gpu)
    named = named_by_explain(args.gpu)
    limit = hardware.gpu_description(args.gpu).shared_memory
    problems = [f"{v['kernel']} needs {v['shared_bytes']} B of shared memory, {args.gpu}'s blocks get {limit}"
                for v in variants if v["shared_bytes"] > limit]
    problems += [f"{call}: explain names {sorted(set(kernels) - set(compiled.get(call, ())))}, not compiled"
                 for call, kernels in named.items() if not set(kernels) <= set(compiled.get(call, ()))]
    for variant in variants:
        print(f"{variant['kernel']:70s} {variant['target']:16s} {variant['shared_bytes']:7d} B shared "
              f"{variant['seconds']:6.2f} s  {variant['calls'][0]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": args.gpu, "triton": triton.__version__, "variants": variants,
                                               "compiled": compiled, "named": named, "problems": problems}, indent=1))
    print(f"{len(variants)} kernel variants compiled for {args.gpu}")
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
