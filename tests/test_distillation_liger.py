"""The Liger-Kernel drop-in of linear distillation (flce.integrations.liger.LigerFusedLinearJSDLoss) against Liger
0.8.5's own ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` on the same inputs: float64 on the CPU (loss, the
separate terms where asked, and the student's gradients, the teacher's none), and in bf16 on the GPU, within 1.5x of
the error Liger's own makes there against its float64 self."""

from __future__ import annotations

import pytest
import torch

from flce.integrations.liger import LigerFusedLinearJSDLoss

chunked_loss = pytest.importorskip("liger_kernel.chunked_loss")



def _inputs(generator: torch.Generator, n: int = 37, student_h: int = 24, teacher_h: int = 40, vocab: int = 300,
            bias: bool = True, dtype: torch.dtype = torch.float64, device: str = "cpu") -> dict:
    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device, dtype)

    labels = torch.randint(0, vocab, (n,), generator=generator)
    labels[torch.rand(n, generator=generator) < 0.25] = -100
    return {"student_input": draw(n, student_h), "student_weight": draw(vocab, student_h, scale=student_h**-0.5),
            "teacher_input": draw(n, teacher_h), "teacher_weight": draw(vocab, teacher_h, scale=teacher_h**-0.5),
            "true_labels": labels.to(device),
            "student_bias": draw(vocab, scale=0.1) if bias else None,
            "teacher_bias": draw(vocab, scale=0.1) if bias else None}


STUDENT = ("student_input", "student_weight", "student_bias")


def _run(module: torch.nn.Module, inputs: dict) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor | None]]:
    leaves = {k: (v.detach().clone().requires_grad_(k in STUDENT) if v is not None else None)
              for k, v in inputs.items()}
    out = module(**leaves)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward()
    assert leaves["teacher_input"].grad is None and leaves["teacher_weight"].grad is None
    return tuple(o.detach() for o in outs), [leaves[k].grad if leaves[k] is not None else None for k in STUDENT]


def _assert_same(got, want) -> None:
    """Norm-relative agreement to 1e-6: Liger keeps its loss in fp32 whatever the inputs' dtype, so its float64
    results are about 4e-8 off float64's (flce's, to 1e-15: tests/test_distillation.py)."""
    (got_outs, got_grads), (want_outs, want_grads) = got, want
    assert len(got_outs) == len(want_outs)
    for g, w in zip(got_outs, want_outs, strict=True):
        assert abs(float(g) - float(w)) <= 1e-6 * max(abs(float(w)), 1e-3), (float(g), float(w))
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert _relative(g, w) <= 1e-6


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (the difference's norm where want is all zeros)."""
    diff, scale = float((got.double() - want.double()).norm()), float(want.double().norm())
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.2, 0.7), (0.0, 1.0), (1.0, 0.0), (-0.5, 1.5)],
                         ids=lambda w: f"hard{w[0]}-soft{w[1]}")
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_matches_ligers_class(weights: tuple[float, float], beta: float, temperature: float,
                              generator: torch.Generator) -> None:
    inputs = _inputs(generator, bias=beta != 0.3)
    options = dict(weight_hard_loss=weights[0], weight_soft_loss=weights[1], beta=beta, temperature=temperature)
    want = _run(chunked_loss.LigerFusedLinearJSDLoss(**options, compiled=False, chunk_size=16), inputs)
    _assert_same(_run(LigerFusedLinearJSDLoss(**options), inputs), want)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_returns_the_terms_as_ligers_does(beta: float, generator: torch.Generator) -> None:
    inputs = _inputs(generator)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=0.6, beta=beta, temperature=1.5, return_soft_hard_loss=True)
    want = _run(chunked_loss.LigerFusedLinearJSDLoss(**options, compiled=False), inputs)
    _assert_same(_run(LigerFusedLinearJSDLoss(**options), inputs), want)


def test_every_label_ignored_gives_ligers_zero(generator: torch.Generator) -> None:
    inputs = _inputs(generator)
    inputs["true_labels"] = torch.full_like(inputs["true_labels"], -7)
    options = dict(ignore_index=-7, return_soft_hard_loss=True)
    want = _run(chunked_loss.LigerFusedLinearJSDLoss(**options, compiled=False), inputs)
    got = _run(LigerFusedLinearJSDLoss(**options), inputs)
    _assert_same(got, want)
    assert all(float(o) == 0.0 for o in got[0])


def test_refuses_a_larger_teacher_vocabulary(generator: torch.Generator) -> None:
    inputs = _inputs(generator, bias=False)
    inputs["teacher_weight"] = torch.cat([inputs["teacher_weight"], inputs["teacher_weight"][:5]])
    with pytest.raises(ValueError, match="does not pad the student's"):
        LigerFusedLinearJSDLoss()(**inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16_on_the_gpu_within_ligers_own_error(beta: float, generator: torch.Generator) -> None:
    """bf16 at a vocabulary where flce's CUDA kernels run: the drop-in's loss and student gradients against Liger's
    class on the same inputs in float64, within 1.5x the error of Liger's own bf16 call."""
    inputs = _inputs(generator, n=1000, student_h=256, teacher_h=512, vocab=32003, bias=False, dtype=torch.bfloat16,
                     device="cuda")
    options = dict(weight_hard_loss=0.25, weight_soft_loss=0.75, beta=beta, temperature=1.2)
    liger = chunked_loss.LigerFusedLinearJSDLoss(**options, compiled=False)
    want_outs, want_grads = _run(liger, {k: v.double() if v is not None and v.is_floating_point() else v
                                         for k, v in inputs.items()})
    liger_outs, liger_grads = _run(liger, inputs)
    got_outs, got_grads = _run(LigerFusedLinearJSDLoss(**options), inputs)
    assert _relative(got_outs[0], want_outs[0]) <= 1.5 * _relative(liger_outs[0], want_outs[0]) + 1e-6
    for got, mine, want in zip(got_grads[:2], liger_grads[:2], want_grads[:2], strict=True):
        assert _relative(got, want) <= 1.5 * _relative(mine, want) + 1e-6


@pytest.mark.parametrize("return_terms", [False, True], ids=["total", "terms"])
def test_one_graph_under_torch_compile(return_terms: bool, generator: torch.Generator) -> None:
    """As Liger's class is often compiled with the model: the drop-in is one graph, its numbers the eager ones."""
    import torch._dynamo.testing

    inputs = _inputs(generator, dtype=torch.float32)
    module = LigerFusedLinearJSDLoss(weight_hard_loss=0.3, weight_soft_loss=0.6, beta=0.4,
                                     return_soft_hard_loss=return_terms)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    got = _run(torch.compile(module, backend=counter, fullgraph=True), inputs)
    assert counter.frame_count == 1
    want = _run(module, inputs)
    for g, w in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
