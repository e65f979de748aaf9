"""The shared chunk loop's schedules agree with each other (reference kernels, CPU)."""

from __future__ import annotations

import pytest
import torch

from flce.backends.chunk_driver import ChunkPlan, run_forward
from flce.backends.reference.kernels import ReferenceKernels
from flce.config import LCEConfig
from flce.inputs import prepare_inputs
from flce.semantics import PartialRowStats, RowStats, merge_partial_stats


@pytest.mark.parametrize("block", [1, 7, 64, 500])
def test_vocab_block_scan_equals_token_chunks(block: int) -> None:
    n, h, v = 23, 12, 131
    cfg = LCEConfig(label_smoothing=0.1, return_entropy=True, return_token_accuracy=True,
                    return_predicted_tokens=True, lse_square_scale=1e-3, softcap=4.0,
                    class_weight=torch.rand(v) + 0.5)
    x, w, b = torch.randn(n, h), torch.randn(v, h), torch.randn(v)
    t = torch.randint(0, v, (n,))
    t[3] = -100
    flat = prepare_inputs(x, w, t, b, cfg)
    kernels = ReferenceKernels()
    by_rows = run_forward(kernels, flat, cfg, ChunkPlan(5, False), plain=False, grads_in_forward=None,
                          backward_follows=False)
    by_cols = run_forward(kernels, flat, cfg, ChunkPlan(5, False, vocab_block=block), plain=False,
                          grads_in_forward=None, backward_follows=False)
    torch.testing.assert_close(by_cols.loss, by_rows.loss, rtol=1e-6, atol=1e-6)
    for name, value in by_rows.extras.items():
        torch.testing.assert_close(by_cols.extras[name], value, rtol=1e-6, atol=1e-6)


def test_merge_partial_stats_is_the_stats_of_the_union() -> None:
    z = torch.randn(6, 40) * 3
    z[:, 30] = z[:, 5]  # ties across the split: the first index must win

    def partial(cols: slice, offset: int) -> PartialRowStats:
        block = z[:, cols]
        row_max = block.max(1).values
        e = torch.exp(block - row_max[:, None])
        return PartialRowStats(row_max=row_max, sum_exp=e.sum(1), target_z=torch.zeros(6),
                               sum_exp_z=(e * block).sum(1), weighted_sum_z=block.sum(1),
                               argmax=block.argmax(1) + offset)

    merged = RowStats.from_partial(merge_partial_stats(partial(slice(0, 17), 0), partial(slice(17, 40), 17)))
    whole = RowStats.from_partial(partial(slice(0, 40), 0))
    torch.testing.assert_close(merged.lse, whole.lse)
    torch.testing.assert_close(merged.expected_z, whole.expected_z)
    torch.testing.assert_close(merged.weighted_sum_z, whole.weighted_sum_z)
    assert torch.equal(merged.argmax, whole.argmax)
