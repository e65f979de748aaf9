"""``flce.explain`` / ``python -m flce explain``: the record of what a call runs, made without the device.

On the CPU: every kernel a record names (and every fallback) is a real function of the module it names, for
the H100, the H200, an A100, the CPU and an Ascend NPU; the record explain prints equals the one a real call
plans (the reference backend; the CUDA backend under the Triton interpreter, and on a described H100 whose
description is injected where a call reads its device's). On a GPU (``cuda``): the kernels that ran are the
ones the record named (tests/test_explain_gpu.py).
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from helpers import TORCH_GEMMS, count_launches

import flce
from flce.__main__ import main
from flce.config import LCEConfig
from flce.engine import run as engine_run
from flce.engine.choice import CallChoice

H100, H200, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"
RL = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "temperature": 0.7}
CALLS = {
    "default": {},
    "no-grad": {"training": False},
    "rl": RL,
    "rl-no-grad": dict(RL, training=False),
    "smoothing-softcap-bias": {"label_smoothing": 0.1, "softcap": 30.0, "bias": True},
    "budget-64MiB": {"memory_budget": 64 << 20},
    "budget-64MiB-rl": dict(RL, memory_budget=64 << 20),
    "accurate-fp32-accumulation": {"precision": "accurate", "accum_dtype": torch.float32},
}
DEVICES = {"H100": {"device": "cuda", "gpu": H100}, "H200": {"device": "cuda", "gpu": H200},
           "A100": {"device": "cuda", "gpu": A100}, "cpu": {"device": "cpu"}, "npu": {"device": "npu"}}


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ImportError(path)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_records_name_real_functions(device: str, call: str) -> None:
    pytest.importorskip("triton")
    record = flce.explain(**DEVICES[device], shape="8192x4096x128256", dtype="bfloat16", **CALLS[call])
    backend = {"cpu": "reference", "npu": "ascend"}.get(device, "cuda")
    assert record.backend == backend
    names = record.kernel_names() | {k for step in record.steps for k in step.fallback}
    assert names and all(step.reason for step in record.steps)
    for name in names:
        assert callable(resolve(name)) or hasattr(resolve(name), "fn"), name  # a function or a Triton kernel
    text = str(record)
    assert f"backend: {backend}" in text and "schedule:" in text and "memory:" in text


def test_hopper_defaults_name_the_warp_specialised_kernel_and_the_shipped_entry() -> None:
    """The default bf16 training call at 8192x4096x128256: 2048-row chunks from the shipped H100 entry, each
    chunk's kept exponentials from the warp-specialised statistics GEMM, cuBLAS gradient products; on an A100
    no warp-specialised kernel and no H100 entry."""
    h100 = flce.explain("cuda", gpu=H100, shape="8192x4096x128256", dtype="bfloat16")
    assert h100.plan.tokens_per_chunk == 2048 and h100.plan.chunk_grad == "exponentials"
    assert "nvidia-h100.yaml" in h100.cache
    ws = "flce.backends.cuda.ws_gemm_kernels._ws_gemm_kernel"
    assert h100.steps[0].kernels == ("flce.backends.cuda.target_kernels._count_tokens_kernel",)
    assert ws in h100.steps[1].kernels and "torch.mm" in h100.steps[2].kernels
    a100 = flce.explain("cuda", gpu=A100, shape="8192x4096x128256", dtype="bfloat16")
    assert ws not in a100.kernel_names() and a100.cache.startswith("none")
    assert a100.plan.forward_logits == "cublas" and "flce.backends.cuda.kernels._plain_forward_kernel" in \
        a100.kernel_names()
    # A Triton older than flce's kernels build with: the cuda backend cannot run there, as a call would find.
    old_triton = flce.explain("cuda", gpu=H100, triton="3.4.0", shape="8192x4096x128256", dtype="bfloat16")
    assert old_triton.backend == "reference" and ws not in old_triton.kernel_names()
    with pytest.raises(RuntimeError, match=r"backend='cuda': backend is not available: triton 3.4.0 is older than 3.5"):
        flce.explain("cuda", gpu=H100, triton="3.4.0", shape="8192x4096x128256", backend="cuda")


def test_explain_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--device", "cuda", "--gpu", H200, "--dtype", "bfloat16", "--shape", "16384x4096x151936",
                 "--reduction", "none", "--return-logprobs", "true", "--memory_budget", "512MiB", "--no-grad"])
    out = capsys.readouterr().out
    assert code == 0
    assert "backend: cuda" in out and "device: NVIDIA H200, sm_90" in out and "no gradient" in out
    assert "ws_gemm_kernels._ws_gemm_kernel" in out and "why:" in out
    assert "options: reduction=none, memory_budget=536870912, return_logprobs=True" in out


def test_explain_command_errors_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--shape", "8192x4096"], ["--gpu", "NVIDIA Imaginary", "--shape", "1x2x3"],
                 ["--shape", "8x8x8", "--temperature", "0"], ["--shape", "8x8x8", "--reduction", "mode"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["explain", *argv])
        assert exit_info.value.code == 2
        assert "explain:" in capsys.readouterr().err


def _planned(monkeypatch: pytest.MonkeyPatch, step) -> CallChoice:
    """The record of the call ``step`` makes (the eager path's EngineCall carries it)."""
    records = []
    real = engine_run.apply_eager

    def capturing(flat, call):
        records.append(call.choice)
        return real(flat, call)

    monkeypatch.setattr(engine_run, "apply_eager", capturing)
    step()
    assert len(records) == 1 and records[0] is not None
    return records[0]


def _small_inputs(generator: torch.Generator, training: bool, bias: bool) -> tuple:
    """(hidden [40, 16], weight [96, 16], bias [96] or None, target [40]), leaves that require grad when training."""
    n, h, v = 40, 16, 96
    x = torch.randn(n, h, generator=generator).requires_grad_(training)
    w = torch.randn(v, h, generator=generator).requires_grad_(training)
    b = torch.randn(v, generator=generator).requires_grad_(training) if bias else None
    t = torch.randint(0, v, (n,), generator=generator)
    return x, w, b, t


@pytest.mark.parametrize("call", ["default", "no-grad", "rl", "smoothing-softcap-bias", "budget-64MiB"])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_explain_equals_what_a_call_plans(backend: str, call: str, monkeypatch: pytest.MonkeyPatch,
                                          generator: torch.Generator) -> None:
    """A CPU call (the CUDA backend: in the Triton interpreter) and explain of the same description."""
    if backend == "cuda":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("interpreter test: runs where there is no GPU")
    options = dict(CALLS[call])
    training, bias = options.pop("training", True), options.pop("bias", False)
    if "memory_budget" in options:
        options["memory_budget"] = 64 << 10  # small inputs: a budget that makes small chunks
    x, w, b, t = _small_inputs(generator, training, bias)

    def step() -> None:
        out = flce.linear_cross_entropy(x, w, t, b, backend=backend, **options)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        if training:
            loss.sum().backward()

    planned = _planned(monkeypatch, step)
    explained = flce.explain("cpu", backend=backend, shape=(*x.shape, w.shape[0]), dtype="float32",
                             training=training, bias=bias, **options)
    assert explained == planned
    assert explained.backend == backend


@pytest.mark.parametrize("options", [{}, RL, {"memory_budget": 64 << 20}], ids=["default", "rl", "budget"])
def test_explain_equals_the_plan_on_a_described_gpu(options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's planner reads its device through one function (hardware.describe_device): with an
    H100's description injected there, a call's record on CPU tensors (planned, not run) equals explain's."""
    pytest.importorskip("triton")
    from flce.backends import cuda
    from flce.backends.cuda import hardware
    from flce.engine.plans import PlanRequest
    from flce.inputs import prepare_inputs

    monkeypatch.setattr(hardware, "describe_device", lambda device: hardware.gpu_description(H100))
    n, h, v = 8192, 4096, 128256
    x, w = (torch.empty(n, h, dtype=torch.bfloat16), torch.empty(v, h, dtype=torch.bfloat16))
    t = torch.zeros(n, dtype=torch.int64)
    cfg = LCEConfig(**options)
    variant = "full" if cfg.needs_full else "plain"
    planned = cuda.BACKEND.plan_call(prepare_inputs(x, w, t, None, cfg), cfg, variant, PlanRequest(training=True))
    explained = flce.explain("cuda", gpu=H100, shape=(n, h, v), dtype="bfloat16", **options)
    assert planned.choice == explained
    assert planned.plan == explained.plan


# Interpreter tiles: several vocabulary tiles and splits at V = 96.
_TILES = {"gemm_block_m": 16, "gemm_block_n": 32, "gemm_block_k": 16, "gemm_group_m": 2, "gemm_warps": 4,
          "gemm_stages": 1, "gemm_splits": 2}
_CHUNKS = {"tokens_per_chunk": 16, "grad_schedule": "token_chunks"}
# The modules of the Triton kernels a call under the interpreter can launch (the Gluon ones need a Hopper GPU).
INTERPRETER_KERNEL_MODULES = ("kernels", "gemm_kernels", "exp_grad_kernels", "target_kernels")
INTERPRETER_CALLS = {  # name: (options, bias, training, autotune knobs, logits-save limit)
    "cublas-plain": ({}, False, True, _CHUNKS, None),
    "cublas-full-bias": ({"label_smoothing": 0.1}, True, True, _CHUNKS, None),
    "triton-logits": ({}, True, True, dict(_TILES, **_CHUNKS, forward_logits="fused", logits_kernel="triton"), None),
    "exponentials": ({}, False, True, dict(_TILES, **_CHUNKS, chunk_grad="exponentials"), None),
    "exponentials-fp32-accumulation": ({"accum_dtype": torch.float32}, False, True,
                                       dict(_TILES, **_CHUNKS, chunk_grad="exponentials"), None),
    "vocab-blocks-fused": ({"label_smoothing": 0.1}, True, True,
                           dict(_TILES, forward_stats="fused", backward_grad="fused", grad_schedule="vocab_blocks",
                                grad_vocab_block=32), None),
    "deferred-kept": (RL, False, True, _CHUNKS, 1 << 30),
    "deferred-recomputed-fused": (RL, True, True, dict(_TILES, **_CHUNKS, forward_stats="fused", backward_grad="fused"),
                                  0),
    "no-grad-fused-stats": (RL, False, False, dict(_TILES, forward_stats="fused"), None),
}


@pytest.mark.parametrize("name", list(INTERPRETER_CALLS))
def test_interpreter_kernels_that_ran_are_the_ones_the_record_named(name: str, monkeypatch: pytest.MonkeyPatch,
                                                                    generator: torch.Generator) -> None:
    """The CPU analogue of tests/test_explain_gpu.py: every Triton kernel launch counted by name (the CUDA
    backend in the interpreter), the torch GEMMs too; they are exactly the kernels and GEMMs the call's
    record names (torch's other ops, a column sum, are not counted)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    from flce.autotune import override_params

    options, bias, training, knobs, limit = INTERPRETER_CALLS[name]
    ran = count_launches(monkeypatch, INTERPRETER_KERNEL_MODULES)
    x, w, b, t = _small_inputs(generator, training, bias)

    def step() -> None:
        with override_params(knobs, limit, backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", **options)
        if training:
            loss = out if isinstance(out, torch.Tensor) else out.loss.sum() + out.entropy.sum() + out.logprobs.sum()
            loss.backward()

    record = _planned(monkeypatch, step)
    named = {k for k in record.kernel_names() if k.startswith("flce.") or k in TORCH_GEMMS}
    assert ran == named, f"ran {sorted(ran)}\n{record}"


# ------------------------------------------------------------------ explain refuses what a call refuses


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"variant": "fastest"}, ValueError, "variant='fastest': expected 'auto', 'plain' or 'full'"),
    ({"variant": "plain", "label_smoothing": 0.1}, ValueError, "variant='plain' cannot serve label_smoothing"),
    ({"dtype": "int32"}, ValueError, "expected a floating torch dtype"),
    ({"dtype": torch.int32}, ValueError, "expected a floating"),
    ({"shape": (8, 8, 8.5)}, ValueError, "expected three whole numbers"),
    ({"gpu": "NVIDIA H100 80GB HBM3", "multiprocessors": -4}, ValueError, "multiprocessors=-4: expected a positive"),
    ({"gpu": "NVIDIA Imaginary", "capability": (9, 0), "multiprocessors": 0, "total_memory": 1 << 30}, ValueError,
     "multiprocessors=0: expected a positive number"),
    ({"gpu": "NVIDIA Imaginary", "capability": (9, 0), "multiprocessors": 8, "total_memory": 0}, ValueError,
     "total_memory=0: expected a positive number"),
    ({"backend": "nonesuch"}, ValueError, "backend='nonesuch': unknown backend"),
    ({"device": "npu", "backend": "cuda"}, RuntimeError, "backend='cuda': backend is not available"),
    ({"device": "cpu", "gpu": "NVIDIA H100 80GB HBM3"}, ValueError, "describes a GPU, but device='cpu'"),
    ({"batch_invariant": True, "backend": "cuda"}, ValueError, "backend 'cuda' does not support this call"),
])
def test_explain_refuses_what_a_call_refuses(kwargs: dict, error: type, message: str) -> None:
    """The same checks as a real call (the options, the variant, the inputs' dtype, selection with the described
    device's hardware present), with the same errors; the described device's own figures are checked too."""
    options = {"device": "cuda", "shape": "64x32x128", **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        flce.explain(**options)


def test_explain_errors_on_the_command_line_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--backend", "nonesuch"], ["--device", "npu", "--backend", "cuda"], ["--variant", "plain",
                                                                                       "--label_smoothing", "0.1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["explain", "--shape", "64x32x128", *argv])
        assert exit_info.value.code == 2 and "explain:" in capsys.readouterr().err


def test_the_record_shows_what_runs_in_words() -> None:
    """The schedule line says what runs (no dataclass repr, no cuBLAS on a CPU or NPU plan, no backward recompute
    or statistics pass where none runs), the memory line no 0 KiB of working memory beside the kept logits, and a
    batch-invariant plan counts the padded copy of its inputs."""
    in_forward = str(flce.explain("cuda", gpu=H100, shape="8192x4096x128256"))
    schedule = next(line for line in in_forward.splitlines() if line.startswith("schedule:"))
    assert "TokenChunks(" not in schedule and "recomputed" not in schedule and "statistics at once" not in schedule
    assert schedule.startswith("schedule: token chunks: 4 of up to 2048 rows")
    for device in ("cpu", "npu"):
        record = str(flce.explain(device, shape="4096x1024x32000"))
        assert "cublas" not in record.split("steps")[0] and "a GEMM and the row kernels" in record
    kept = str(flce.explain("cuda", gpu=H100, shape="8192x4096x128256", **RL))
    assert "working memory none beyond the kept logits" in kept and "0.0 KiB" not in kept
    assert "the logits of all rows kept for backward" in kept and "recomputed" not in kept
    recomputed = str(flce.explain("cuda", gpu=H100, shape="8192x4096x128256", memory_budget=512 << 20, **RL))
    assert "gradient in backward" in recomputed or "recomputed in backward" in recomputed
    tiles = flce.explain("cpu", shape="1000x1024x32000", batch_invariant=True).memory
    padded = 1024 * (1024 * 2 + 8)  # 1000 tokens padded to 8 tiles of 128, a bf16 copy of hidden and the targets
    assert tiles.working_bytes >= padded and "padded" in tiles.budget_from


def test_explain_and_autotune_read_sizes_alike() -> None:
    """One parser of sizes for explain's --memory / --memory_budget and flce-autotune's --memory-budget: binary
    units for KiB/MiB/GiB, decimal (SI) ones for KB/MB/GB."""
    from flce.autotune.cli import parse_bytes as autotune_bytes
    from flce.config import parse_bytes

    for text, value in (("512MiB", 512 << 20), ("512MB", 512 * 10**6), ("2GiB", 2 << 30), ("1000", 1000)):
        assert parse_bytes("--memory_budget", text) == value == autotune_bytes("--memory-budget", text)
    record = flce.explain("cuda", gpu=H100, shape="8192x4096x128256", memory_budget=parse_bytes("x", "512MB"))
    assert "budget 488.3 MiB (memory_budget)" in str(record)
