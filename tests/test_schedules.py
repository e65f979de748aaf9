"""The engine's named schedules agree with each other and with the float64 oracle (reference
kernels, CPU), and a plan that needs a capability its backend lacks is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_loss

from flce.backends.reference.kernels import ReferenceKernels
from flce.config import LCEConfig
from flce.engine.call import EngineCall, GradTargets
from flce.engine.kernels import FUSED_GRAD_GEMM, FUSED_STATS_GEMM
from flce.engine.plans import CUBLAS, FUSED, AllRows, TokenChunks, VocabBlocks
from flce.engine.schedule import check_capabilities, run_backward, run_forward
from flce.inputs import prepare_inputs
from flce.semantics import PartialRowStats, RowStats, merge_partial_stats

N, H, V = 23, 12, 131
FULL_OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0, temperature=0.8)


def _inputs(generator: torch.Generator, cfg_options: dict) -> tuple:
    x = torch.randn(N, H, generator=generator, dtype=torch.float64)
    w = torch.randn(V, H, generator=generator, dtype=torch.float64)
    b = torch.randn(V, generator=generator, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=generator)
    t[3] = -100
    cfg = LCEConfig(class_weight=torch.rand(V, generator=generator, dtype=torch.float64) + 0.5, **cfg_options)
    return x, w, b, t, cfg


def _call(cfg: LCEConfig, plan: object, flat: object) -> EngineCall:
    return EngineCall(kernels=ReferenceKernels(), cfg=cfg, plan=plan, plain=False, token_shape=flat.token_shape)


@pytest.mark.parametrize("block", [1, 7, 64, 500])
def test_all_rows_scan_equals_token_chunks(block: int, generator: torch.Generator) -> None:
    x, w, b, t, cfg = _inputs(generator, dict(FULL_OPTIONS, return_entropy=True, return_token_accuracy=True,
                                              return_predicted_tokens=True))
    flat = prepare_inputs(x, w, t, b, cfg)
    by_rows = run_forward(_call(cfg, TokenChunks(5), flat), flat, None, backward_follows=False)
    by_cols = run_forward(_call(cfg, AllRows(forward_stats=CUBLAS, scan_block=block), flat), flat, None,
                          backward_follows=False)
    torch.testing.assert_close(by_cols.loss, by_rows.loss, rtol=1e-12, atol=1e-12)
    for name, value in by_rows.extras.items():
        torch.testing.assert_close(by_cols.extras[name], value, rtol=1e-12, atol=1e-12)
    expected = reference_loss(x, w, t, b, **FULL_OPTIONS, class_weight=cfg.class_weight)
    torch.testing.assert_close(by_cols.loss, expected.loss, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("plan", [TokenChunks(5), TokenChunks(5, saved_rows=10),
                                  TokenChunks(5, stats_first=AllRows(forward_stats=CUBLAS, scan_block=9)),
                                  VocabBlocks(grad_vocab_block=17, stats=AllRows(forward_stats=CUBLAS, scan_block=17))],
                         ids=["chunks", "chunks-kept", "chunks-stats-first", "vocab-blocks"])
def test_schedule_gradients_match_the_oracle(plan: object, reduction: str, generator: torch.Generator) -> None:
    """In-forward (mean) and deferred (none) gradients of every schedule against float64 autograd
    through the materialised oracle, with random upstream gradients."""
    x, w, b, t, cfg = _inputs(generator, dict(FULL_OPTIONS, reduction=reduction))
    flat = prepare_inputs(x, w, t, b, cfg)
    call = _call(cfg, plan, flat)
    wanted = GradTargets(hidden=True, weight=True, bias=True)
    upstream = torch.randn(() if reduction == "mean" else (N,), generator=generator, dtype=torch.float64) + 0.5
    in_forward = reduction == "mean"
    state = run_forward(call, flat, wanted if in_forward else None, backward_follows=True)
    if in_forward:
        grads = tuple(g * upstream for g in state.grads)
    else:
        grads = run_backward(call, flat, state, wanted, upstream, None, None)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    expected = reference_loss(*leaves[:2], t, leaves[2], **FULL_OPTIONS, reduction=reduction,
                              class_weight=cfg.class_weight)
    torch.testing.assert_close(state.loss, expected.loss.detach(), rtol=1e-10, atol=1e-10)
    expected_grads = torch.autograd.grad((expected.loss * upstream).sum(), leaves)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_plan_capabilities() -> None:
    assert TokenChunks(8).requires == frozenset()
    assert TokenChunks(8, forward_logits=FUSED).requires == {FUSED_STATS_GEMM}
    assert TokenChunks(8, backward_grad=FUSED, stats_first=AllRows()).requires == {FUSED_STATS_GEMM, FUSED_GRAD_GEMM}
    assert VocabBlocks(64, stats=AllRows(forward_stats=CUBLAS, scan_block=64)).requires == frozenset()
    assert VocabBlocks(64, stats=AllRows(), backward_grad=FUSED).requires == {FUSED_STATS_GEMM, FUSED_GRAD_GEMM}
    check_capabilities(TokenChunks(8), frozenset(), "reference")
    with pytest.raises(RuntimeError, match="lacks the kernel capabilities .*fused_stats_gemm"):
        check_capabilities(AllRows(), frozenset({FUSED_GRAD_GEMM}), "reference")
    with pytest.raises(ValueError, match="scan_block"):
        AllRows(forward_stats=CUBLAS)
    with pytest.raises(ValueError, match="backward_grad"):
        TokenChunks(8, backward_grad="triton")


def test_merge_partial_stats_is_the_stats_of_the_union() -> None:
    z = torch.randn(6, 40) * 3
    z[:, 30] = z[:, 5]  # ties across the split: the first index must win

    def partial(cols: slice, offset: int) -> PartialRowStats:
        block = z[:, cols]
        row_max = block.max(1).values
        shifted = block - row_max[:, None]
        e = torch.exp(shifted)
        return PartialRowStats(row_max=row_max, sum_exp=e.sum(1), target_z=torch.zeros(6),
                               sum_exp_dz=(e * shifted).sum(1), weighted_sum_z=block.sum(1),
                               argmax=block.argmax(1) + offset)

    merged = RowStats.from_partial(merge_partial_stats(partial(slice(0, 17), 0), partial(slice(17, 40), 17)))
    whole = RowStats.from_partial(partial(slice(0, 40), 0))
    torch.testing.assert_close(merged.lse, whole.lse)
    torch.testing.assert_close(merged.entropy, whole.entropy)
    torch.testing.assert_close(merged.weighted_sum_z, whole.weighted_sum_z)
    assert torch.equal(merged.argmax, whole.argmax)
