"""The Ascend backend's Triton kernels against the float64 materialised computation.

These cases run the real kernels, so they need a Triton that can execute them:

* ``FLCE_ASCEND_CONTRACT_DEVICE=cpu``: CPU tensors through the Triton interpreter
  (``flce.get_impl("cpu", backend="ascend")``). tests/test_ascend.py runs this file so in a
  subprocess, because TRITON_INTERPRET must be set before the kernels are decorated and must not
  leak into the other tests of the parent process.
* ``FLCE_ASCEND_CONTRACT_DEVICE=cuda``: CUDA tensors, compiled by upstream Triton for the GPU
  (tools/ascend/check_on_gpu.py): a compiler check the interpreter cannot give.
* ``FLCE_ASCEND_CONTRACT_DEVICE=npu``: a real Ascend NPU.

Without the variable the module is skipped. Small UB and few vector cores are injected so that
rows are grid-strided and every row takes several blocks with a partial last one (V = 300).
The interpreter runs each program in Python, so shapes stay tiny: the file takes about 40 s.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("FLCE_ASCEND_CONTRACT_DEVICE", "")
if DEVICE not in ("cpu", "cuda", "npu"):
    pytest.skip("runs in a subprocess from tests/test_ascend.py (or set FLCE_ASCEND_CONTRACT_DEVICE=cpu|cuda|npu)",
                allow_module_level=True)
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# 12 KiB of UB: blocks of 128-256 columns; 3 vector cores: each program takes several rows.
os.environ.setdefault("FLCE_ASCEND_UB_BYTES", "12288")
os.environ.setdefault("FLCE_ASCEND_VECTOR_CORES", "3")

from helpers import (  # noqa: E402
    OPTION_CASES,
    TEMPERATURE,
    assert_entropy_near_eager,
    entropy_errors,
    large_logits_inputs,
    reference_loss,
)
from planning import ascend_plan as ascend_plan_for  # noqa: E402

import flce  # noqa: E402
from flce.backends import ascend  # noqa: E402
from flce.backends.ascend import ops  # noqa: E402
from flce.backends.ascend import plan as ascend_plan  # noqa: E402
from flce.config import LCEConfig  # noqa: E402
from flce.engine.function import apply_eager  # noqa: E402
from flce.engine.plans import PlanRequest  # noqa: E402
from flce.gradients import GradCoefficients  # noqa: E402
from flce.inputs import prepare_inputs  # noqa: E402

# The interpreter indexes numpy arrays in a way numpy >= 1.25 deprecates; not flce's to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

N, H, V = 12, 16, 300


def ascend_loss_fn(**options):
    """The Ascend backend for DEVICE: through the registry on the CPU (interpreter) and the NPU;
    on CUDA, which the registry never routes to it, through its descriptor directly."""
    if DEVICE != "cuda":
        return flce.get_impl(DEVICE, backend="ascend")(**options)
    cfg = LCEConfig(**options)

    def call(hidden, weight, target, bias=None):
        flat = prepare_inputs(hidden, weight, target, bias, cfg)
        return ascend.BACKEND.run(flat, cfg, "full" if cfg.needs_full else "plain")

    return call


def oracle(hidden, weight, target, bias=None, **options):
    """helpers.reference_loss (float64, materialised) as a dict of every output."""
    return reference_loss(hidden, weight, target, bias, **options)._asdict()


def make_inputs(dtype=torch.float32, *, with_bias=False, ignore=(3, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 2
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if with_bias else None
    target = torch.randint(0, V, (N,), generator=g)
    target[list(ignore)] = -100
    class_weight = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    return hidden, weight, bias, target, class_weight


def run_both(options, dtype=torch.float32, *, with_bias=False, ignore=(3, 11), upstream=("loss",), seed=0):
    """Forward and backward through the backend (in dtype, on DEVICE) and the float64 oracle with
    the same random upstream gradients; returns (backend results, oracle results) as dicts."""
    hidden, weight, bias, target, class_weight = make_inputs(dtype, with_bias=with_bias, ignore=ignore, seed=seed)
    opts = dict(options)
    if opts.get("class_weight") == "random":
        opts["class_weight"] = class_weight
    g = torch.Generator().manual_seed(seed + 1)
    results = []
    for run_dtype, device in ((dtype, DEVICE), (torch.float64, "cpu")):
        leaves = [t.to(dtype).to(run_dtype).to(device).requires_grad_() if t is not None else None
                  for t in (hidden, weight, bias)]
        run_opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
        if device == DEVICE and run_dtype == dtype:
            out = ascend_loss_fn(**run_opts)(leaves[0], leaves[1], target.to(device), leaves[2])
            out = {"loss": out} if isinstance(out, torch.Tensor) else {k: v for k, v in out._asdict().items()
                                                                         if v is not None}
        else:
            out = oracle(*leaves[:2], target, leaves[2], **run_opts)
        results.append((out, leaves))
    # The same upstream gradient for both sides, drawn once per output.
    (out, leaves), (ref, ref_leaves) = results
    total, ref_total = 0.0, 0.0
    for name in upstream:
        grad = torch.randn(ref[name].shape, generator=g, dtype=torch.float64)
        total = total + (out[name].double().cpu() * grad).sum()
        ref_total = ref_total + (ref[name] * grad).sum()
    names = [name for name, t in zip(("hidden", "weight", "bias"), leaves, strict=True) if t is not None]
    grads = torch.autograd.grad(total, [t for t in leaves if t is not None])
    ref_grads = torch.autograd.grad(ref_total, [t for t in ref_leaves if t is not None])
    out.update({f"grad_{name}": g for name, g in zip(names, grads, strict=True)})
    ref.update({f"grad_{name}": g for name, g in zip(names, ref_grads, strict=True)})
    return out, ref


def assert_matches(got, want, fwd_tol, bwd_tol):
    for name, value in got.items():
        expected = want[name]
        value = value.cpu()
        if value.dtype == torch.int64:
            assert torch.equal(value, expected), name
            continue
        tol = bwd_tol if name.startswith("grad_") else fwd_tol
        if expected is None:
            assert value is None or not value.abs().max(), f"{name}: expected no gradient"
            continue
        torch.testing.assert_close(value.double(), expected, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")




@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: "+".join(o) or "plain")
def test_every_option_and_reduction_fp32(options, reduction):
    with_bias = len(options) % 2 == 1  # half of the cases carry a bias
    got, want = run_both({**options, "reduction": reduction}, with_bias=with_bias)
    assert_matches(got, want, 1e-5, 1e-4)


@pytest.mark.parametrize("softcap", [1e2, 1e4, 1e8, 1e30])
def test_large_softcaps_fp32(softcap):
    """tanh(u / softcap) near 0 at any cap: built as 1 - e of e = exp(-2|x|) alone it lost softcap * 1e-7 on
    each logit (per-token losses 5e-4 off at a cap of 1e4)."""
    got, want = run_both({"softcap": softcap, "reduction": "none"}, with_bias=True)
    assert_matches(got, want, 1e-5, 1e-4)


def test_upstream_gradients_through_logprobs_and_entropy():
    options = {"reduction": "none", "return_logprobs": True, "return_entropy": True, "softcap": 4.0}
    got, want = run_both(options, with_bias=True, upstream=("loss", "logprobs", "entropy"))
    assert_matches(got, want, 1e-5, 1e-4)


def test_gradient_from_logprobs_alone():
    # The loss takes no part in the graph: backward receives no grad for it at all.
    got, want = run_both({"return_logprobs": True, "temperature": 0.9}, upstream=("logprobs",))
    assert_matches(got, want, 1e-5, 1e-4)


def test_ignore_index_inside_the_vocabulary():
    hidden, weight, _, target, _ = make_inputs(ignore=())
    target[::4] = 7
    for options in ({"ignore_index": 7}, {"ignore_index": 7, "label_smoothing": 0.1}):
        out = ascend_loss_fn(**options)(hidden.float().to(DEVICE), weight.float().to(DEVICE), target.to(DEVICE))
        want = oracle(hidden, weight, target, **options)["loss"]
        torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "return_logprobs": True}])
def test_all_ignored_gives_zero_loss_and_zero_gradients(options):
    got, _ = run_both(options, ignore=tuple(range(N)), with_bias=True)
    assert got["loss"].item() == 0.0
    for name in ("grad_hidden", "grad_weight", "grad_bias"):
        assert not got[name].abs().max(), name


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "return_entropy": True}])
def test_several_chunks_recomputed(options, reduction):
    # A budget of 5 rows of logits: 3 chunks, and no room left to keep the logits for backward.
    budget = 5 * V * 4
    got, want = run_both({**options, "reduction": reduction, "memory_budget": budget}, with_bias=True)
    assert_matches(got, want, 1e-5, 1e-4)


def test_several_chunks_with_saved_logits(monkeypatch):
    # The deferred schedule reusing forward's logits, chunk by chunk.
    monkeypatch.setattr(ascend_plan, "DEFAULT_CHUNK_BUDGET", 7 * V * 4)
    flat = prepare_inputs(*(t.float() for t in make_inputs()[:2]), make_inputs()[3], None, LCEConfig())
    plan = ascend_plan_for(flat, LCEConfig(), ops.device_properties(torch.device("cpu")), "full")
    assert plan.tokens_per_chunk == 7 and plan.saved_rows == flat.target.shape[0]
    got, want = run_both({"reduction": "none", "return_logprobs": True}, upstream=("loss", "logprobs"))
    assert_matches(got, want, 1e-5, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "label_smoothing": 0.1, "accum_dtype": torch.float32}])
def test_half_precision(dtype, options):
    got, want = run_both(options, dtype, with_bias=True)
    fwd_tol = 1e-2 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got["loss"].double().cpu(), want["loss"], rtol=fwd_tol, atol=fwd_tol)
    for name in ("grad_hidden", "grad_weight", "grad_bias"):
        error = (got[name].double().cpu() - want[name]).norm() / want[name].norm()
        # The oracle sees the same rounded inputs; what is left is the GEMMs' and grads' rounding.
        assert error < (5e-3 if dtype == torch.float16 else 2e-2), (name, error.item())


def test_wide_row_offsets_give_the_same_result(monkeypatch):
    # Chunks of 2**31 elements do not fit here: force the kernels' int64 row offsets instead.
    monkeypatch.setattr(ops, "needs_wide_offsets", lambda logits: True)
    options = {"label_smoothing": 0.1, "return_predicted_tokens": True, "reduction": "none"}
    got, want = run_both(options, with_bias=True)
    assert_matches(got, want, 1e-5, 1e-4)
    got, want = run_both({})
    assert_matches(got, want, 1e-5, 1e-4)


def _combine(parts):
    """Shard statistics combined as a vocab-parallel wrapper does (first shard wins argmax ties)."""
    row_max = torch.stack([p.row_max for p in parts]).max(0).values
    sum_exp = sum(p.sum_exp * torch.exp(p.row_max - row_max) for p in parts)
    sum_exp_dz = sum((p.sum_exp_dz + (p.row_max - row_max) * p.sum_exp) * torch.exp(p.row_max - row_max) for p in parts)
    argmax, best = parts[0].argmax.clone(), parts[0].row_max.clone()
    for p in parts[1:]:
        argmax = torch.where(p.row_max > best, p.argmax, argmax)
        best = torch.maximum(best, p.row_max)
    return {
        "lse": row_max + torch.log(sum_exp),
        "target_z": sum(p.target_z for p in parts),
        "entropy": torch.log(sum_exp) - sum_exp_dz / sum_exp,
        "weighted_sum_z": sum(p.weighted_sum_z for p in parts),
        "argmax": argmax,
    }


def test_vocab_shards_match_the_whole_vocabulary():
    """row_stats and full_grad_ on two vocabulary shards (vocab_offset) equal the unsharded scan."""
    hidden, weight, _, target, class_weight = make_inputs()
    cfg = LCEConfig(softcap=3.0, temperature=0.8, label_smoothing=0.1, class_weight=class_weight.float().to(DEVICE),
                    return_entropy=True, return_predicted_tokens=True)
    kernels = ops.AscendChunkKernels(ops.device_properties(torch.device(DEVICE)))
    logits = (hidden @ weight.t()).float()
    split = 137  # shards of 137 and 163 columns: neither a multiple of the block
    parts = [kernels.row_stats(logits[:, s].contiguous().to(DEVICE), target.to(DEVICE), cfg, s.start)
             for s in (slice(0, split), slice(split, V))]
    parts = [type(p)(**{k: (v.cpu() if v is not None else None) for k, v in vars(p).items()}) for p in parts]
    stats = _combine(parts)

    z = 3.0 * torch.tanh(hidden @ weight.t() / 3.0) / 0.8
    valid = target != -100
    torch.testing.assert_close(stats["lse"].double(), torch.logsumexp(z, 1), rtol=1e-5, atol=1e-5)
    want_target_z = torch.where(valid, z.gather(1, target.clamp(0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(stats["target_z"].double(), want_target_z, rtol=1e-5, atol=1e-5)
    entropy = torch.logsumexp(z, 1) - (z.softmax(1) * z).sum(1)
    torch.testing.assert_close(stats["entropy"].double(), entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["weighted_sum_z"].double(), z @ class_weight, rtol=1e-5, atol=1e-4)
    assert torch.equal(stats["argmax"], z.argmax(1))

    # Gradient coefficients of every kind, on each shard: must equal the slices of the whole row's.
    g = torch.Generator().manual_seed(5)
    coeffs = GradCoefficients(*(torch.randn(N, generator=g) for _ in range(4)))
    lse = stats["lse"].float()
    whole = kernels.full_grad_(logits.clone().to(DEVICE), target.to(DEVICE), cfg, 0, lse.to(DEVICE),
                               GradCoefficients(*(c.to(DEVICE) for c in vars(coeffs).values())))
    for s in (slice(0, split), slice(split, V)):
        shard = kernels.full_grad_(logits[:, s].contiguous().to(DEVICE), target.to(DEVICE), cfg, s.start,
                                   lse.to(DEVICE), GradCoefficients(*(c.to(DEVICE) for c in vars(coeffs).values())))
        torch.testing.assert_close(shard.cpu(), whole.cpu()[:, s], rtol=1e-6, atol=1e-6)

    # And the whole row's gradient is the formula of flce.semantics, chained through cap and T.
    a, h, d, e = (c.double()[:, None] for c in vars(coeffs).values())
    log_p = z - lse.double()[:, None]
    p = torch.exp(log_p)
    onehot = torch.nn.functional.one_hot(target.clamp(0), V).double() * valid[:, None]
    grad_z = p * (a - h * log_p) - onehot * d - e * class_weight[None, :]
    tanh = torch.tanh(hidden @ weight.t() / 3.0)
    torch.testing.assert_close(whole.cpu().double(), grad_z * (1 - tanh**2) / 0.8, rtol=1e-4, atol=1e-5)


def test_entropy_at_large_logits_is_as_accurate_as_eager(generator):
    """tests/test_precision.py's check on these kernels: at |z| ~ 400-500 the entropy and its gradients
    stay near eager fp32's error, because the scan sums exp(z - max) * (z - max) and the gradient kernel
    forms z - lse (semantics.py)."""
    x, w, t = large_logits_inputs(generator)
    x, w = (a.detach().to(DEVICE).requires_grad_() for a in (x, w))
    loss_fn = ascend_loss_fn(reduction="none", return_entropy=True, temperature=TEMPERATURE)
    assert_entropy_near_eager(entropy_errors(loss_fn, x, w, t.to(DEVICE), TEMPERATURE))


def test_zero_rows_launch_nothing():
    out = ascend_loss_fn(reduction="none")(torch.zeros(0, H, device=DEVICE), torch.randn(V, H, device=DEVICE),
                                           torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0,)


def test_engine_runs_the_ascend_kernels():
    # Guards against a silent fallback: the call's kernels are this backend's.
    hidden, weight, _, target, _ = make_inputs()
    cfg = LCEConfig()
    flat = prepare_inputs(hidden.float().to(DEVICE), weight.float().to(DEVICE), target.to(DEVICE), None, cfg)
    call = ascend.BACKEND.plan_call(flat, cfg, "plain", PlanRequest(training=True))
    assert isinstance(call.kernels, ops.AscendChunkKernels)
    assert call.kernels.props.vector_cores == int(os.environ["FLCE_ASCEND_VECTOR_CORES"])
    loss = apply_eager(flat, call)
    torch.testing.assert_close(loss.double().cpu(), oracle(hidden, weight, target)["loss"], rtol=1e-5, atol=1e-5)


def test_argmax_ties_pick_the_first_index():
    # Maxima repeated inside a block and across blocks (blocks of 128 here): torch.argmax's first.
    logits = torch.randn(4, V) - 10.0
    logits[0, [40, 90, 250]] = 5.0  # first block wins
    logits[1, [200, 290]] = 5.0  # both in later blocks
    logits[2, [127, 128]] = 5.0  # either side of a block edge
    logits[3, V - 1] = 5.0  # the partial last block
    target = torch.tensor([0, 1, 2, -100])
    kernels = ops.AscendChunkKernels(ops.device_properties(torch.device(DEVICE)))
    for offset in (0, 1000):
        stats = kernels.row_stats(logits.to(DEVICE), target.to(DEVICE), LCEConfig(return_predicted_tokens=True),
                                  offset)
        assert stats.argmax.cpu().tolist() == [40 + offset, 200 + offset, 127 + offset, V - 1 + offset]


def test_non_contiguous_inputs():
    # Column-major hidden and weight: the gradients keep that layout, so scale_ takes its torch path.
    hidden, weight, bias, target, _ = make_inputs(with_bias=True)
    leaves = [t.float().t().contiguous().t().to(DEVICE).requires_grad_() for t in (hidden, weight)]
    assert not leaves[0].is_contiguous() and not leaves[1].is_contiguous()
    b = bias.float().to(DEVICE).requires_grad_()
    loss = ascend_loss_fn(label_smoothing=0.1)(*leaves, target.to(DEVICE), b)
    grads = torch.autograd.grad(loss * 1.3, [*leaves, b])
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = oracle(*ref_leaves[:2], target, ref_leaves[2], label_smoothing=0.1)["loss"]
    ref_grads = torch.autograd.grad(ref * 1.3, ref_leaves)
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)
