"""Where the host's time for one training call goes, by section, without a profiler (one GPU, bf16).

Each section is a function of flce (or Triton's launch path), wrapped where its callers look it up so that every
call of it adds its wall time: the call's checks, its dispatch, the engine's pass over the targets, the chunks'
launchers, every Triton launch, autograd's backward. Sections overlap (run_forward holds the launchers), so the
column does not sum to the call. cProfile (``host_time.py --cprofile``) doubles a call's host time; these wrappers
add about a microsecond a section call. Sections this flce lacks (an older checkout on ``PYTHONPATH``) are listed
as absent, so that two revisions can be compared in alternating processes::

    python tools/profiling/host_sections.py [--shapes 4096x4096x32000] [--calls 40]
    PYTHONPATH=build/ab/main python tools/profiling/host_sections.py     # a baseline checkout's flce
"""

from __future__ import annotations

import argparse
import collections
import importlib
import time

import torch

# (module, attribute, class or None): each wrapped in the namespace it is called through.
SECTIONS = (
    ("flce.module", "_checked_config", None),
    ("flce.module", "prepare_inputs", None),
    ("flce.module", "dispatch", None),
    ("flce.module", "run_backend", None),
    ("flce.engine.run", "planned_call", None),
    ("flce.engine.function", "run_forward", None),
    ("flce.engine.function", "_gradients", None),
    ("flce.engine.schedule", "denominators", None),
    ("flce.backends.cuda.ops", "TritonChunkKernels", "count_tokens"),
    ("flce.engine.objective", "upstream_scales", None),
    ("flce.engine.objective", "row_terms", None),
    ("flce.engine.objective", "policy_rows", None),
    ("flce.engine.token_chunks", "reduce_terms", None),
    ("flce.backends.cuda.ops", "TritonChunkKernels", "gemm_exp_grad"),
    ("flce.backends.cuda.ops", "exp_offsets", None),
    ("flce.backends.cuda.ops", "launch_or_fall_back", None),
    ("flce.backends.cuda.ws_gemm_ops", "ws_partial_row_stats", None),
    ("flce.backends.cuda.ws_gemm_ops", "_descriptor", None),
    ("flce.backends.cuda.ws_gemm_ops", "_launch", None),
    ("flce.backends.cuda.gemm_ops", "merge_splits", None),
    ("flce.backends.cuda.ops", "finish_exp_rows", None),
    ("flce.backends.cuda.ops", "redo_exp_rows", None),
    ("flce.engine.rows", "GradAccumulator", "add_row_scaled"),
    ("flce.backends.cuda.ops", "scale_rows", None),
    ("flce.engine.rows", "torch_matmul_", None),
    ("triton.runtime.jit", "JITFunction", "run"),
)


def install(totals: collections.Counter, counts: collections.Counter, patch=setattr) -> list[str]:
    """Wraps every section that exists (``patch``: how to set the wrapper); returns the labels of those that do
    not (an older flce)."""
    absent = []
    for module_name, attr, method in SECTIONS:
        label = f"{module_name}.{attr}" + (f".{method}" if method else "")
        try:
            owner = importlib.import_module(module_name)
            target, name = (getattr(owner, attr), method) if method else (owner, attr)
            original = getattr(target, name)
        except (ImportError, AttributeError):
            absent.append(label)
            continue

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start
                counts[_label] += 1

        patch(target, name, timed)
    return absent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096x32000")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    import flce
    from flce.testing.measure import parse_shape, shape_inputs

    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    absent = install(totals, counts)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flce {flce.__file__}")
    for label in args.shapes.split(","):
        x, w, t, _ = shape_inputs(*parse_shape(label))

        def step(x=x, w=w, t=t):
            start = time.perf_counter()
            loss = flce.linear_cross_entropy(x, w, t)
            totals["= the forward call"] += time.perf_counter() - start
            start = time.perf_counter()
            grads = torch.autograd.grad(loss, (x, w))
            totals["= autograd's backward"] += time.perf_counter() - start
            return grads

        for _ in range(5):
            step()
        totals.clear()
        counts.clear()
        whole = 0.0
        for _ in range(args.calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            whole += time.perf_counter() - start
        torch.cuda.synchronize()
        print(f"\n{label}, default training call: host {whole / args.calls * 1e3:.3f} ms a call "
              f"(GPU synchronised before each of {args.calls})\n")
        print("| section | us a call | calls a call |\n|---|---|---|")
        for name, total in totals.most_common():
            print(f"| {name} | {total / args.calls * 1e6:.1f} | {counts[name] / args.calls:.1f} |")
    if absent:
        print("\nabsent in this flce: " + ", ".join(absent))


if __name__ == "__main__":
    main()
