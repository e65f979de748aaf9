"""Lower every Ascend kernel variant through triton-ascend's own compiler, up to BiSheng.

Runs in a virtual environment with ``triton-ascend==3.2.0`` (it installs itself as ``triton``;
``make ascend-venv`` builds one under build/), on any machine: no NPU and no CANN toolkit needed.

1. **Variants from the launchers.** flce's own launchers (``ops.AscendChunkKernels``) are called
   on meta tensors for each SoC (UB size from ``ops.ub_bytes_for_arch``), vocabulary size, logits
   dtype and option set, with a recorder in place of the kernels: every launch records its
   arguments. Chunks of 2**31 logits or more (int64 offsets) and a last chunk of one row are among
   them. The recorded calls are bound and specialised exactly as triton-ascend's JIT does on a
   launch (``JITFunction.binder``, ``AttrsDescriptor``: pointers 16-byte aligned as device
   allocations are, integers equal to 1 become constants).
2. **Compile.** Each distinct source goes through ``triton.compile`` for an ``npu`` target:
   the ``ttir`` stage (triton-ascend's frontend) and ``ttadapter`` (``triton-adapter-opt``: Triton
   IR to HIVM / HFusion / Linalg). The next stage is BiSheng (``bishengir-compile``, part of CANN):
   without ``ASCEND_HOME_PATH`` it stops there, and that stop, and only that one, counts as a pass.
   With CANN installed the same run also compiles the binaries (stage ``npubin``).
3. **Unified Buffer.** The ``ttadapter`` IR's inner-loop footprint (tools/ascend/ub_footprint.py)
   must fit the share of the UB that flce's tiling allots to the working set
   (``ops.UB_SAFETY_FRACTION`` of the SoC's UB), for the block the tiling picked; and it must not
   exceed the tiling's own estimate (``ops.FOOTPRINTS``), so that the estimate stays an upper bound
   of what the compiler's IR holds.

    build/ascend-venv/bin/python tools/ascend/compile_check.py --jobs 2 --json build/ascend-compile.json

Exit status 0 when every variant passes, 1 otherwise; the JSON lists each variant's stages,
its UB figures and, on failure, the compiler's message.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
# With the interpreter on, @triton.jit makes interpreted functions, which cannot be compiled.
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "ascend"))

import torch  # noqa: E402
from ub_footprint import loop_footprints  # noqa: E402

from flce.backends.ascend import distill_ops, ops  # noqa: E402
from flce.backends.ascend import plan as ascend_plan  # noqa: E402
from flce.config import LCEConfig  # noqa: E402
from flce.distillation.config import DistillationConfig  # noqa: E402
from flce.distillation.semantics import PairCoefficients, PairStats  # noqa: E402
from flce.gradients import GradCoefficients  # noqa: E402

# SoC names as triton-ascend's target reports them; the UB of each comes from ops.ub_bytes_for_arch.
SOCS = ("Ascend910B3", "Ascend910_9391", "Ascend910_9599")
VOCABS = (32000, 128256, 151936)
DTYPES = ("bfloat16", "float16", "float32")
# Tokens of the call whose chunks are launched (the plan picks the chunk size from the budget).
TOKENS = 8192
HIDDEN = 4096
BISHENG_MISSING = "ASCEND_HOME_PATH is not set"


@dataclass(frozen=True)
class Launch:
    """One kernel launch as flce's launcher made it."""

    kernel: str
    args: tuple
    kwargs: dict
    context: str  # what produced it: SoC, vocabulary, dtype, call


class _Recorder:
    """Stands in for kernels.py: ``recorder._plain_loss_kernel[grid](*args, **kwargs)`` records."""

    def __init__(self, context: str, sink: list[Launch]):
        self.context, self.sink = context, sink

    def __getattr__(self, kernel: str):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs) -> None:
                    recorder.sink.append(Launch(kernel, args, kwargs, recorder.context))
                return launch

        return _Grid()


def _full_configs() -> Iterator[tuple[str, LCEConfig, bool]]:
    """Option sets that switch every HAS_*/NEED_* flag of the full kernels, with whether an
    entropy gradient flows (HAS_H): (label, config, has_h)."""
    class_weight = torch.ones(8, device="meta")
    for softcap, temperature, entropy, smoothing, argmax in itertools.product(
            (None, 30.0), (1.0, 0.7), (False, True), ("none", "smoothing", "weighted smoothing"), (False, True)):
        cfg = LCEConfig(softcap=softcap, temperature=temperature, return_entropy=entropy,
                        label_smoothing=0.0 if smoothing == "none" else 0.1,
                        class_weight=class_weight if smoothing == "weighted smoothing" else None,
                        return_token_accuracy=argmax)
        label = f"softcap={softcap} temperature={temperature} entropy={entropy} {smoothing} argmax={argmax}"
        yield label, cfg, entropy


def record_launches(soc: str, vocab: int, dtype_name: str) -> list[Launch]:
    """Every launch flce's launchers make for one SoC, vocabulary size and logits dtype."""
    ub_bytes = ops.ub_bytes_for_arch(soc)
    if ub_bytes is None:
        raise ValueError(f"soc={soc!r}: ops.UB_BYTES_BY_ARCH has no entry for it; expected one of "
                         f"{[prefix for prefix, _ in ops.UB_BYTES_BY_ARCH]}")
    dtype = getattr(torch, dtype_name)
    props = ops.AscendDeviceProperties(vector_cores=ops.DEFAULT_VECTOR_CORES, ub_bytes=ub_bytes,
                                       total_memory_bytes=64 << 30, source=soc)
    kernels = ops.AscendChunkKernels(props)
    chunk_rows = max(1, ascend_plan.DEFAULT_CHUNK_BUDGET // (vocab * dtype.itemsize))
    wide_rows = -(-ops.INT32_LIMIT // vocab)  # the smallest chunk that needs int64 offsets
    launches: list[Launch] = []

    def logits(rows: int) -> torch.Tensor:
        return torch.empty(rows, vocab, dtype=dtype, device="meta")

    def per_row(rows: int) -> torch.Tensor:
        return torch.empty(rows, dtype=torch.float32, device="meta")

    scalar = torch.empty((), dtype=torch.float32, device="meta")
    for rows, rows_label in ((min(chunk_rows, TOKENS), "chunk"), (1, "last chunk of 1 row"), (wide_rows, "wide")):
        context = f"{soc} V={vocab} {dtype_name} {rows_label} ({rows} rows)"
        target = torch.empty(rows, dtype=torch.int64, device="meta")
        with mock.patch.object(ops, "_kernels", lambda: _Recorder(context, launches)):  # noqa: B023
            kernels.plain_loss(logits(rows), target, -100, None)
            for scale in (scalar, per_row(rows)):  # reduction mean/sum, reduction none
                kernels.plain_loss(logits(rows), target, -100, scale)
                kernels.plain_grad_(logits(rows), target, -100, per_row(rows), scale)
            for _label, cfg, has_h in _full_configs():
                stats = kernels.row_stats(logits(rows), target, cfg, 0)
                coeffs = GradCoefficients(a=per_row(rows), h=per_row(rows) if has_h else None, d=per_row(rows),
                                          e=per_row(rows) if cfg.label_smoothing else None)
                kernels.full_grad_(logits(rows), target, cfg, 0, stats.row_max, coeffs)
        distillation = distill_ops.AscendPairKernels(props)
        with mock.patch.object(distill_ops, "_kernels", lambda: _Recorder(context, launches)):  # noqa: B023
            record_distillation(distillation, logits, per_row, target, rows)
    # In-forward gradients of hidden [TOKENS, H] and weight [V, H], and one past int32 offsets.
    for numel in (TOKENS * HIDDEN, vocab * HIDDEN, ops.INT32_LIMIT):
        context = f"{soc} V={vocab} {dtype_name} scale of {numel} elements"
        with mock.patch.object(ops, "_kernels", lambda: _Recorder(context, launches)):  # noqa: B023
            kernels.scale_(torch.empty(numel, dtype=dtype, device="meta"), scalar)
    return launches


def _distillation_configs() -> Iterator[DistillationConfig]:
    """Option sets that switch every flag of the distillation kernels: each loss with and without the
    teacher's gradient and the hard-label term (at temperature 1, sharing the student's softmax, and at
    another, with its own), and the hard term alone."""
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        for teacher in (False, True):
            for hard_label_weight, temperature in ((0.0, 1.0), (0.5, 1.0), (0.5, 2.0)):
                yield DistillationConfig(loss=loss, teacher_grad=teacher, hard_label_weight=hard_label_weight,
                                         temperature=temperature)
    yield DistillationConfig(loss="jsd", hard_label_weight=1.0)


def record_distillation(kernels: distill_ops.AscendPairKernels, logits, per_row, target: torch.Tensor,
                        rows: int) -> None:
    """The distillation launchers' launches for one chunk size: every option set of _distillation_configs."""
    for cfg in _distillation_configs():
        kernels.pair_stats(logits(rows), logits(rows), target, cfg, 0)
        stats = PairStats(teacher_max=per_row(rows), teacher_log_sum=per_row(rows), student_max=per_row(rows),
                          student_log_sum=per_row(rows))
        if cfg.soft and cfg.loss == "jsd":
            kernels.mixture_sums(logits(rows), logits(rows), stats, cfg)
        coeffs = PairCoefficients(
            teacher_max=per_row(rows), teacher_log_sum=per_row(rows), student_max=per_row(rows),
            student_log_sum=per_row(rows), soft_scale=per_row(rows),
            student_center=per_row(rows) if cfg.loss != "forward_kl" else None,
            teacher_center=per_row(rows) if cfg.teacher_grad and cfg.loss != "reverse_kl" else None,
            hard_lse=per_row(rows) if cfg.hard else None, hard_scale=per_row(rows) if cfg.hard else None,
            teacher_scale=per_row(rows) if cfg.teacher_grad else None)
        kernels.pair_grad_(logits(rows), logits(rows), target, cfg, 0, coeffs)


def _kernel_functions() -> dict:
    from flce.backends.ascend import distill_kernels, kernels

    return {name: getattr(module, name) for module in (kernels, distill_kernels) for name in dir(module)
            if name.endswith("_kernel")}


def _ast_source(launch: Launch):
    """The ASTSource triton-ascend's JITFunction.run builds for this launch (its binder, its
    AttrsDescriptor), with the same signature, constants and specialisation."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = _kernel_functions()[launch.kernel]
    backend = make_backend(GPUTarget("npu", SOCS[0], 0))
    if fn.binder is None:
        fn.create_binder(backend)
    bound_args, sig_and_spec, _constexpr_vals, _non_constexpr_vals, excess = fn.binder(*launch.args, **launch.kwargs)
    if excess:
        raise TypeError(f"{launch.kernel}: keyword arguments {sorted(excess)} are not parameters of the kernel")
    bound_vals = tuple(bound_args.values())
    sigkeys = [fn.params[i].name for i in fn.non_constexpr_indices]
    signature = {k: ("*i8" if v == "none" else v) for k, v in zip(sigkeys, sig_and_spec[:len(sigkeys)], strict=True)}
    attrs = backend.get_attrs_descriptor(fn.params, bound_vals)
    constant_params = attrs.get_constants()
    constants = {p.name: v for v, p in zip(bound_vals, fn.params, strict=True)
                 if p.is_constexpr or p.num in constant_params or v is None}
    return ASTSource(fn, signature, constants, attrs)


@dataclass
class VariantResult:
    kernel: str
    key: str  # the source's hash: launches with equal keys share one compile
    constants: dict
    signature: dict
    contexts: list
    stages: list  # stages whose IR was produced
    stopped_at: str  # "" when every stage ran; else the stage and why
    error: str  # "" unless the variant failed
    block: int
    ub_bytes: int  # smallest UB among the SoCs that use this block
    ub_share_bytes: int  # the tiling's share of it
    ir_footprint_bytes: int
    tiling_estimate_bytes: int
    ir_live_at_peak: list

    @property
    def ub_ok(self) -> bool:
        """The IR's footprint is within the tiling's estimate, and that within the UB share."""
        return self.ir_footprint_bytes <= self.tiling_estimate_bytes <= self.ub_share_bytes

    @property
    def passed(self) -> bool:
        return not self.error and self.ub_ok


def _block_of(constants: dict) -> int:
    return int(constants.get("BLOCK_V", constants.get("BLOCK", 0)))


def _footprint_name(kernel: str, constants: dict) -> str:
    """The ops.FOOTPRINTS entry the launcher sized this launch's block with (plain_loss writing
    gradients is sized as plain_grad, as ops.AscendChunkKernels.plain_loss does)."""
    if kernel == "_plain_loss_kernel" and constants.get("WRITE_GRAD"):
        return "plain_grad"
    return kernel.removeprefix("_").removesuffix("_kernel")


def compile_variant(launch: Launch, arch: str) -> dict:
    """ttir and ttadapter of one launch in a fresh Triton cache; the IR's UB footprint."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.errors import MLIRCompilationError

    src = _ast_source(launch)
    with tempfile.TemporaryDirectory(prefix="flce-ascend-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        stopped_at, error = "", ""
        try:
            triton.compile(src, target=GPUTarget("npu", arch, 0))
        except MLIRCompilationError as exc:
            if exc.stage_name == "ConvertLinalgRToBinary" and BISHENG_MISSING in str(exc):
                stopped_at = f"npubin: BiSheng not installed ({BISHENG_MISSING})"
            else:
                error = f"{exc.stage_name}: {exc}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        produced = {Path(p).suffix[1:]: Path(p).read_text() for p in glob.glob(os.path.join(cache, "*", "*"))}
    stages = [s for s in ("ttir", "ttadapter", "npubin") if s in produced]
    if not error and stages[:2] != ["ttir", "ttadapter"]:
        error = f"the compile stopped without the ttir and ttadapter IR (stages produced: {stages})"
    footprints = loop_footprints(produced["ttadapter"]) if "ttadapter" in produced else []
    peak = max(footprints, key=lambda f: f.peak_bytes) if footprints else None
    if "ttadapter" in produced and peak is None:
        error = error or "no inner loop with UB buffers found in the ttadapter IR"
    return {"stages": stages, "stopped_at": stopped_at, "error": error,
            "ir_footprint_bytes": peak.peak_bytes if peak else 0,
            "ir_live_at_peak": [f"{b.value} {b.kind} {b.bytes}" for b in peak.live_at_peak] if peak else []}


def _compile_job(job: tuple[Launch, str]) -> dict:
    return compile_variant(*job)


def run(socs: tuple[str, ...], vocabs: tuple[int, ...], dtypes: tuple[str, ...], jobs: int) -> list[VariantResult]:
    launches = [launch for soc, vocab, dtype in itertools.product(socs, vocabs, dtypes)
                for launch in record_launches(soc, vocab, dtype)]
    variants: dict[str, VariantResult] = {}
    firsts: dict[str, Launch] = {}
    for launch in launches:
        src = _ast_source(launch)
        key = src.hash()
        soc = launch.context.split()[0]
        ub = ops.ub_bytes_for_arch(soc)
        if key not in variants:
            block = _block_of(src.constants)
            dtype_bytes = {"*bf16": 2, "*fp16": 2, "*fp32": 4}[next(iter(src.signature.values()))]
            footprint = ops.FOOTPRINTS[_footprint_name(launch.kernel, src.constants)]
            per_element = footprint.bytes_per_element(dtype_bytes, bool(src.constants.get("HAS_SOFTCAP")))
            variants[key] = VariantResult(
                kernel=launch.kernel, key=key, constants={k: v for k, v in src.constants.items() if isinstance(k, str)},
                signature=src.signature, contexts=[], stages=[], stopped_at="", error="", block=block,
                ub_bytes=ub, ub_share_bytes=int(ub * ops.UB_SAFETY_FRACTION), ir_footprint_bytes=0,
                tiling_estimate_bytes=block * per_element, ir_live_at_peak=[])
            firsts[key] = launch
        variant = variants[key]
        variant.contexts.append(launch.context)
        if ub < variant.ub_bytes:
            variant.ub_bytes, variant.ub_share_bytes = ub, int(ub * ops.UB_SAFETY_FRACTION)
    keys = list(variants)
    jobs_list = [(firsts[k], firsts[k].context.split()[0]) for k in keys]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, outcome in zip(keys, pool.map(_compile_job, jobs_list, chunksize=4), strict=True):
            for name, value in outcome.items():
                setattr(variants[key], name, value)
    return list(variants.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socs", default=",".join(SOCS))
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    parser.add_argument("--json", type=Path, help="write every variant's result here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(tuple(args.socs.split(",")), tuple(int(v) for v in args.vocabs.split(",")),
                  tuple(args.dtypes.split(",")), args.jobs)
    failed = [r for r in results if not r.passed]
    for r in sorted(results, key=lambda r: (r.kernel, -r.ir_footprint_bytes)):
        if not r.passed:
            print(f"FAILED {r.kernel} {r.constants} {r.signature}\n  {r.error or 'UB'}: IR footprint "
                  f"{r.ir_footprint_bytes} B, tiling estimate {r.tiling_estimate_bytes} B, UB share "
                  f"{r.ub_share_bytes} B\n  e.g. {r.contexts[0]}")
    by_kernel: dict[str, list[VariantResult]] = {}
    for r in results:
        by_kernel.setdefault(r.kernel, []).append(r)
    print(f"{'kernel':<20} {'variants':>8} {'passed':>6} {'worst IR footprint / UB share':>32}")
    for kernel, rs in sorted(by_kernel.items()):
        worst = max(rs, key=lambda r: r.ir_footprint_bytes / r.ub_share_bytes)
        print(f"{kernel:<20} {len(rs):>8} {sum(r.passed for r in rs):>6} "
              f"{worst.ir_footprint_bytes:>12} / {worst.ub_share_bytes} (BLOCK {worst.block})")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed "
          f"({time.perf_counter() - start:.0f} s, stages ttir + ttadapter, "
          f"{sum(bool(r.stopped_at) for r in results)} stopped at BiSheng)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**asdict(r), "passed": r.passed} for r in results], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
