"""The student's entropy a distillation call returns (``return_entropy=True``) against the float64 oracle
(flce.testing.distillation.reference_student_entropy): on the reference backend, on the CUDA backend's kernels (the
Triton interpreter on CPU tensors without a GPU, the GPU where there is one: the statistics sweep in blocks of 16
columns, so a row's sum moves with its running max, one kernel for the passes and one a pass, and each head's
statistics from its logits GEMM) and on the Ascend kernels (interpreted); its merge across vocabulary shards; the
loss and gradients bitwise those of the call without it; no gradient; the module form; one graph under
torch.compile. Vocabulary-parallel calls are checked in tests/test_distillation_distributed.py."""

from __future__ import annotations

import os

import pytest
import torch
from distillation_helpers import NAMES, Pair, flce_loss, make_pair, relative

import flce
from flce.autotune import override_params
from flce.distillation.config import DistillationConfig
from flce.distillation.semantics import PairStats, merge_pair_stats
from flce.distillation.tiles import tile_statistics
from flce.testing.distillation import reference_student_entropy

LOSSES = ("forward_kl", "reverse_kl", "jsd")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(pair: Pair, temperature: float = 1.0, ignore_index: int = -100) -> torch.Tensor:
    p = pair.detached("cpu")
    return reference_student_entropy(p.student_hidden, p.student_weight, p.target, temperature=temperature,
                                     ignore_index=ignore_index, student_bias=p.student_bias)


def _student_grads(loss: torch.Tensor, pair: Pair) -> list[torch.Tensor]:
    leaves = [getattr(pair, name) for name in NAMES[:3] if getattr(pair, name) is not None]
    return list(torch.autograd.grad(loss.sum(), leaves))


def _check(pair: Pair, rtol: float = 1e-5, same_plan: bool = True, **options: object) -> None:
    """The entropy equals the oracle's; the loss and the student's gradients are bitwise the plain call's (where
    the entropy changes the plan, as reverse KL's from the GEMMs' statistics, whose student epilogue holds one
    weighted sum, within fp32 rounding of it)."""
    out = flce_loss(pair, return_entropy=True, **options)
    assert isinstance(out, flce.DistillationOutput)
    expected = _expected(pair, options.get("temperature", 1.0), options.get("ignore_index", -100))
    assert out.entropy.shape == expected.shape and out.entropy.dtype == torch.float32
    assert not out.entropy.requires_grad
    error = relative(out.entropy, expected)
    assert error <= rtol, f"entropy: relative error {error:.2e}"
    if pair.target is not None:  # ignored rows are exactly 0
        assert (out.entropy[pair.target.to(out.entropy.device) == options.get("ignore_index", -100)] == 0).all()
    plain = flce_loss(pair, **options)
    tolerance = {} if same_plan else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out.loss, plain, **(tolerance or {"rtol": 0, "atol": 0}))
    for got, want in zip(_student_grads(out.loss, pair), _student_grads(plain, pair), strict=True):
        torch.testing.assert_close(got, want, **(tolerance or {"rtol": 0, "atol": 0}))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("hard_label_weight", "temperature"), [(0.0, 1.0), (0.3, 0.6), (1.0, 2.0)])
def test_reference_every_loss(loss: str, reduction: str, hard_label_weight: float, temperature: float,
                              generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True, scale=3.0)
    _check(pair, loss=loss, reduction=reduction, hard_label_weight=hard_label_weight, temperature=temperature,
           backend="reference", memory_budget=1000)


def test_token_shape_no_target_and_the_module(generator: torch.Generator) -> None:
    pair = make_pair(generator, token_shape=(3, 5), target=False)
    _check(pair, loss="reverse_kl", backend="reference")
    module = flce.get_distillation_impl("cpu", backend="reference")(return_entropy=True, loss="forward_kl")
    out = module(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight)
    assert out.entropy.shape == (3, 5)
    assert relative(out.entropy, _expected(pair)) <= 1e-5


def test_other_ignore_index_and_every_row_ignored(generator: torch.Generator) -> None:
    pair = make_pair(generator, ignore_index=7, ignore_fraction=0.4)
    _check(pair, ignore_index=7, backend="reference")
    pair.target.fill_(-100)
    out = flce_loss(pair, return_entropy=True, backend="reference")
    assert torch.equal(out.entropy, torch.zeros_like(out.entropy))


def test_entropy_is_refused_unless_a_bool(generator: torch.Generator) -> None:
    pair = make_pair(generator)
    with pytest.raises(TypeError, match="return_entropy"):
        flce_loss(pair, return_entropy="yes")


@pytest.mark.parametrize("loss", LOSSES)
def test_sums_merge_across_vocabulary_shards(loss: str, generator: torch.Generator) -> None:
    """Shards whose maxima differ by far (one shard's logits shifted up by 6) merge to the whole row's entropy, as
    the vocab-parallel combine merges them."""
    cfg = DistillationConfig(loss=loss, temperature=0.7, return_entropy=True)
    teacher, student = torch.randn(9, 30, generator=generator), torch.randn(9, 30, generator=generator)
    student[:, 11:] += 6.0
    no_target = torch.full((9,), -1)
    parts = [tile_statistics(teacher[:, cols], student[:, cols], no_target, cfg) for cols in (slice(0, 11),
                                                                                         slice(11, 30))]
    merged = PairStats.from_partial(merge_pair_stats(parts[0], parts[1], cfg), cfg)
    whole = PairStats.from_partial(tile_statistics(teacher, student, no_target, cfg), cfg)
    torch.testing.assert_close(merged.student_entropy, whole.student_entropy, rtol=1e-6, atol=1e-6)


# The CUDA kernels: blocks of 16 columns (a row of 40 spans three); the default plan (forward's passes in one kernel,
# the statistics from its first sweep here, from the logits GEMMs' epilogue on Hopper), one kernel a pass, rows in
# flight, and each head's statistics from its logits GEMM (the Triton statistics GEMM, its entropy sum in the
# epilogue).
SMALL_BLOCKS = {"block_v": 16, "num_warps": 4}
KNOBS = {"default": {}, "separate": {"pair_passes": "separate"}, "in-flight": {"rows_in_flight": 3},
         "stats-in-gemm": {"forward_logits": "fused", "logits_kernel": "triton"}}


@pytest.mark.triton
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("knobs", list(KNOBS))
def test_cuda_kernels(loss: str, knobs: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, n=17, bias=True, scale=3.0).detached(DEVICE)
    # reduction "none" in forward only (no gradient): the GEMMs' statistics serve it without a pass
    for options in ({"temperature": 0.7}, {"reduction": "none", "hard_label_weight": 0.3}):
        with override_params(dict(SMALL_BLOCKS, **KNOBS[knobs]), backend="cuda"):
            _check(pair, same_plan=not (knobs == "stats-in-gemm" and loss == "reverse_kl"), loss=loss,
                   backend="cuda", memory_budget=1000, **options)
    with torch.no_grad(), override_params(dict(SMALL_BLOCKS, **KNOBS[knobs]), backend="cuda"):
        out = flce_loss(pair, loss=loss, backend="cuda", return_entropy=True, reduction="none")
    assert relative(out.entropy, _expected(pair)) <= 1e-5


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Ascend kernels on CPU tensors need the Triton interpreter (set without a GPU)")
@pytest.mark.parametrize("loss", LOSSES)
def test_ascend_kernels(loss: str, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from flce.backends.ascend import ops

    monkeypatch.setenv(ops.ENV_UB_BYTES, "4096")  # blocks of 16 columns: a row of 40 spans three
    pair = make_pair(generator, bias=True, scale=3.0)
    _check(pair, loss=loss, backend="ascend", temperature=0.7, hard_label_weight=0.3, memory_budget=1000)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("loss", LOSSES)
def test_bf16_on_the_gpu_within_eager_error(loss: str, generator: torch.Generator) -> None:
    """bf16 heads at a realistic vocabulary, the default plan: within 1.5x of eager bf16's entropy error (eager's
    log-softmax and product in bf16, as a trainer's metric would compute it)."""
    pair = make_pair(generator, n=256, student_size=256, teacher_size=384, vocab=32000, dtype=torch.bfloat16,
                     scale=4.0).detached("cuda")
    out = flce_loss(pair, loss=loss, return_entropy=True)
    expected = _expected(pair)
    log_q = torch.log_softmax(pair.student_hidden @ pair.student_weight.T, dim=-1)
    eager = torch.where(pair.target != -100, -(log_q.exp() * log_q).sum(-1), 0.0)
    assert relative(out.entropy, expected) <= 1.5 * relative(eager, expected)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_one_graph_under_compile(backend: str, generator: torch.Generator) -> None:
    """The call as the custom op torch.compile sees, the CUDA backend's on a GPU."""
    import torch._dynamo.testing

    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pair = make_pair(generator).detached(DEVICE if backend == "cuda" else "cpu")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()

    @torch.compile(backend=counter, fullgraph=True)
    def step(xs, ws, xt, wt, target):
        out = flce.linear_distillation_loss(xs, ws, xt, wt, target, temperature=0.9, return_entropy=True,
                                            backend=backend)
        return out.loss, out.entropy.sum()

    loss, entropy_sum = step(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight,
                             pair.target)
    loss.backward()
    assert counter.frame_count == 1
    assert relative(entropy_sum, _expected(pair, 0.9).sum()) <= 1e-5
    eager = pair.detached(pair.student_hidden.device)
    plain = flce_loss(eager, temperature=0.9, backend=backend)
    plain.backward()
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(pair.student_weight.grad, eager.student_weight.grad)
