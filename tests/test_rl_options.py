"""The RL options: ``selected_ids`` (selected_logprobs), ``return_logit_stats`` (logit_stats) and
``batch_invariant``, on the reference backend, against a float64 materialised formula.

``z = cap(hidden @ weight.T + bias) / temperature`` per token; ``selected_logprobs[..., k] =
log softmax(z)[selected_ids[..., k]]`` (0 where the token is ignored), differentiable;
``logit_stats[..., :] = (max z, min z, mean z)`` (0 where ignored), detached. Batch-invariant mode:
a token's loss, log-prob, entropy, selected log-probs and grad_hidden row are bitwise the same
whatever else is in the batch, where the token sits and how the call is chunked.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import leaf_inputs
from test_distributed import Checker, assert_section, run_ranks

import flce

FP32 = dict(rtol=1e-5, atol=1e-5)
FP32_GRAD = dict(rtol=1e-4, atol=1e-4)
FP64 = dict(rtol=1e-7, atol=1e-7)


def formula(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
            selected: torch.Tensor | None, *, temperature: float = 1.0, softcap: float | None = None,
            ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """float64, materialised, differentiable: logprobs, entropy, selected_logprobs, logit_stats."""
    shape = target.shape
    u = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().T
    if bias is not None:
        u = u + bias.double()
    z = u if softcap is None else softcap * torch.tanh(u / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = (target.reshape(-1) != ignore_index)
    safe = torch.where(valid, target.reshape(-1), 0)
    out = {
        "logprobs": torch.where(valid, log_p.gather(1, safe[:, None]).squeeze(1), 0.0).reshape(shape),
        "entropy": torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0).reshape(shape),
        "logit_stats": torch.where(valid[:, None], torch.stack([z.amax(-1), z.amin(-1), z.mean(-1)], -1),
                                   0.0).reshape(*shape, 3).detach(),
    }
    if selected is not None:
        k = selected.shape[-1]
        picked = log_p.gather(1, selected.reshape(-1, k))
        out["selected_logprobs"] = torch.where(valid[:, None], picked, 0.0).reshape(*shape, k)
    return out


def grads_of(outputs: list[torch.Tensor], upstream: list[torch.Tensor], leaves: list[torch.Tensor]) -> list:
    total = sum((o.double() * u).sum() for o, u in zip(outputs, upstream, strict=True))
    return list(torch.autograd.grad(total, leaves))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, **tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- selected_ids

CASES = {
    "plain": dict(),
    "temperature+bias": dict(temperature=0.7, bias=True),
    "softcap+temperature": dict(softcap=4.0, temperature=1.3),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selected_logprobs_and_logit_stats(generator: torch.Generator, dtype: torch.dtype, case: str) -> None:
    options = dict(CASES[case])
    has_bias = options.pop("bias", False)
    data = leaf_inputs(generator, (3, 5), 40, 120, dtype, bias=has_bias)
    hidden, weight, bias, target = data["hidden"], data["weight"], data["bias"], data["target"]
    target[0, 1] = target[2, 4] = -100
    selected = torch.randint(0, 120, (3, 5, 4), generator=generator)
    selected[1, 2, 3] = selected[1, 2, 0]  # a duplicate id: both columns get it
    selected[0, 0, 1] = target[0, 0]  # the target among the candidates
    out = flce.linear_cross_entropy(hidden, weight, target, bias, reduction="none", selected_ids=selected,
                                    return_logit_stats=True, return_logprobs=True, return_entropy=True, **options)
    expected = formula(hidden, weight, target, bias, selected, **options)
    stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.selected_logprobs.dtype == stats_dtype and out.logit_stats.dtype == stats_dtype
    assert not out.logit_stats.requires_grad, "logit_stats must be detached"
    tol, grad_tol = (FP64, FP64) if dtype == torch.float64 else (FP32, FP32_GRAD)
    for name in ("selected_logprobs", "logit_stats", "logprobs", "entropy"):
        assert_close(getattr(out, name), expected[name], name, **tol)
    assert torch.equal(out.selected_logprobs[1, 2, 3], out.selected_logprobs[1, 2, 0])

    leaves = [t for t in (hidden, weight, bias) if t is not None]
    upstream = [torch.randn(3, 5, 4, generator=generator, dtype=torch.float64),
                torch.randn(3, 5, generator=generator, dtype=torch.float64),
                torch.randn(3, 5, generator=generator, dtype=torch.float64),
                torch.randn(3, 5, generator=generator, dtype=torch.float64)]
    got = grads_of([out.selected_logprobs, out.logprobs, out.entropy, out.loss], upstream, leaves)
    want = grads_of([expected["selected_logprobs"], expected["logprobs"], expected["entropy"],
                     -expected["logprobs"]], upstream, leaves)
    for name, a, b in zip(["grad hidden", "grad weight", "grad bias"], got, want, strict=False):
        assert_close(a, b, f"{name} ({case})", **grad_tol)
    assert torch.equal(got[0][0, 1], torch.zeros_like(got[0][0, 1])), "an ignored token got a gradient"


def test_selected_logprobs_alone_and_errors(generator: torch.Generator) -> None:
    data = leaf_inputs(generator, (9,), 16, 50, torch.float32)
    hidden, weight, target = data["hidden"], data["weight"], data["target"]
    selected = torch.randint(0, 50, (9, 3), generator=generator)
    out = flce.linear_cross_entropy(hidden, weight, target, selected_ids=selected)
    assert isinstance(out, flce.LCEOutput) and out.loss.shape == ()
    expected = formula(hidden, weight, target, None, selected)
    assert_close(out.selected_logprobs, expected["selected_logprobs"], "selected_logprobs", **FP32)
    (grad_hidden,) = torch.autograd.grad(out.selected_logprobs.sum(), [hidden])
    (want,) = torch.autograd.grad(expected["selected_logprobs"].sum(), [hidden])
    assert_close(grad_hidden, want, "grad hidden from selected_logprobs alone", **FP32_GRAD)
    empty = flce.linear_cross_entropy(hidden, weight, target, selected_ids=selected[:, :0])
    assert empty.selected_logprobs.shape == (9, 0)
    with pytest.raises(ValueError, match="selected_ids"):
        flce.linear_cross_entropy(hidden, weight, target, selected_ids=selected.masked_fill(selected == selected[0, 0],
                                                                                              50))
    with pytest.raises(ValueError, match="selected_ids"):
        flce.linear_cross_entropy(hidden, weight, target, selected_ids=selected[:4])
    with pytest.raises((TypeError, ValueError), match="selected_ids"):
        flce.linear_cross_entropy(hidden, weight, target, selected_ids=selected.float())


@pytest.mark.parametrize("detach_extras", [False, True])
def test_selected_logprobs_under_torch_compile(detach_extras: bool, generator: torch.Generator) -> None:
    """One graph (fullgraph=True), the eager call's selected log-probs, loss and gradients; ids out of range
    fail when the compiled call runs (a device-side assertion: reading them while tracing would break the graph)."""
    data = leaf_inputs(generator, (11,), 16, 50, torch.float32)
    hidden, weight, target = data["hidden"], data["weight"], data["target"]
    selected = torch.randint(0, 50, (11, 3), generator=generator)

    def call(h, w, ids):
        return flce.linear_cross_entropy(h, w, target, selected_ids=ids, temperature=0.8, detach_extras=detach_extras)

    def outputs_and_grads(fn):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        out = fn(h, w, selected)
        objective = out.loss + (0.0 if detach_extras else (out.selected_logprobs ** 2).sum())
        return out, torch.autograd.grad(objective, (h, w))

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    got, got_grads = outputs_and_grads(compiled)
    want, want_grads = outputs_and_grads(call)
    assert got.selected_logprobs.requires_grad is not detach_extras
    assert_close(got.selected_logprobs, want.selected_logprobs, "compiled selected_logprobs", **FP32)
    assert_close(got.loss, want.loss, "compiled loss", **FP32)
    for name, a, b in zip(("grad hidden", "grad weight"), got_grads, want_grads, strict=True):
        assert_close(a, b, f"compiled {name}", **FP32_GRAD)
    with pytest.raises(RuntimeError, match=r"selected_ids: expected ids in \[0, V=50\)"):
        compiled(hidden, weight, selected.masked_fill(selected == selected[0, 0], 50))


def test_logit_stats_of_extreme_rows(generator: torch.Generator) -> None:
    data = leaf_inputs(generator, (6,), 8, 30, torch.float32)
    hidden, weight, target = data["hidden"], data["weight"], data["target"]
    with torch.no_grad():
        hidden[2] *= 50  # a very peaked row: max and min far apart
    out = flce.linear_cross_entropy(hidden, weight, target, return_logit_stats=True, temperature=0.5)
    expected = formula(hidden, weight, target, None, None, temperature=0.5)
    assert_close(out.logit_stats, expected["logit_stats"], "logit_stats", **FP32)
    assert out.loss.requires_grad and not out.logit_stats.requires_grad


# --------------------------------------------------------------------------- batch_invariant

def test_batch_invariant_is_bitwise_across_batches(generator: torch.Generator) -> None:
    check_batch_invariance(generator, torch.device("cpu"), torch.float32, hidden_size=64, vocab=500)


@pytest.mark.parametrize("token_shape", [(0,), (3, 0)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batch_invariant_on_an_empty_batch_returns_what_the_plain_call_does(token_shape: tuple[int, ...],
                                                                             reduction: str) -> None:
    """No tokens, with selected_ids (K = 2 and K = 0): empty outputs of the right shapes, as without
    batch_invariant (its padding to whole tiles inferred K from the ids' elements, of which there are none)."""
    hidden, weight = torch.randn(*token_shape, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    target = torch.zeros(token_shape, dtype=torch.long)
    for k in (2, 0):
        selected = torch.zeros(*token_shape, k, dtype=torch.long)
        want, got = (flce.linear_cross_entropy(hidden, weight, target, reduction=reduction, selected_ids=selected,
                                               return_logprobs=True, batch_invariant=invariant)
                     for invariant in (False, True))
        for name in ("loss", "logprobs", "selected_logprobs"):
            assert getattr(got, name).shape == getattr(want, name).shape, name
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
        grads = torch.autograd.grad(got.loss.sum() + got.selected_logprobs.sum(), (hidden, weight))
        assert grads[0].shape == hidden.shape and not grads[1].any()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_is_bitwise_on_cuda(generator: torch.Generator, dtype: torch.dtype) -> None:
    """The reference backend's tiles on the GPU (cuBLAS GEMMs of one shape): bitwise too."""
    check_batch_invariance(generator, torch.device("cuda"), dtype, hidden_size=1024, vocab=32000)


def check_batch_invariance(generator: torch.Generator, device: torch.device, dtype: torch.dtype, *,
                           hidden_size: int, vocab: int) -> None:
    """The same 7 tokens alone, at offset 11 of 40, and at offset 250 of 300 with a memory budget
    that would otherwise force several chunks: every per-token output and grad_hidden row bitwise
    equal, and the log-probs those of the float64 formula."""
    data = leaf_inputs(generator, (7,), hidden_size, vocab, dtype, bias=True)
    tokens, target = data["hidden"].detach().to(device), data["target"].to(device)
    weight, bias = (data[name].detach().to(device).requires_grad_() for name in ("weight", "bias"))
    selected = torch.randint(0, vocab, (7, 2), generator=generator).to(device)
    upstream = [torch.randn(7, generator=generator, dtype=torch.float64).to(device) for _ in range(3)]
    upstream_selected = torch.randn(7, 2, generator=generator, dtype=torch.float64).to(device)

    def run(batch: int, offset: int, budget: int | None) -> dict[str, torch.Tensor]:
        hidden = torch.randn(batch, hidden_size, generator=generator).to(device, dtype)
        hidden[offset:offset + 7] = tokens
        hidden.requires_grad_()
        full_target = torch.randint(0, vocab, (batch,), generator=generator).to(device)
        full_target[offset:offset + 7] = target
        full_selected = torch.randint(0, vocab, (batch, 2), generator=generator).to(device)
        full_selected[offset:offset + 7] = selected
        out = flce.linear_cross_entropy(hidden, weight, full_target, bias, reduction="none", temperature=0.8,
                                        return_logprobs=True, return_entropy=True, selected_ids=full_selected,
                                        batch_invariant=True, memory_budget=budget)
        rows = slice(offset, offset + 7)

        def spread(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            full = torch.zeros(shape, dtype=torch.float64, device=device)
            full[rows] = values
            return full

        (grad_hidden,) = torch.autograd.grad(
            sum((o.double() * spread(u, o.shape)).sum() for o, u in
                [(out.loss, upstream[0]), (out.logprobs, upstream[1]), (out.entropy, upstream[2]),
                 (out.selected_logprobs, upstream_selected)]), [hidden])
        return {"loss": out.loss[rows], "logprobs": out.logprobs[rows], "entropy": out.entropy[rows],
                "selected_logprobs": out.selected_logprobs[rows], "grad_hidden": grad_hidden[rows]}

    alone, middle, chunked = run(7, 0, None), run(40, 11, None), run(300, 250, 64 * 1024)
    for name in alone:
        for label, other in (("offset 11 of 40", middle), ("offset 250 of 300, chunked", chunked)):
            assert torch.equal(alone[name], other[name]), f"{name}: alone != {label} (not bitwise)"
    expected = formula(tokens.cpu(), weight.cpu(), target.cpu(), bias.cpu(), selected.cpu(), temperature=0.8)
    tol = FP32 if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert_close(alone["logprobs"].cpu(), expected["logprobs"], "logprobs vs float64", **tol)


# --------------------------------------------------------------------------- vocabulary parallelism (gloo)

def section_sharded_options(checker: Checker, rank: int, world_size: int) -> None:
    """selected_logprobs and logit_stats with the vocabulary in uneven shards: the unsharded values
    on every rank, grad_hidden complete on every rank, grad of weight / bias this rank's rows."""
    base = int(os.environ.get("FLCE_TEST_SEED", "0"))
    generator = torch.Generator().manual_seed(zlib.crc32(b"sharded_options") + 1_000_003 * base)
    sizes = tuple(23 + 41 * r for r in range(world_size))
    full = leaf_inputs(generator, (4, 3), 24, sum(sizes), torch.float32, bias=True)
    full["target"][1, 2] = -100
    selected = torch.randint(0, sum(sizes), (4, 3, 5), generator=generator)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    hidden = full["hidden"].detach().clone().requires_grad_()
    shard = full["weight"].detach()[rows].clone().requires_grad_()
    bias = full["bias"].detach()[rows].clone().requires_grad_()
    upstream = [torch.randn(4, 3, 5, generator=generator, dtype=torch.float64),
                torch.randn(4, 3, generator=generator, dtype=torch.float64)]
    expected = formula(full["hidden"], full["weight"], full["target"], full["bias"], selected, temperature=0.9)
    want = grads_of([expected["selected_logprobs"], expected["logprobs"]], upstream,
                    [full["hidden"], full["weight"], full["bias"]])
    with checker.case(f"w{world_size}/forward"):
        out = flce.linear_cross_entropy(hidden, shard, full["target"], bias, reduction="none", temperature=0.9,
                                        selected_ids=selected, return_logit_stats=True, return_logprobs=True,
                                        process_group=dist.group.WORLD)
        for name in ("selected_logprobs", "logit_stats", "logprobs"):
            assert_close(getattr(out, name), expected[name], name, **FP32)
    with checker.case(f"w{world_size}/backward"):
        got = grads_of([out.selected_logprobs, out.logprobs], upstream, [hidden, shard, bias])
        assert_close(got[0], want[0], "grad hidden", **FP32_GRAD)
        assert_close(got[1], want[1][rows], "grad weight shard", **FP32_GRAD)
        assert_close(got[2], want[2][rows], "grad bias shard", **FP32_GRAD)


SECTIONS = {"2": {"sharded_options": section_sharded_options}}


@pytest.mark.distributed
def test_options_under_vocab_parallelism(tmp_path: Path) -> None:
    assert_section(run_ranks(2, tmp_path, sections_module=__name__, sections_key="2"), "sharded_options")


# --------------------------------------------------------------------------- the Triton backends

@pytest.mark.triton
def test_cuda_row_kernel_keeps_logit_stats(generator: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's row-stats kernel (on the GPU, or interpreted on CPU tensors where there is
    none) keeps the row min and sum of z, across vocabulary blocks with a ragged tail and across
    token chunks."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 64)
    data = leaf_inputs(generator, (10,), 16, 203, torch.float32, bias=True)
    hidden, weight, bias = (data[name].detach().to(device).requires_grad_() for name in ("hidden", "weight", "bias"))
    target = data["target"].to(device)
    target[4] = -100
    out = flce.linear_cross_entropy(hidden, weight, target, bias, backend="cuda", reduction="none",
                                    return_logit_stats=True, return_logprobs=True, softcap=3.0, temperature=0.8,
                                    memory_budget=4 * 203 * 4)
    expected = formula(hidden.cpu(), weight.cpu(), target.cpu(), bias.cpu(), None, softcap=3.0, temperature=0.8)
    assert_close(out.logit_stats.cpu(), expected["logit_stats"], "logit_stats (CUDA kernels)", **FP32)
    assert_close(out.logprobs.cpu(), expected["logprobs"], "logprobs (CUDA kernels)", **FP32)


def test_triton_backends_route_what_they_lack() -> None:
    """Ascend has no logit-stats kernels and neither Triton backend plans batch-invariant tiles: their
    support checks decline with the reason, which sends the call to the reference backend."""
    from flce.backends.ascend import BACKEND as ASCEND
    from flce.backends.cuda import BACKEND as CUDA
    from flce.config import LCEConfig

    stats, tiles = LCEConfig(return_logit_stats=True), LCEConfig(batch_invariant=True)
    assert CUDA.supports(stats, torch.bfloat16, 64, 1000) == (True, "supported")
    ok, reason = ASCEND.supports(stats, torch.bfloat16, 64, 1000)
    assert not ok and "return_logit_stats" in reason
    for backend in (CUDA, ASCEND):
        ok, reason = backend.supports(tiles, torch.bfloat16, 64, 1000)
        assert not ok and "batch_invariant" in reason
