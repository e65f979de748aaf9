"""Compile and run the Ascend backend's Triton kernels on an NVIDIA GPU.

No Ascend NPU is reachable from here. The interpreter checks the kernels' arithmetic but not that
a compiler accepts them; this script has upstream Triton compile the very same kernels for CUDA
tensors and checks the results, which catches type errors (int32 / int64 offsets, loop-carried
scalars, constexpr branches) the interpreter lets through. It does not show that triton-ascend's
compiler (BiSheng) accepts them or that the UB estimate holds: that needs a real NPU.

Steps, all on the first CUDA device:

1. tests/test_ascend_contract.py with FLCE_ASCEND_CONTRACT_DEVICE=cuda, twice: with the CI's
   small UB / few cores (many blocks per row, grid-strided rows), and with a 910B's figures
   (192 KiB UB, 40 vector cores: the block sizes the NPU would get).
2. Realistic shapes in bf16 with 910B figures, against the reference backend on the same inputs
   and against float32 materialised torch.
3. A chunk of more than 2**31 logits, so the kernels take their int64 row offsets.

    python tools/ascend/check_on_gpu.py          # writes results to $OUT (or ./ascend_on_gpu)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NPU_910B = {"FLCE_ASCEND_UB_BYTES": str(192 * KiB), "FLCE_ASCEND_VECTOR_CORES": "40"}


def run_contract(label: str, extra_env: dict[str, str], out_dir: Path) -> dict:
    env = {**os.environ, "FLCE_ASCEND_CONTRACT_DEVICE": "cuda", **extra_env}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "tests/test_ascend_contract.py", "-q", "-p", "no:cacheprovider", "-rfEs"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out_dir / f"contract_{label}.txt").write_text(proc.stdout + proc.stderr)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return {"label": label, "env": extra_env, "returncode": proc.returncode, "summary": summary,
            "seconds": round(time.perf_counter() - start, 1)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run_backend(name: str, hidden, weight, target, options: dict, upstream: dict):
    """Loss, extras and grads through a backend's descriptor (the registry never sends CUDA
    tensors to the Ascend backend), with the given upstream gradients."""
    from flce.config import LCEConfig
    from flce.engine.run import run_backend
    from flce.inputs import prepare_inputs
    from flce.registry import registered_backends

    backend = next(b for b in registered_backends() if b.name == name)
    cfg = LCEConfig(**options)
    x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    flat = prepare_inputs(x, w, target, None, cfg)
    out = run_backend(backend, flat, cfg, "full" if cfg.needs_full else "plain")
    outs = {"loss": out} if isinstance(out, torch.Tensor) else {k: v for k, v in out._asdict().items() if v is not None}
    total = sum((outs[k].float() * g).sum() for k, g in upstream.items())
    grad_x, grad_w = torch.autograd.grad(total, (x, w))
    return {k: v.detach() for k, v in outs.items()}, grad_x, grad_w


def _materialised(hidden, weight, target, options: dict, upstream: dict):
    """float32 torch on the full logits: the independent check at sizes float64 cannot hold."""
    x, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    u = x @ w.t()
    if options.get("softcap"):
        u = options["softcap"] * torch.tanh(u / options["softcap"])
    z = u / options.get("temperature", 1.0)
    valid = target != -100
    smoothing = options.get("label_smoothing", 0.0)
    ce = torch.nn.functional.cross_entropy(z, target, reduction="none", label_smoothing=smoothing)
    lse = torch.logsumexp(z, 1)
    ce = ce + options.get("lse_square_scale", 0.0) * lse.square() * valid
    reduction = options.get("reduction", "mean")
    loss = ce if reduction == "none" else ce.sum() / (valid.sum() if reduction == "mean" else 1)
    outs = {"loss": loss}
    if options.get("return_logprobs"):
        outs["logprobs"] = torch.where(valid, z.gather(1, target.clamp(0)[:, None])[:, 0] - lse, 0.0)
    if options.get("return_entropy"):
        outs["entropy"] = torch.where(valid, -(z.softmax(1) * z.log_softmax(1)).sum(1), 0.0)
    total = sum((outs[k] * g).sum() for k, g in upstream.items())
    grad_x, grad_w = torch.autograd.grad(total, (x, w))
    return {k: v.detach() for k, v in outs.items()}, grad_x, grad_w


def compare_shape(tokens: int, hidden_size: int, vocab: int, options: dict, *, seed: int = 0) -> dict:
    from flce.backends.ascend import ops
    from flce.testing.measure import shape_inputs

    x, w, t, g = shape_inputs(tokens, hidden_size, vocab, "cuda", torch.bfloat16, seed=seed, requires_grad=False)
    per_token = options.get("reduction") == "none"
    # A scalar grad_output other than 1, so the in-place scale_ kernel runs too.
    loss_grad = torch.randn(tokens, device="cuda", generator=g) if per_token else torch.tensor(1.3, device="cuda")
    upstream = {"loss": loss_grad}
    for name in ("logprobs", "entropy"):
        if options.get(f"return_{name}"):
            upstream[name] = torch.randn(tokens, device="cuda", generator=g)
    start = time.perf_counter()
    got, gx, gw = _run_backend("ascend", x, w, t, options, upstream)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref, rx, rw = _run_backend("reference", x, w, t, options, upstream)
    mat, mx, mw = _materialised(x, w, t, options, upstream) if tokens * vocab <= 2**29 else (None, None, None)
    result = {
        "shape": f"{tokens}x{hidden_size}x{vocab}", "options": {k: str(v) for k, v in options.items()},
        "blocks": {k: ops.block_size(k, torch.bfloat16, vocab, 192 * KiB) for k in ops.FOOTPRINTS},
        "first_call_seconds_including_compile": round(seconds, 2),
        "grad_hidden_rel_vs_reference": _relative(gx, rx), "grad_weight_rel_vs_reference": _relative(gw, rw),
    }
    for k, v in got.items():
        if v.is_floating_point():
            result[f"{k}_max_abs_vs_reference"] = float((v.double() - ref[k].double()).abs().max())
            if mat is not None and k in mat:
                result[f"{k}_max_abs_vs_fp32_materialised"] = float((v.double() - mat[k].double()).abs().max())
        else:
            result[f"{k}_equal_to_reference"] = bool(torch.equal(v, ref[k]))
    if mat is not None:
        result["grad_hidden_rel_vs_fp32_materialised"] = _relative(gx, mx)
        result["grad_weight_rel_vs_fp32_materialised"] = _relative(gw, mw)
    return result


def wide_offsets_check() -> dict:
    """One chunk of 16640 x 131072 bf16 logits (2.18e9 elements, 4.1 GiB): int64 row offsets."""
    from flce.backends.ascend import ops

    tokens, hidden_size, vocab = 16640, 128, 131072
    seen = []
    original = ops.needs_wide_offsets

    def recording(logits: torch.Tensor) -> bool:
        seen.append(original(logits))
        return seen[-1]

    ops.needs_wide_offsets = recording
    try:
        results = []
        for options in ({"memory_budget": 6 * GiB},
                        {"memory_budget": 6 * GiB, "reduction": "none", "return_logprobs": True, "softcap": 20.0}):
            results.append(compare_shape(tokens, hidden_size, vocab, options, seed=1))
    finally:
        ops.needs_wide_offsets = original
    return {"launches_with_int64_offsets": sum(seen), "launches": len(seen), "results": results}


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "ascend_on_gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    import triton

    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    report["contract"] = [run_contract("ci_small_ub", {"FLCE_ASCEND_UB_BYTES": "12288",
                                                       "FLCE_ASCEND_VECTOR_CORES": "3"}, out_dir),
                          run_contract("npu_910b", NPU_910B, out_dir)]
    for name, value in NPU_910B.items():
        os.environ[name] = value
    report["shapes"] = [
        compare_shape(4096, 4096, 32000, {}),
        compare_shape(4096, 4096, 128256, {}),
        compare_shape(2048, 2048, 151936, {"reduction": "none", "return_logprobs": True, "return_entropy": True,
                                           "softcap": 30.0, "label_smoothing": 0.1, "lse_square_scale": 1e-4}),
    ]
    report["wide_offsets"] = wide_offsets_check()
    text = json.dumps(report, indent=2)
    (out_dir / "ascend_on_gpu.json").write_text(text)
    print(text)
    failed = [c for c in report["contract"] if c["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
