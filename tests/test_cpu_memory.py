"""memory_budget bounds what a call allocates, on the CPU too: every chunk (or vocabulary block) of a
schedule writes its logits into one buffer allocated once per call, instead of a fresh chunk-sized
allocation per chunk, which fragmented glibc's heap so that peak RSS grew several times the budget
(flce.engine.rows.WorkBuffer). Counted deterministically, op by op, with a dispatch mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flce
from flce.testing import reference_loss

N, H, V = 384, 8, 1000
# Ops that make logits: the GEMMs, and the buffers they write into. The reference kernels' own
# temporaries (elementwise ops over cache-sized row blocks) are bounded separately.
LOGITS_MAKERS = ("aten.mm.default", "aten.addmm.default", "aten.new_empty.default", "aten.empty.memory_format")


class LargeAllocations(TorchDispatchMode):
    """Counts the outputs of LOGITS_MAKERS that own new storage of at least ``min_bytes`` (an op
    writing into an out= tensor or in place makes none)."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes = min_bytes
        self.seen: set[int] = set()
        self.count = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) not in LOGITS_MAKERS:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.min_bytes:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in self.seen:
                    self.seen.add(ptr)
                    self.count += 1
                    self.ops.append(str(func))
        return out


@pytest.mark.parametrize(("reduction", "extras"), [("mean", {}), ("none", {}), ("none", {"return_entropy": True}),
                                                   ("sum", {"label_smoothing": 0.1})],
                         ids=["in-forward", "deferred-plain", "deferred-full", "in-forward-full"])
def test_logits_buffers_are_allocated_once_per_call(reduction: str, extras: dict,
                                                    generator: torch.Generator) -> None:
    rows_per_chunk = 32  # twelve chunks
    x = torch.randn(N, H, generator=generator, requires_grad=True)
    w = torch.randn(V, H, generator=generator, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=generator)
    chunk_bytes = rows_per_chunk * V * 4
    counter = LargeAllocations(min_bytes=chunk_bytes // 2)
    with counter:
        out = flce.linear_cross_entropy(x, w, t, reduction=reduction, memory_budget=chunk_bytes, **extras)
        loss = (out.loss.sum() + out.entropy.sum()) if isinstance(out, flce.LCEOutput) else out.sum()
        loss.backward()
    # Forward's buffer and backward's recompute buffer, never one per chunk (the weight gradient,
    # V x H x 4 = 32 KB, is below the threshold).
    assert counter.count <= 2, f"{counter.ops}: chunk-sized allocations for {N // rows_per_chunk} chunks"
    expected = reference_loss(x.detach(), w.detach(), t, reduction=reduction, **extras)
    torch.testing.assert_close(out.loss if isinstance(out, flce.LCEOutput) else out, expected.loss.float(),
                               rtol=1e-5, atol=1e-5)


def test_bias_column_sums_convert_row_blocks_only(generator: torch.Generator) -> None:
    """A 16-bit chunk's column sums into the fp32 bias gradient: PyTorch's CPU sum converts its whole
    input to fp32 first (twice the chunk's bytes, beside it); the reference kernels sum row blocks, whose
    conversions stay within CPU_BLOCK_BYTES; the sums agree with float64's to fp32 rounding."""
    from torch.profiler import ProfilerActivity, profile

    from flce.backends.reference.kernels import CPU_BLOCK_BYTES, ReferenceKernels

    a = torch.randn(1024, 6000, generator=generator).to(torch.bfloat16)  # its fp32 copy: 23.4 MiB
    acc = torch.randn(6000, generator=generator)
    want = acc.double() + a.double().sum(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ReferenceKernels().add_column_sums_(acc, a)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert 0 < largest <= CPU_BLOCK_BYTES, f"{largest} bytes allocated at once"
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-4)
