"""The CUDA backend's Triton kernels against the float64 materialised computation.

Without a GPU the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 for the session; small shapes,
fp32/fp16: the interpreter's bf16 dot is wrong, and these kernels take bf16 only from cuBLAS);
with a GPU (marker ``cuda``) at realistic sizes and in bf16 too.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OPTION_CASES, assert_same_argmax, lm_head_inputs, materialise_options, reference_loss

import flce
import flce.testing.distillation

pytest.importorskip("triton")



def _run_and_compare(n, h, v, dtype, device, options, reduction, with_bias, tol):
    options = materialise_options(options, v, device)
    x, w, b, t = lm_head_inputs(n, h, v, dtype, device, with_bias)
    out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", reduction=reduction, **options)
    xd, wd, bd = (a.detach().double().requires_grad_() if a is not None else None for a in (x, w, b))
    ref = reference_loss(xd, wd, t, bd, reduction=reduction, **options)
    got = out if isinstance(out, flce.LCEOutput) else flce.LCEOutput(loss=out)
    want = ref

    outputs, ref_outputs, grads = [], [], []
    for name in ("loss", "logprobs", "entropy"):
        g, r = getattr(got, name), getattr(want, name)
        if g is None:
            continue
        up = torch.randn(r.shape, dtype=torch.float64, device=device)
        outputs.append(g)
        ref_outputs.append(r)
        grads.append(up)
        torch.testing.assert_close(g.double(), r.detach(), rtol=tol, atol=tol, msg=f"{name} forward")
    for name in ("z_loss", "token_accuracy"):
        if getattr(got, name) is not None:
            torch.testing.assert_close(getattr(got, name).double(), getattr(want, name).double(), rtol=tol, atol=tol)
    if got.predicted_tokens is not None:
        assert_same_argmax(got.predicted_tokens, want.predicted_tokens, x, w, b, options, logits_dtype=x.dtype)
    torch.autograd.backward(outputs, [u.to(o.dtype) for o, u in zip(outputs, grads, strict=True)])
    torch.autograd.backward(ref_outputs, grads)
    gtol = 5 * tol
    for name, a, r in (("hidden", x, xd), ("weight", w, wd), ("bias", b, bd)):
        if a is not None:
            torch.testing.assert_close(a.grad.double(), r.grad, rtol=gtol, atol=gtol, msg=f"grad {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(o) or "plain")
def test_interpreter_contract_fp32(options, reduction, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    # Small blocks so every row spans several blocks and a ragged tail, as at a real vocabulary.
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 64)
    n, h, v = 12, 16, 203
    _run_and_compare(n, h, v, torch.float32, "cpu", options, reduction, with_bias=True, tol=1e-5)


def test_interpreter_plain_fp16_and_chunks(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 64)
    n, h, v = 20, 16, 150
    x, w, b, t = lm_head_inputs(n, h, v, torch.float16, "cpu", with_bias=False)
    # Four-row chunks: the chunk loop and the in-forward gradient schedule cross chunk borders.
    loss = flce.linear_cross_entropy(x, w, t, backend="cuda", variant="plain", memory_budget=4 * v * 2)
    loss.backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_loss(xd, wd, t, None).loss
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-2, atol=1e-2)
    assert (x.grad.double() - xd.grad).norm() / xd.grad.norm() < 5e-3
    assert (w.grad.double() - wd.grad).norm() / wd.grad.norm() < 5e-3


def test_interpreter_gradient_pass_splits_rows_into_column_spans(monkeypatch):
    """plain_grad_ runs each row as several programs of GRAD_BLOCKS_PER_PROGRAM column blocks (the last
    one ragged); every span writes (softmax - onehot) * scale with the row's lse, ignored rows zero."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    from planning import interpreter_kernels

    from flce.backends.cuda import row_ops
    from flce.backends.cuda.configs import LaunchParams

    monkeypatch.setattr(row_ops, "GRAD_BLOCKS_PER_PROGRAM", 2)
    n, v = 6, 150  # 16-column blocks, 32-column spans: 5 programs a row, the last 22 columns wide
    logits = torch.randn(n, v, dtype=torch.float32) * 3
    target = torch.randint(0, v, (n,))
    target[2] = -100
    scale = torch.rand(n) + 0.5
    lse = torch.logsumexp(logits.double(), 1)
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), v)
    expected = (torch.softmax(logits.double(), 1) - onehot) * scale[:, None]
    expected[2] = 0
    out = interpreter_kernels(launch=LaunchParams(block_v=16, num_warps=1)).plain_grad_(
        logits.clone(), target, -100, lse.float(), scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(o) or "plain")
def test_gpu_contract_fp32(options, reduction):
    # V = 32001: not a multiple of any block size.
    _run_and_compare(257, 128, 32001, torch.float32, "cuda", options, reduction, with_bias=True, tol=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [32000, 129920, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_low_precision_within_eager_error(vocab, dtype):
    """bf16/fp16 gradients within 1.5x of what materialised eager PyTorch achieves on the same inputs."""
    n, h = 2048, 1024
    x, w, _, t = lm_head_inputs(n, h, vocab, dtype, "cuda", with_bias=False)
    loss = flce.linear_cross_entropy(x, w, t)
    gx, gw = torch.autograd.grad(loss, (x, w))
    eager = torch.nn.functional.cross_entropy((x @ w.t()).float(), t)
    ex, ew = torch.autograd.grad(eager, (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xd @ wd.t(), t)
    rx, rw = torch.autograd.grad(ref, (xd, wd))
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-2, atol=2e-2)
    assert _rel(gx, rx) <= 1.5 * _rel(ex, rx) + 1e-6
    assert _rel(gw, rw) <= 1.5 * _rel(ew, rw) + 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_expanded_hidden_rows(dtype):
    """A hidden of one row expanded to many (stride 0, as a broadcast prefix makes it) counts as 16-byte aligned
    (engine.choice.rows_aligned), so it reaches the TMA GEMMs: the loss and gradients still equal float64's, for
    cross-entropy and for a distillation whose teacher's hidden is expanded too."""
    n, h, v = 1024, 512, 32000
    g = torch.Generator(device="cpu").manual_seed(int(torch.randint(0, 2**31, ())))
    row = (torch.randn(1, h, generator=g)).to("cuda", dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h**-0.5).to("cuda", dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to("cuda")
    teacher_row = torch.randn(1, 2 * h, generator=g).to("cuda", dtype)
    teacher_w = (torch.randn(v, 2 * h, generator=g) * (2 * h) ** -0.5).to("cuda", dtype)
    hidden = row.expand(n, h)
    assert hidden.stride(0) == 0
    calls = {
        "cross-entropy": (lambda x, w: flce.linear_cross_entropy(x, w, t),
                          lambda x, w: torch.nn.functional.cross_entropy(x @ w.t(), t)),
        "jsd": (lambda x, w: flce.linear_distillation_loss(x, w, teacher_row.expand(n, 2 * h), teacher_w, t),
                lambda x, w: flce.testing.distillation.reference_distillation_loss(
                    x, w, teacher_row.double().expand(n, 2 * h), teacher_w.double(), t)),
    }
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    for name, (call, oracle) in calls.items():
        loss = call(hidden, w)
        grads = torch.autograd.grad(loss, (row, w))
        rd, wd = row.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        want = oracle(rd.expand(n, h), wd)
        want_grads = torch.autograd.grad(want, (rd, wd))
        assert _rel(loss, want.detach()) <= limit, name
        for got_grad, want_grad in zip(grads, want_grads, strict=True):
            assert _rel(got_grad, want_grad) <= limit, name


@pytest.mark.cuda
def test_gpu_accum_fp32_and_budget_agree():
    n, h, v = 4096, 512, 50257
    x, w, _, t = lm_head_inputs(n, h, v, torch.bfloat16, "cuda", with_bias=False)
    grads = {}
    for label, options in {"default": {}, "fp32acc": {"accum_dtype": torch.float32},
                           "64MiB": {"memory_budget": 64 << 20}}.items():
        loss = flce.linear_cross_entropy(x, w, t, **options)
        grads[label] = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(torch.nn.functional.cross_entropy(xd @ wd.t(), t), (xd, wd))
    for label, (_loss, gx, gw) in grads.items():
        assert _rel(gx, rx) < 2e-2, label
        assert _rel(gw, rw) < 2e-2, label
    # The fp32 accumulator is at least as exact as bf16 accumulation over 1+ chunks.
    assert _rel(grads["fp32acc"][2], rw) <= _rel(grads["default"][2], rw) * 1.05


@pytest.mark.cuda
def test_gpu_no_host_sync_and_autocast():
    n, h, v = 1024, 256, 32000
    x = torch.randn(n, h, device="cuda", requires_grad=True)
    w = torch.randn(v, h, device="cuda", requires_grad=True)
    t = torch.randint(0, v, (n,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = flce.linear_cross_entropy(x, w, t)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = flce.linear_cross_entropy(x, w, t)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("options", [OPTION_CASES[0], OPTION_CASES[-1], OPTION_CASES[-2]],
                         ids=["plain", "everything", "metrics"])
def test_interpreter_inference_scans_vocab_blocks(options, monkeypatch):
    """Without gradients the plan scans vocabulary blocks of all rows; the in-kernel merge of
    block statistics must equal the one-pass result, ties and tails included."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 32)
    monkeypatch.setattr("flce.backends.cuda.plan.MIN_VOCAB_BLOCK", 16)
    monkeypatch.setattr("flce.backends.cuda.plan.INFERENCE_CHUNK_BUDGET", 9 * 48 * 4)
    n, h, v = 9, 16, 203
    options = materialise_options(dict(options, return_predicted_tokens=True), v, "cpu")
    x, w, b, t = lm_head_inputs(n, h, v, torch.float32, "cpu", with_bias=True)
    # A repeated maximal column in two different blocks: argmax must keep the first.
    w.data[150] = w.data[20]
    if b is not None:
        b.data[150] = b.data[20]
    from planning import cuda_plan

    from flce.config import LCEConfig
    from flce.engine.plans import AllRows
    from flce.inputs import prepare_inputs

    with torch.no_grad():
        plan = cuda_plan(prepare_inputs(x, w, t, b, LCEConfig()), LCEConfig(), training=False)
        assert plan == AllRows(forward_stats="cublas", scan_block=48)
        out = flce.linear_cross_entropy(x, w, t, b, backend="cuda", **options)
    want = reference_loss(x.double(), w.double(), t, b.double(), **options)
    for name in ("loss", "z_loss", "token_accuracy", "logprobs", "entropy"):
        got = getattr(out, name)
        if got is not None:
            torch.testing.assert_close(got.double(), getattr(want, name).double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.predicted_tokens, want.predicted_tokens)


def test_plan_follows_the_training_flag_not_grad_mode():
    """Inside an autograd or custom op grad mode is off: the caller's flag decides the plan."""
    from flce.backends.cuda import BACKEND
    from flce.config import LCEConfig
    from flce.engine.plans import AllRows, PlanRequest, TokenChunks
    from flce.inputs import prepare_inputs

    x, w, _, t = lm_head_inputs(4096, 8, 32000, torch.float16, "cpu", with_bias=False)
    flat = prepare_inputs(x, w, t, None, LCEConfig())
    with torch.no_grad():
        training = BACKEND.plan_call(flat, LCEConfig(), "plain", PlanRequest(training=True)).plan
        inference = BACKEND.plan_call(flat, LCEConfig(), "plain", PlanRequest(training=False)).plan
    assert isinstance(training, TokenChunks) and training.tokens_per_chunk == 4096
    assert isinstance(inference, AllRows)


@pytest.mark.parametrize(("budget_mib", "limit_gib", "want"), [
    (None, 4, (1536, 8 * 1536)),  # the default: eight 1536-row chunks kept beside a ninth
    (None, 1, (1536, 1536)),
    (512, None, "blocks"),  # the budget holds one chunk and keeps nothing: vocabulary blocks
    (1024, None, "blocks"),  # keeping one 1536-row chunk would not pay for six more weight updates
    (2048, None, (1536, 3 * 1536)),  # smaller chunks, so that the budget keeps three of them
    (6144, None, (16384, 16384)),  # all logits (4.6 GiB) fit the budget
    (6144, 4, (1536, 8 * 1536)),  # a tuned limit still applies
])
def test_deferred_plan_keeps_the_logits_that_fit(budget_mib, limit_gib, want):
    """The RL benchmark shape (16384 x 4096 x 151936 bf16, 4.6 GiB of logits, reduction="none"):
    tokens per chunk and the leading rows whose logits forward keeps for backward; where nothing
    is kept, vocabulary blocks of all rows within the budget."""
    from planning import cuda_plan, meta_inputs

    from flce.backends.cuda.plan import STATS_BYTES_PER_ROW
    from flce.config import LCEConfig
    from flce.engine.plans import TokenChunks, VocabBlocks

    n, h, v = 16384, 4096, 151936
    flat = meta_inputs(n, h, v)
    cfg = LCEConfig(reduction="none", return_logprobs=True,
                    memory_budget=None if budget_mib is None else budget_mib << 20)
    plan = cuda_plan(flat, cfg, limit=None if limit_gib is None else limit_gib << 30)
    if want == "blocks":
        assert isinstance(plan, VocabBlocks)
        assert plan.grad_vocab_block * n * 2 + n * STATS_BYTES_PER_ROW <= budget_mib << 20
        return
    assert isinstance(plan, TokenChunks)
    assert (plan.tokens_per_chunk, plan.saved_rows) == want
    if budget_mib is not None:
        kept_bytes = plan.saved_rows * v * 2
        working = 0 if plan.saved_rows == n else plan.tokens_per_chunk * v * 2
        assert kept_bytes + working <= budget_mib << 20


@pytest.mark.parametrize(("budget_mib", "want"), [
    (None, 2048),  # the shipped entry's chunk within the default budget
    (256, 1024),  # the tuned chunk does not fit a smaller budget: the budget's own chunks (whole 256-row tiles)
    (1024, 4096),  # a larger one buys larger chunks than the entry's
    (2048, 8192),  # all rows in one chunk: one write of the weight gradient
])
def test_a_larger_budget_buys_larger_training_chunks(budget_mib, want):
    """A scalar loss on an H100 (8192 x 4096 x 128256 bf16, whose shipped autotune entry holds 2048-row
    chunks): an explicit memory_budget above the default plans the largest chunks it holds, each within it."""
    from planning import cuda_plan, described_gpu, meta_inputs

    from flce.config import LCEConfig
    from flce.engine.plans import TokenChunks

    n, h, v = 8192, 4096, 128256
    cfg = LCEConfig(memory_budget=None if budget_mib is None else budget_mib << 20)
    plan = cuda_plan(meta_inputs(n, h, v), cfg, params={"tokens_per_chunk": 2048}, device=described_gpu())
    assert isinstance(plan, TokenChunks) and plan.tokens_per_chunk == want
    if budget_mib is not None:
        assert plan.tokens_per_chunk * v * 2 <= budget_mib << 20


@pytest.mark.parametrize(("n_rows", "max_rows", "want"), [
    (16384, 1768, 1536),  # the default budget at 16384 x 2048 x 151936: 10 x 1536 + 1024 (whole 256-row tiles)
    (16384, 7236, 5632),  # 2 GiB there: 5632 + 5632 + 5120, not 6912 + 6912 + 2560
    (8192, 8192, 8192),
    (8192, 6000, 4096),  # two even chunks, not 5888 + 2304
    (1000, 300, 256),
    (300, 100, 100),  # under one tile: as many rows as fit
])
def test_chunks_are_as_even_as_whole_tiles_allow(n_rows, max_rows, want):
    """The fewest chunks of at most max_rows, each a multiple of 256 rows, as even as that allows: a short last
    chunk costs a GEMM at a fraction of the GPU (chunk_rows' docstring has the measurements)."""
    from flce.backends.cuda.plan import chunk_rows

    rows = chunk_rows(n_rows, max_rows)
    assert rows == want and rows <= max_rows
    largest = max_rows - max_rows % 256 or max_rows  # no more chunks than of the largest whole-tile size
    assert -(-n_rows // rows) == -(-n_rows // largest)


@pytest.mark.cuda
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "return_entropy": True, "reduction": "none"}],
                         ids=["plain", "full-deferred"])
def test_gpu_deterministic(options):
    """No atomics anywhere: the same inputs give bitwise the same loss and gradients."""
    x, w, b, t = lm_head_inputs(3000, 512, 50257, torch.bfloat16, "cuda", with_bias=True)
    runs = []
    for _ in range(2):
        out = flce.linear_cross_entropy(x, w, t, b, memory_budget=32 << 20, **options)
        loss = out if isinstance(out, torch.Tensor) else out.loss + out.entropy
        upstream = torch.ones_like(loss) if loss.dim() else None
        grads = torch.autograd.grad(loss, (x, w, b), upstream)
        runs.append((loss.detach(), *grads))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, 64 << 20], ids=["default-token-chunks", "64MiB-vocab-blocks"])
def test_gpu_bias_gradient_adds_no_chunk_sized_memory(budget):
    """A bias's gradient (each chunk's or vocabulary block's column sums, into fp32) costs no more than a few
    MiB above the same call without a bias: PyTorch's column-sum reduction staged 148 MiB (V x 1024 bytes)
    at 1536-row chunks of V = 151936 beside the chunk's logits, and held ~130 MiB more than a 64 MiB budget's
    vocabulary block; and the bias gradient is within 1.5x of eager bf16's error."""
    from helpers import relative_error

    from flce.testing.measure import peak_mib_above

    x, w, b, t = lm_head_inputs(4096, 1024, 151936, torch.bfloat16, "cuda", with_bias=True)

    def step(bias):
        loss = flce.linear_cross_entropy(x, w, t, bias, memory_budget=budget)
        return torch.autograd.grad(loss, (x, w) if bias is None else (x, w, bias))

    step(b)  # compiled kernels, cuBLAS's workspaces: allocated once, not the call's working memory
    without, with_bias = peak_mib_above(lambda: step(None)), peak_mib_above(lambda: step(b))
    assert with_bias <= without + 4, (with_bias, without)
    if budget is not None:
        assert with_bias <= budget / 2**20 + 4, (with_bias, budget)
    got = step(b)[2]
    leaves = [leaf.detach().double().requires_grad_(True) for leaf in (x, w, b)]
    want = torch.autograd.grad(reference_loss(*leaves[:2], t, leaves[2]).loss, leaves[2])[0]
    eager_b = b.detach().requires_grad_(True)
    eager = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x.detach(), w.detach(), eager_b).float(), t)
    base = torch.autograd.grad(eager, eager_b)[0]
    assert relative_error(got, want) <= 1.5 * relative_error(base, want) + 1e-6
