"""On a GPU: for a set of calls, the kernels that actually ran (torch.profiler's CUDA kernel names) are the
ones the call's record names, and that record is what ``flce.explain`` prints for a description of this GPU.

flce's own kernels are compared by name, both ways (every Triton or Gluon kernel the record names ran, and
no other of flce's kernels did); cuBLAS by presence (a torch GEMM in the record if and only if a cuBLAS
kernel ran)."""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch
from helpers import TORCH_GEMMS, flce_kernel_names, launched, launches_against_record

import flce
from flce.autotune import override_params
from flce.engine import run as engine_run

pytestmark = pytest.mark.cuda

RL = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "temperature": 0.7}
# name: (tokens, hidden, vocab, dtype, bias, training, options, autotune knobs or None; a 0 logits-save limit
# with "deferred-triton-grad", so that its backward recomputes every chunk)
CALLS = {
    "default": (8192, 2048, 32000, torch.bfloat16, False, True, {}, None),
    "bias": (8192, 2048, 32000, torch.bfloat16, True, True, {}, None),
    "fp16": (8192, 2048, 32000, torch.float16, False, True, {}, None),
    "fp32": (2048, 1024, 32000, torch.float32, False, True, {}, None),
    "smoothing-softcap": (8192, 2048, 32000, torch.bfloat16, False, True, {"label_smoothing": 0.1, "softcap": 30.0},
                          None),
    "rl-kept-logits": (8192, 2048, 32000, torch.bfloat16, False, True, RL, None),
    "rl-64MiB": (8192, 2048, 32000, torch.bfloat16, False, True, dict(RL, memory_budget=64 << 20), None),
    "rl-no-grad": (8192, 2048, 32000, torch.bfloat16, False, False, RL, None),
    "plain-no-grad": (8192, 2048, 32000, torch.bfloat16, False, False, {}, None),
    "plain-64MiB": (8192, 2048, 32000, torch.bfloat16, False, True, {"memory_budget": 64 << 20}, None),
    "plain-16MiB": (8192, 2048, 32000, torch.bfloat16, True, True, {"memory_budget": 16 << 20}, None),
    "accurate-fp32-accumulation": (4096, 1024, 32000, torch.bfloat16, False, True,
                                   {"precision": "accurate", "accum_dtype": torch.float32}, None),
    "ws-products": (8192, 2048, 32000, torch.bfloat16, False, True, {}, {"grad_gemm_kernel": "warp_specialized"}),
    "triton-logits": (8192, 2048, 32000, torch.bfloat16, False, True, {},
                      {"forward_logits": "fused", "logits_kernel": "triton", "chunk_grad": "logits"}),
    "deferred-triton-grad": (8192, 2048, 32000, torch.bfloat16, False, True, RL,
                             {"backward_grad": "fused", "forward_stats": "fused", "stats_kernel": "triton"}),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_kernels_that_ran_are_the_ones_explain_named(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n, h, v, dtype, with_bias, training, options, knobs = CALLS[name]
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_(training)
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype).requires_grad_(training)
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_(training) if with_bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    records = []
    real = engine_run.apply_eager
    monkeypatch.setattr(engine_run, "apply_eager", lambda flat, call: records.append(call.choice) or real(flat, call))

    def step() -> None:
        limit = 0 if name == "deferred-triton-grad" else None
        with override_params(knobs, limit, backend="cuda") if knobs else contextlib.nullcontext():
            out = flce.linear_cross_entropy(x, w, t, b, **options)
        if training:
            loss = out if isinstance(out, torch.Tensor) else out.loss.sum() + out.entropy.sum() + out.logprobs.sum()
            loss.backward()

    step()  # compiles the kernels (a compile-time autotune launch would otherwise count)
    names = launched(step)
    record = records[-1]
    ran, named, cublas_ran = launches_against_record(names, record)
    flce_names = flce_kernel_names()
    assert named <= flce_names, f"the record names kernels that are not the backend's: {named - flce_names}"
    assert ran == named, f"{name}: ran {sorted(ran)}, the record named {sorted(named)}\n{record}"
    assert cublas_ran == bool(record.kernel_names() & TORCH_GEMMS), f"{name}: cuBLAS ran: {cublas_ran}\n{record}"
    if knobs is None:
        props = torch.cuda.get_device_properties(0)
        explained = flce.explain("cuda", gpu=torch.cuda.get_device_name(0), capability=(props.major, props.minor),
                                 multiprocessors=props.multi_processor_count, total_memory=props.total_memory,
                                 shape=(n, h, v), dtype=dtype, training=training, bias=with_bias, **options)
        assert explained == record
