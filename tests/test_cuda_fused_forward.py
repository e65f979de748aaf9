"""The CUDA backend's fused forward (statistics straight from a Triton GEMM, no logits) against the
float64 oracle: under the Triton interpreter on CPU tensors (fp32/fp16, small tiles so every row
block, vocabulary split and tail is exercised), and on a GPU in bf16 at real vocabulary sizes."""

from __future__ import annotations

import pytest
import torch
from helpers import OPTION_CASES, assert_same_argmax, lm_head_inputs, materialise_options, reference_loss
from hopper_ptx import TMA_LOAD, TMA_STORE, count

import flce
from flce.autotune import override_params

triton = pytest.importorskip("triton")

# Interpreter tiles: 7 vocabulary tiles at V = 203 in 3 splits (the last one short), 2 row blocks.
SMALL_TILES = {"forward_stats": "fused", "gemm_block_m": 16, "gemm_block_n": 32, "gemm_block_k": 16,
               "gemm_group_m": 2, "gemm_warps": 4, "gemm_stages": 1, "gemm_splits": 3}
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: runs where there is no GPU")


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts launches of the fused path, so a test fails if the call silently took another."""
    from flce.backends.cuda import gemm_ops

    calls = []
    real = gemm_ops.gemm_row_stats

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm_ops, "gemm_row_stats", counting)
    return calls


@pytest.fixture
def stats_gemm_calls(monkeypatch):
    """Counts the fused statistics GEMM's launches by kernel, "triton" (gemm_row_stats) or
    "warp_specialized" (ws_partial_row_stats), so a GPU test fails if the call silently took another."""
    from flce.backends.cuda import gemm_ops, ws_gemm_ops

    calls = []
    for module, name, kernel in ((gemm_ops, "gemm_row_stats", "triton"),
                                 (ws_gemm_ops, "ws_partial_row_stats", "warp_specialized")):
        real = getattr(module, name)

        def counting(*args, _real=real, _kernel=kernel, **kwargs):
            calls.append(_kernel)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return calls


def _skip_unless_kernel_runs(kernel: str, dtype: torch.dtype) -> None:
    if kernel == "warp_specialized" and (torch.cuda.get_device_capability() != (9, 0) or dtype == torch.float32):
        pytest.skip(f"the ws kernel takes 16-bit inputs on sm_90 GPUs ({torch.cuda.get_device_name()}, {dtype})")


def _check_outputs(out, want, tol: float, inputs: tuple, options: dict) -> None:
    got = out if isinstance(out, flce.LCEOutput) else flce.LCEOutput(loss=out)
    for name in ("loss", "z_loss", "token_accuracy", "logprobs", "entropy"):
        value = getattr(got, name)
        if value is not None:
            torch.testing.assert_close(value.double(), getattr(want, name).detach().double(), rtol=tol, atol=tol,
                                       msg=name)
    if got.predicted_tokens is not None:
        assert_same_argmax(got.predicted_tokens, want.predicted_tokens, *inputs, options, logits_dtype=inputs[0].dtype)


def _check_against_oracle(out, x, w, b, t, options: dict) -> None:
    """Outputs, then gradients for random upstream gradients of every differentiable output,
    against the float64 oracle (fp32 inputs)."""
    leaves = [a.detach().double().requires_grad_() for a in (x, w, b)]
    want = reference_loss(*leaves[:2], t, leaves[2], **options)
    _check_outputs(out, want, 1e-5, (x, w, b), options)
    got = out if isinstance(out, flce.LCEOutput) else flce.LCEOutput(loss=out)
    outs, refs, ups = [], [], []
    for name in ("loss", "logprobs", "entropy"):
        if getattr(got, name) is not None:
            outs.append(getattr(got, name))
            refs.append(getattr(want, name))
            ups.append(torch.randn(refs[-1].shape, dtype=torch.float64))
    torch.autograd.backward(outs, [u.float() for u in ups])
    torch.autograd.backward(refs, ups)
    for name, a, r in zip(("hidden", "weight", "bias"), (x, w, b), leaves, strict=True):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=5e-5, atol=5e-5, msg=f"grad {name}")


@interpreter_only
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(o) or "plain")
def test_interpreter_inference(options, fused_calls):
    n, h, v = 21, 24, 203
    options = materialise_options(options, v, "cpu")
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    with override_params(SMALL_TILES, backend="cuda"), torch.no_grad():
        out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", **options)
    assert fused_calls == [torch.Size([n, h])]
    _check_outputs(out, reference_loss(x.double(), w.double(), t, b.double(), **options), 1e-5, (x, w, b), options)


@interpreter_only
@pytest.mark.parametrize("options", [OPTION_CASES[0], OPTION_CASES[4], OPTION_CASES[-1]],
                         ids=["plain", "logprobs-entropy", "everything"])
@pytest.mark.parametrize("backward_grad", ["fused", "cublas"])
def test_interpreter_deferred_schedule(options, backward_grad, fused_calls):
    """reduction="none": forward statistics from the fused GEMM (all rows, one launch, sliced per
    chunk); backward recomputes each chunk's gradient with the gradient GEMM (fused) or a GEMM and
    the row kernel (cublas); gradients for any upstream gradient."""
    n, h, v = 21, 24, 203
    options = materialise_options(options, v, "cpu")
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    # 8-row chunks and no saved logits: backward's chunks must line up with the sliced statistics.
    knobs = dict(SMALL_TILES, tokens_per_chunk=8, grad_schedule="token_chunks", backward_grad=backward_grad)
    with override_params(knobs, logits_save_limit_bytes=0, backend="cuda"):
        out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", reduction="none", **options)
    assert fused_calls == [torch.Size([n, h])]
    _check_against_oracle(out, x, w, b, t, dict(options, reduction="none"))


@interpreter_only
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [OPTION_CASES[0], OPTION_CASES[-1]], ids=["plain", "everything"])
@pytest.mark.parametrize("kept", ["all", "one-chunk"])
def test_interpreter_fused_logits_schedules(options, reduction, kept, fused_calls):
    """The schedules that need each chunk's logits (gradients in forward for "mean"; saved logits
    for "none") take statistics and logits from one fused GEMM per chunk. With a save limit of two
    chunks, "none" keeps the first (beside one recomputed chunk) and recomputes the others."""
    n, h, v = 21, 24, 203
    options = materialise_options(options, v, "cpu")
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    knobs = dict(SMALL_TILES, forward_logits="fused", tokens_per_chunk=8, grad_schedule="token_chunks")
    from planning import cuda_plan

    from flce.config import LCEConfig
    from flce.inputs import prepare_inputs

    limit = 1 << 30 if kept == "all" else 2 * 8 * v * x.element_size()
    with override_params(knobs, logits_save_limit_bytes=limit, backend="cuda"):
        cfg = LCEConfig(reduction=reduction)
        saved_rows = cuda_plan(prepare_inputs(x, w, t, b, cfg), cfg, params=knobs, limit=limit).saved_rows
        assert saved_rows == (0 if reduction == "mean" else n if kept == "all" else 8)
        out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", reduction=reduction, **options)
    assert fused_calls == [torch.Size([8, h]), torch.Size([8, h]), torch.Size([5, h])]
    _check_against_oracle(out, x, w, b, t, dict(options, reduction=reduction))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter_extreme_logits_ties_and_ignored_rows(dtype, fused_calls):
    """Logits of +-1e4, a maximal column repeated in two splits (argmax keeps the first), and a
    batch whose every target is ignored (mean gives 0, as documented). fp16 statistics are those of
    the fp16-rounded logits, as PyTorch materialises them."""
    n, h, v = 18, 16, 203
    x = (torch.randn(n, h) * 40).to(dtype)
    w = torch.randn(v, h) * 20
    w[150] = w[20]  # tiles 0 and 4: different splits
    w = w.to(dtype)
    t = torch.randint(0, v, (n,))
    options = {"return_predicted_tokens": True, "return_logprobs": True, "return_entropy": True}
    with override_params(SMALL_TILES, backend="cuda"), torch.no_grad():
        out = flce.linear_cross_entropy(x, w, t, backend="cuda", **options)
        ignored = flce.linear_cross_entropy(x, w, torch.full_like(t, -100), backend="cuda")
    logits = (x.double() @ w.double().t()).to(dtype).double()
    assert float(logits.abs().max()) > 5e3
    # fp32 arithmetic on logits of this size resolves |z| * 2^-23; a few roundings (base-2 scaling,
    # the max subtraction, lse) stay within |z| * 2^-20, about 1e-2 here.
    atol = float(logits.abs().max()) * 2**-20
    logprobs = torch.log_softmax(logits, 1)
    torch.testing.assert_close(out.loss.double(), torch.nn.functional.cross_entropy(logits, t), rtol=1e-5, atol=atol)
    torch.testing.assert_close(out.logprobs.double(), logprobs.gather(1, t[:, None]).squeeze(1), rtol=1e-5, atol=atol)
    entropy = -(logprobs.exp() * logprobs).sum(1)
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=1e-4, atol=atol)
    assert torch.equal(out.predicted_tokens, logits.argmax(1))
    assert float(ignored) == 0.0
    assert len(fused_calls) == 2


@interpreter_only
def test_fallback_when_the_fused_kernel_fails(monkeypatch, caplog):
    """A kernel that does not compile here falls back to cuBLAS and the row kernels with one log line; the
    failure is recorded (cuda/fallback.py), so the next call's record plans the fallback and says why."""
    from flce.backends import cuda
    from flce.backends.cuda import fallback, gemm_ops
    from flce.config import LCEConfig
    from flce.engine.plans import PlanRequest, TokenChunks
    from flce.inputs import prepare_inputs

    def failing(*args, **kwargs):
        raise triton.OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(gemm_ops, "gemm_row_stats", failing)
    monkeypatch.setattr(fallback, "_failed", {})
    n, h, v = 10, 16, 203
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    want = reference_loss(x.double(), w.double(), t, b.double())
    with override_params(SMALL_TILES, backend="cuda"), torch.no_grad(), caplog.at_level("WARNING", logger="flce"):
        first = flce.linear_cross_entropy(x, w, t, b, backend="cuda")
        second = flce.linear_cross_entropy(x, w, t, b, backend="cuda")
        call = cuda.BACKEND.plan_call(prepare_inputs(x, w, t, b, LCEConfig()), LCEConfig(), "plain",
                                      PlanRequest(training=False))
    assert [r.message.count("_gemm_row_stats_kernel") for r in caplog.records] == [1]
    assert [key[2] for key in fallback.failed_kernels()] == ["triton"]
    assert [key[3].split()[0] for key in fallback.failed_kernels()] == [
        "flce.backends.cuda.gemm_kernels._gemm_row_stats_kernel"]
    assert isinstance(call.plan, TokenChunks) and call.plan.forward_logits == "cublas"  # no fused statistics
    assert "failed to compile here earlier (OutOfResources" in call.choice.steps[1].reason
    for loss in (first, second):
        torch.testing.assert_close(loss.double(), want.loss.detach(), rtol=1e-5, atol=1e-5)


def test_tuned_knobs_read_the_fused_forward_entries():
    from flce.autotune.lookup import TunedEntry
    from flce.backends.cuda.configs import GemmConfig
    from flce.backends.cuda.plan import tuned_knobs

    def knobs_of(params: dict):
        return tuned_knobs(TunedEntry(params, None, "test"))

    knobs = knobs_of(SMALL_TILES)
    assert knobs.forward_stats == "fused"
    assert knobs.gemm == GemmConfig(16, 32, 16, 2, 4, 1, splits=3)
    assert GemmConfig.from_params(knobs.gemm.as_params()) == knobs.gemm
    knobs = knobs_of(dict(SMALL_TILES, forward_stats="bogus", gemm_block_m=48))
    assert knobs.forward_stats is None and knobs.gemm is None  # unusable values fall back to the heuristic
    for value, expected in (("triton", "triton"), ("warp_specialized", "warp_specialized"), ("ws", None)):
        knobs = knobs_of(dict(SMALL_TILES, stats_kernel=value, logits_kernel=value))
        assert (knobs.stats_kernel, knobs.logits_kernel) == (expected, expected)


# ---------------------------------------------------------------------------------------------- GPU


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["triton", "warp_specialized"])
@pytest.mark.parametrize("vocab", [32001, 129920, 151936])
def test_gpu_fused_inference_bf16(vocab, kernel, stats_gemm_calls):
    """bf16 statistics from the fused GEMM (each statistics kernel) at real vocabulary sizes (none a
    multiple of any tile), with a bias, a softcap, a temperature and every extra, within 1.5x of the
    error of materialised eager PyTorch on the same bf16 inputs."""
    _skip_unless_kernel_runs(kernel, torch.bfloat16)
    n, h = 1000, 1024
    x, w, b, t = lm_head_inputs(n, h, vocab, torch.bfloat16, "cuda", with_bias=True)
    softcap, temperature = 30.0, 0.7
    options = {"softcap": softcap, "temperature": temperature, "return_logprobs": True, "return_entropy": True,
               "return_predicted_tokens": True, "reduction": "none"}
    with torch.no_grad():
        knobs = {"forward_stats": "fused", "stats_kernel": kernel}  # 1000 rows: not the default
        with override_params(knobs, backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, b, **options)
        logits = torch.addmm(b, x, w.t()).float()  # eager: bf16 logits, fp32 softmax
        z = softcap * torch.tanh(logits / softcap) / temperature
        eager_logprobs = torch.log_softmax(z, 1)
        eager = {"loss": torch.nn.functional.cross_entropy(z, t, reduction="none"),
                 "logprobs": torch.where(t >= 0, eager_logprobs.gather(1, t.clamp(0)[:, None]).squeeze(1), 0.0),
                 "entropy": torch.where(t >= 0, -(eager_logprobs.exp() * eager_logprobs).sum(1), 0.0)}
    assert stats_gemm_calls == [kernel]
    want = reference_loss(x.double(), w.double(), t, b.double(), **options)
    for name, eager_value in eager.items():
        assert _rel(getattr(out, name), getattr(want, name)) <= 1.5 * _rel(eager_value, getattr(want, name)) + 1e-6
    valid = t >= 0
    picked = z.gather(1, out.predicted_tokens.clamp(0)[:, None]).squeeze(1)
    top = z.max(1).values
    # The fused GEMM sums in another order than cuBLAS, so a logit may round to the neighbouring bf16 value
    # (an H200 run had 1 of ~800 rows pick differently): another pick is allowed only within one bf16 step
    # of eager's top logit, a near-tie, and only rarely.
    assert ((top - picked)[valid] <= top.abs()[valid] * 2**-7).all()
    assert (out.predicted_tokens[valid] == z.argmax(1)[valid]).float().mean() > 0.99


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [50257, 50304], ids=["odd-vocab", "tma-store-vocab"])
@pytest.mark.parametrize("kernel", ["triton", "warp_specialized"])
def test_gpu_fused_deferred_matches_cublas_path(dtype, v, kernel, stats_gemm_calls):
    """The RL schedule (with a bias) with the fused forward (each statistics kernel) and the gradient
    GEMM against the cuBLAS + row-kernel path and float64. At V = 50304 (16-byte rows) Hopper takes
    the persistent gradient kernel with TMA stores; at 50257 the 2-D grid with plain stores."""
    _skip_unless_kernel_runs(kernel, dtype)
    n, h = 3000, 512
    x, w, b, t = lm_head_inputs(n, h, v, dtype, "cuda", with_bias=True)
    options = {"temperature": 0.7, "return_logprobs": True, "return_entropy": True, "reduction": "none"}
    results = {}
    for path in ("fused", "cublas"):
        knobs = {"forward_stats": path, "backward_grad": path, "forward_logits": path, "stats_kernel": kernel,
                 "logits_kernel": kernel}
        with override_params(knobs, logits_save_limit_bytes=0, backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, b, **options)
        objective = (out.logprobs * torch.linspace(-1, 1, n, device="cuda")).sum() - 0.01 * out.entropy.sum()
        results[path] = (out.logprobs.detach(), out.entropy.detach(), *torch.autograd.grad(objective, (x, w, b)))
    assert stats_gemm_calls == [kernel]
    leaves = [a.detach().double().requires_grad_() for a in (x, w, b)]
    ref = reference_loss(*leaves[:2], t, leaves[2], **options)
    objective = (ref.logprobs * torch.linspace(-1, 1, n, device="cuda", dtype=torch.float64)).sum()
    ref_grads = torch.autograd.grad(objective - 0.01 * ref.entropy.sum(), leaves)
    for k, want in enumerate((ref.logprobs, ref.entropy, *ref_grads)):
        fused, cublas = results["fused"][k], results["cublas"][k]
        assert _rel(fused, want) <= 1.5 * _rel(cublas, want) + (1e-6 if dtype == torch.float32 else 1e-4), (
            ("logprobs", "entropy", "grad x", "grad w", "grad b")[k], _rel(fused, want), _rel(cublas, want))


@interpreter_only
@pytest.mark.parametrize("fused", [True, False], ids=["fused-gemms", "cublas-and-row-kernels"])
@pytest.mark.parametrize(("options", "reduction"), [({}, "mean"), (OPTION_CASES[-1], "sum"),
                                                    (OPTION_CASES[4], "none"), (OPTION_CASES[6], "mean")],
                         ids=["plain-mean", "everything-sum", "rl-none", "weights-smoothing"])
def test_interpreter_vocab_block_gradients(options, reduction, fused, monkeypatch):
    """The lean schedule: statistics of all rows, then gradients by vocabulary blocks (one weight-
    gradient write per block), for the in-forward and the deferred schedules, any upstream gradient."""
    monkeypatch.setattr("flce.backends.cuda.plan.MIN_VOCAB_BLOCK", 16)
    n, h, v = 21, 24, 203
    options = materialise_options(options, v, "cpu")
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    path = "fused" if fused else "cublas"
    knobs = dict(SMALL_TILES, forward_stats=path, backward_grad=path, grad_schedule="vocab_blocks",
                 grad_vocab_block=64)  # 4 blocks, the last one ragged
    from flce.backends import cuda
    from flce.config import LCEConfig
    from flce.engine.plans import AllRows, PlanRequest, VocabBlocks
    from flce.inputs import prepare_inputs

    with override_params(knobs, logits_save_limit_bytes=0, backend="cuda"):
        cfg = LCEConfig(reduction=reduction)
        plan = cuda.BACKEND.plan_call(prepare_inputs(x, w, t, b, cfg), cfg, "full", PlanRequest(training=True)).plan
        stats = AllRows(forward_stats=path, scan_block=None if fused else 64)
        assert plan == VocabBlocks(grad_vocab_block=64, stats=stats, backward_grad=path)
        out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", reduction=reduction, **options)
        _check_against_oracle(out, x, w, b, t, dict(options, reduction=reduction))


def test_small_budgets_plan_the_vocab_block_schedule():
    from planning import cuda_plan

    from flce.config import LCEConfig
    from flce.engine.plans import AllRows, TokenChunks, VocabBlocks
    from flce.inputs import prepare_inputs

    x, w, _, t = lm_head_inputs(4096, 8, 32000, torch.float16, "cpu", with_bias=False)
    flat = prepare_inputs(x, w, t, None, LCEConfig())
    lean = cuda_plan(flat, LCEConfig(memory_budget=16 << 20))
    assert isinstance(lean, VocabBlocks)
    assert lean.grad_vocab_block == 1920  # (16 MiB - 64 bytes per row) / (4096 rows x 2 bytes), in 128s
    roomy = cuda_plan(flat, LCEConfig(memory_budget=512 << 20))
    assert isinstance(roomy, TokenChunks)  # token chunks hold 1024+ rows: the weight gradient is cheap
    assert isinstance(cuda_plan(flat, LCEConfig(memory_budget=16 << 20), training=False), AllRows)
    sharded = cuda_plan(flat, LCEConfig(memory_budget=16 << 20), sharded=True)
    assert isinstance(sharded, TokenChunks), "a vocabulary shard cannot be scanned by blocks of all rows"


def test_tuning_under_a_budget_times_both_exact_schedules_at_its_size():
    """flce-autotune --memory-budget 64MiB at the RL benchmark shape: the largest token chunk and the widest
    vocabulary block that fit (gradient from the fused GEMM and from cuBLAS) are candidates, their
    estimates fit, and the planner runs each as stated when the cache holds it."""
    from planning import cuda_plan, meta_inputs

    from flce.autotune import spaces
    from flce.engine.plans import TokenChunks, VocabBlocks

    space = spaces.tuning_space("cuda")
    shape = spaces.TuneShape(torch.device("cpu"), torch.bfloat16, hidden=2048, vocab=151936, tokens=16384,
                             variant="plain")
    budget = 64 << 20
    candidates = space.budget_candidates(shape, budget)
    assert candidates == [
        {"tokens_per_chunk": 220, "grad_schedule": "token_chunks"},  # 220 rows x 151936 x 2 bytes <= 64 MiB
        {"grad_schedule": "vocab_blocks", "grad_vocab_block": 1920, "backward_grad": "fused"},
        {"grad_schedule": "vocab_blocks", "grad_vocab_block": 1920, "backward_grad": "cublas"},
    ]
    assert all(0 < space.working_bytes(shape, c) <= budget for c in candidates)
    assert not any(space.working_bytes(shape, c) <= budget for c in space.candidates(shape, True)), \
        "the regular ladder has nothing within 64 MiB here: without these the tuner would store no entry"
    flat = meta_inputs(16384, 2048, 151936)
    for knobs in candidates:
        # A call without a budget runs what was tuned.
        plan = cuda_plan(flat, params=knobs)
        if knobs["grad_schedule"] == "vocab_blocks":
            assert isinstance(plan, VocabBlocks)
            assert (plan.grad_vocab_block, plan.backward_grad) == (knobs["grad_vocab_block"], knobs["backward_grad"])
        else:
            assert isinstance(plan, TokenChunks) and plan.tokens_per_chunk == 220
    # 1 MiB: three-row chunks still fit, a block of 16384 rows x 512 columns does not
    assert space.budget_candidates(shape, 1 << 20) == [{"tokens_per_chunk": 3, "grad_schedule": "token_chunks"}]


def test_tuned_vocab_blocks_yield_to_kept_logits():
    """A tuned lean schedule was measured with nothing kept: an RL call whose budget keeps logits
    keeps them (and recomputes by token chunks); one whose budget keeps none takes the tuned blocks."""
    from planning import cuda_plan, meta_inputs

    from flce.config import LCEConfig
    from flce.engine.plans import TokenChunks, VocabBlocks

    flat = meta_inputs(16384, 4096, 151936)
    tuned = {"grad_schedule": "vocab_blocks", "grad_vocab_block": 1920}
    rl = {"reduction": "none", "return_logprobs": True}
    kept = cuda_plan(flat, LCEConfig(memory_budget=6 << 30, **rl), params=tuned)
    assert isinstance(kept, TokenChunks) and kept.saved_rows == 16384
    lean = cuda_plan(flat, LCEConfig(memory_budget=512 << 20, **rl), params=tuned)
    assert isinstance(lean, VocabBlocks) and lean.grad_vocab_block == 1920


@interpreter_only
def test_interpreter_tuner_stores_the_faster_schedule_within_the_budget(monkeypatch):
    """flce-autotune with the CUDA backend under the interpreter and a budget below one chunk of all
    rows: the regular candidates are skipped as over budget, the budget-sized ones run, agree with
    the heuristic, and the entry holds the one that measured fastest."""
    from flce.autotune.tuner import Tuner, TuneRequest

    monkeypatch.setattr("flce.backends.cuda.plan.MIN_VOCAB_BLOCK", 128)
    budget = 160 << 10  # 40 of the 64 rows' fp32 logits; vocabulary blocks of 512 columns
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[16], vocabs=[1024],
                          tokens=[64], variants=["plain"], backend="cuda", memory_budget=budget, quick=True,
                          repeats=1)
    (result,) = Tuner(request).run()
    assert result.entry is not None, result.first_error
    assert result.skipped["over budget"] >= 1 and "wrong result" not in result.skipped
    sized = [{"tokens_per_chunk": 40, "grad_schedule": "token_chunks"}] + [
        {"grad_schedule": "vocab_blocks", "grad_vocab_block": 512, "backward_grad": p} for p in ("fused", "cublas")]
    stored = {k: v for k, v in result.entry.params.items() if k != "forward_stats"}
    assert stored in sized
    assert result.entry.measured["peak_mib"] * (1 << 20) <= budget


@pytest.mark.cuda
def test_gpu_fused_paths_make_no_host_sync():
    """The fused forward, the gradient GEMM and the vocabulary-block schedule launch without waiting
    for the device (CUDA-graph capturable, no stalls between steps)."""
    x, w, b, t = lm_head_inputs(2048, 512, 32000, torch.bfloat16, "cuda", with_bias=True)
    rl = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}

    def steps() -> None:
        with override_params({"forward_stats": "fused", "backward_grad": "fused"}, logits_save_limit_bytes=0,
                             backend="cuda"):
            out = flce.linear_cross_entropy(x, w, t, b, **rl)
            torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (x, w, b))
            loss = flce.linear_cross_entropy(x, w, t, b, memory_budget=8 << 20)  # vocabulary blocks
            torch.autograd.grad(loss, (x, w, b))

    steps()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps()
    finally:
        torch.cuda.set_sync_debug_mode("default")


_COMPILE_FOR_HOPPER = """
import inspect, json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flce.backends.cuda import gemm_kernels

kernel_name, has_h = sys.argv[1], sys.argv[2] == "rl"
kernel = getattr(gemm_kernels, kernel_name)
names = list(inspect.signature(kernel.fn).parameters)
constants = {"HAS_BIAS": True, "HAS_SOFTCAP": True, "HAS_CLASS_WEIGHT": False, "HAS_H": has_h, "HAS_E": has_h,
             "NEED_SUM_EXP_DZ": has_h, "NEED_WEIGHTED_SUM_Z": False, "NEED_ARGMAX": has_h, "STORE_LOGITS": True,
             "STORE_EXP": False,
             "LOGITS_DTYPE": tl.bfloat16, "USE_TMA": True, "IEEE": False, "BLOCK_M": 128, "BLOCK_N": 256,
             "BLOCK_K": 64, "GROUP_M": 8, "SPLITS": 1, "NUM_STAGES": 3, "SUBTILES": 2}
types = {"x": "tensordesc<bf16[128,64]>", "w": "tensordesc<bf16[256,64]>", "x_desc": "tensordesc<bf16[128,64]>",
         "w_desc": "tensordesc<bf16[256,64]>", "grad_desc": "tensordesc<bf16[128,128]>", "target_ptr": "*i64",
         "part_argmax_ptr": "*i64", "logits_ptr": "*bf16", "grad_ptr": "*bf16", "bias_ptr": "*bf16",
         "softcap": "fp32", "inv_temperature": "fp32"}
signature = {name: "constexpr" if name in constants else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
             for name in names}
constants = {k: v for k, v in constants.items() if k in names}
source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
sys.stdout.write(compiled.asm["ptx"])
"""


@pytest.mark.parametrize("coefficients", ["plain", "rl"])
@pytest.mark.parametrize("kernel", ["_gemm_grad_persistent_kernel", "_gemm_grad_kernel", "_gemm_row_stats_kernel"])
def test_tma_gemm_kernels_compile_for_hopper(kernel, coefficients):
    """The fused Triton GEMMs' TMA variants run only on Hopper (tensor descriptors), never under the
    interpreter: compiling them for sm_90 here (in a process without TRITON_INTERPRET) lowers them
    through Triton's NVIDIA backend to PTX, so a change (or a Triton release) that breaks them fails
    CI without a GPU. The PTX must hold wgmma and TMA loads; the persistent gradient kernel's
    gradient leaves by TMA stores, the others' by plain stores. ``rl``: the log-prob and entropy
    coefficients (gradient) or statistics (forward) on."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER, kernel, coefficients], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    assert "wgmma.mma_async" in ptx
    assert count(TMA_LOAD, ptx) > 0
    persistent = kernel == "_gemm_grad_persistent_kernel"
    assert (count(TMA_STORE, ptx) > 0) == persistent
    assert ("st.global" in ptx) != persistent


@interpreter_only
def test_interpreter_split_merge_across_split_blocks():
    """The merge of per-split partials (gemm_ops.merge_splits) at more splits than one step of the
    kernel loads (70 > 32) and rows past a row block (40 > 32): the max, sum-exp, weighted sum,
    sum-exp-z and argmax of all splits folded in vocabulary order, against the same fold in float64;
    a row's maximum in two splits of different step blocks keeps the earlier split's index."""
    from flce.backends.cuda.gemm_ops import merge_splits
    from flce.config import LCEConfig
    from flce.semantics import PartialRowStats

    splits, n = 70, 40
    part_max = torch.randn(splits, n) * 30
    part_sum = torch.rand(splits, n) + 0.5
    part_sum_dz = torch.randn(splits, n)
    part_weighted = torch.randn(splits, n)
    part_argmax = torch.randint(0, 10**6, (splits, n))
    top = part_max.max(0).values + 1.0
    part_max[5, 3], part_max[50, 3] = top[3], top[3]  # a tie across step blocks: split 5 wins
    cfg = LCEConfig(return_entropy=True, label_smoothing=0.1, return_token_accuracy=True)
    stats = PartialRowStats.allocate(n, cfg, torch.device("cpu"))
    merge_splits(stats, part_max, part_sum, part_sum_dz, part_weighted, part_argmax)
    ln2 = 0.6931471805599453
    row_max = part_max.double().max(0).values
    scale = torch.exp2(part_max.double() - row_max)
    torch.testing.assert_close(stats.row_max.double(), row_max * ln2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.sum_exp.double(), (part_sum.double() * scale).sum(0), rtol=1e-5, atol=0)
    # Each split's sum of exp * (z - its max * ln 2) moved to the row's max (in fp32 as the kernel does).
    moved = part_max * ln2 - (part_max.max(0).values * ln2)
    want_dz = ((part_sum_dz.double() + moved.double() * part_sum.double()) * scale).sum(0)
    torch.testing.assert_close(stats.sum_exp_dz.double(), want_dz, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stats.weighted_sum_z.double(), part_weighted.double().sum(0) * ln2,
                               rtol=1e-5, atol=1e-5)
    first = (part_max == part_max.max(0).values).float().argmax(0)  # first split holding the max
    assert torch.equal(stats.argmax, part_argmax.gather(0, first[None])[0])
    assert int(stats.argmax[3]) == int(part_argmax[5, 3])


def test_hopper_training_defaults_and_tuning_candidates(monkeypatch):
    """On Hopper (a described H100: the choice is a function of the description; the GPU tests run the real
    thing): a training call's chunk logits default to the warp-specialised statistics GEMM, whose epilogue
    computes every statistic and option (the plain and the RL statistics: temperature, entropy; label
    smoothing, class weights, a softcap, a bias), and to cuBLAS under precision="accurate" or off Hopper; the
    gradient products stay on cuBLAS; flce-autotune times the ws forward and both gradient kernels."""
    from planning import cuda_choice, cuda_plan, described_gpu, meta_inputs

    from flce.autotune import spaces
    from flce.autotune.lookup import TunedEntry
    from flce.backends.cuda import hardware, plan
    from flce.config import LCEConfig
    from flce.engine.plans import TokenChunks

    flat, h100 = meta_inputs(16384, 2048, 151936), described_gpu()
    chosen, kernels = cuda_choice(flat, device=h100)
    assert isinstance(chosen.plan, TokenChunks) and chosen.plan.forward_logits == "fused"
    assert (kernels.family("chunk_logits").name, kernels.family("products").name) == ("warp_specialized", "cublas")
    rl = LCEConfig(reduction="none", return_logprobs=True, return_entropy=True, temperature=0.7)
    assert cuda_plan(flat, rl, device=h100).forward_logits == "fused"
    assert cuda_plan(flat, LCEConfig(label_smoothing=0.1), device=h100).forward_logits == "fused"
    weights = torch.ones(151936)
    for cfg in (LCEConfig(softcap=30.0), LCEConfig(class_weight=weights, label_smoothing=0.1)):
        assert cuda_plan(flat, cfg, device=h100).forward_logits == "fused", cfg
    assert cuda_plan(flat, LCEConfig(precision="accurate"), device=h100).forward_logits == "cublas"
    biased = meta_inputs(16384, 2048, 151936, bias=True)
    assert cuda_plan(biased, LCEConfig(softcap=30.0), device=h100).forward_logits == "fused"

    monkeypatch.setattr(hardware, "describe_device", lambda device: h100)
    space = spaces.tuning_space("cuda")
    shape = spaces.TuneShape(torch.device("cpu"), torch.bfloat16, hidden=2048, vocab=151936, tokens=16384,
                             variant="plain")
    candidates = space.candidates(shape, True)
    assert {c["grad_gemm_kernel"] for c in candidates} == {"warp_specialized", "cublas"}
    ws_forward = [c for c in candidates if c.get("logits_kernel") == "warp_specialized"]
    assert ws_forward and all(c["forward_logits"] == "fused" for c in ws_forward)
    # stats_kernel is the forward-only overlays' knob: a training candidate never sets it, so the
    # overlay the tuner adds to the winner cannot change the kernel its training time was measured on
    assert not any("stats_kernel" in c for c in candidates)
    assert all("logits_kernel" not in overlay for overlay in space.inference_overlays)
    heuristic = space.heuristic(shape)
    assert heuristic["forward_logits"] == "fused"
    assert not any(k.startswith("gemm_") for k in heuristic), "the Triton GEMM's tiles do nothing where ws runs"
    for knobs in candidates:  # what the cache would hold parses back to the same choices
        tuned = plan.tuned_knobs(TunedEntry(knobs, None, "test"))
        assert (tuned.forward_logits, tuned.grad_gemm_kernel) == (knobs["forward_logits"], knobs["grad_gemm_kernel"])

    a100 = described_gpu("NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(hardware, "describe_device", lambda device: a100)
    assert cuda_plan(flat, LCEConfig(), device=a100).forward_logits == "cublas"
    assert "grad_gemm_kernel" not in space.candidates(shape, True)[0]
    # a training call there runs cuBLAS and the row kernels: no Triton tiles in what the heuristic ran
    assert space.heuristic(shape)["forward_logits"] == "cublas" and "gemm_block_m" not in space.heuristic(shape)


@pytest.mark.parametrize("stats_kernel, logits_kernel",
                         [("triton", "warp_specialized"), ("warp_specialized", "triton")])
def test_statistics_and_chunk_logits_take_their_own_kernel(monkeypatch, stats_kernel, logits_kernel):
    """stats_kernel picks the fused statistics GEMM where only statistics are taken, logits_kernel where
    the GEMM also writes a training chunk's logits (the tuner measures the two in different calls)."""
    from planning import interpreter_kernels

    from flce.backends.cuda import gemm_ops, ws_gemm_ops
    from flce.config import LCEConfig

    used = []
    monkeypatch.setattr(ws_gemm_ops, "ws_partial_row_stats", lambda *args, **kwargs: used.append("warp_specialized"))
    monkeypatch.setattr(gemm_ops, "gemm_row_stats", lambda *args, **kwargs: used.append("triton"))
    kernels = interpreter_kernels(statistics=stats_kernel, chunk_logits=logits_kernel)
    x, w, _, t = lm_head_inputs(8, 16, 64, torch.bfloat16, "cpu", with_bias=False)
    cfg = LCEConfig()
    kernels.gemm_row_stats(x, w, None, t, cfg, 0)
    kernels.gemm_row_stats(x, w, None, t, cfg, 0, logits_out=torch.empty(8, 64, dtype=torch.bfloat16))
    assert used == [stats_kernel, logits_kernel]
