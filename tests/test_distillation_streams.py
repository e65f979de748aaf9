"""The teacher's logits GEMMs on a second stream (DistillChunks.teacher_beside): the schedule runs each chunk's teacher
GEMM inside the kernels' second stream and marks the teacher's buffer free only once nothing reads it any more, so the
next chunk's teacher GEMM may start beside this chunk's student gradient products but never while its logits (or,
where the teacher takes a gradient, that gradient) are still read; the numbers are those of the plan without it.

On the CPU a recording stand-in for the second stream checks the order (reference kernels, chunks of 3 rows); on a
GPU the CUDA backend's second stream runs the call, against the plan without it and under CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from distillation_helpers import NAMES, make_pair

import flce
from flce.autotune import override_params
from flce.backends.reference.distillation import ReferencePairKernels, plan_distillation
from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import prepare_pair
from flce.engine.distillation import schedule
from flce.engine.distillation.function import apply_eager
from flce.engine.plans import PlanRequest

STUDENT_H, TEACHER_H = 8, 12


class _Recorder:
    """A second stream that runs nothing elsewhere but writes down, in order, what the schedule asks of it."""

    def __init__(self, log: list) -> None:
        self.log, self.inside = log, False

    @contextlib.contextmanager
    def run(self):
        self.log.append(("run",))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def join(self, *tensors: torch.Tensor) -> None:
        self.log.append(("join",))

    def free(self) -> None:
        self.log.append(("free",))


class _RecordingKernels(ReferencePairKernels):
    """The reference pair kernels, each launch written to the log (the products by the head whose H they make)."""

    def __init__(self, log: list) -> None:
        self.log, self.beside = log, _Recorder(log)

    def second_stream(self, device: torch.device) -> _Recorder:
        return self.beside

    def pair_stats(self, *args, **kwargs):
        self.log.append(("pass", "pair_stats"))
        return super().pair_stats(*args, **kwargs)

    def mixture_sums(self, *args, **kwargs):
        self.log.append(("pass", "mixture_sums"))
        return super().mixture_sums(*args, **kwargs)

    def pair_grad_(self, *args, **kwargs):
        self.log.append(("pass", "pair_grad"))
        return super().pair_grad_(*args, **kwargs)

    def matmul_(self, a, b, out, accumulate) -> None:
        self.log.append(("product", "teacher" if out.shape[-1] == TEACHER_H else "student"))
        return super().matmul_(a, b, out, accumulate)


def _run(pair, cfg: DistillationConfig, kernels: ReferencePairKernels | None, beside: bool,
         log: list) -> tuple[torch.Tensor, ...]:
    leaves = pair.detached()
    flat = prepare_pair(leaves.student_hidden, leaves.student_weight, leaves.teacher_hidden, leaves.teacher_weight,
                        leaves.target, leaves.student_bias, leaves.teacher_bias, cfg)
    call = plan_distillation(flat, cfg, PlanRequest(training=True))
    call = dataclasses.replace(call, plan=dataclasses.replace(call.plan, tokens_per_chunk=3, teacher_beside=beside),
                               **({"kernels": kernels} if kernels is not None else {}))
    real_gemm = schedule.gemm_logits

    def gemm(hidden, weight, bias, out):
        head = "teacher" if weight.shape[1] == TEACHER_H else "student"
        log.append(("gemm", head, kernels is not None and kernels.beside.inside))
        return real_gemm(hidden, weight, bias, out)

    schedule.gemm_logits = gemm
    try:
        loss = apply_eager(flat, call)
        heads = leaves.leaves if cfg.teacher_grad else leaves.leaves[:3]
        wanted = [t for t in heads if t is not None and t.requires_grad]
        grads = torch.autograd.grad(loss.sum(), wanted)
    finally:
        schedule.gemm_logits = real_gemm
    return (loss.detach(), *grads)


def _check_order(log: list, teacher_grad: bool) -> None:
    """Each chunk: the teacher's GEMM on the second stream, the student's on the call's, the join before any pass
    reads them; the free after every reader of the teacher's buffer and, without the teacher's gradient, before the
    student's products (the overlap); the next teacher GEMM only after a free."""
    freed, joined, chunks = True, True, 0
    for entry in log:
        kind = entry[0]
        if kind == "run":
            assert freed, f"a teacher GEMM launched before the chunk before freed its buffer: {log}"
            freed, joined = False, False
            chunks += 1
        elif kind == "gemm":
            assert entry[2] == (entry[1] == "teacher"), f"{entry[1]}'s GEMM on the wrong stream: {log}"
        elif kind == "join":
            joined = True
        elif kind == "pass":
            assert joined and not freed, f"{entry[1]} outside join..free: {log}"
        elif kind == "free":
            freed = True
        elif kind == "product":
            if entry[1] == "teacher":
                assert not freed, f"the teacher's products after its buffer was freed: {log}"
            elif not teacher_grad:
                assert freed, f"the student's products before the teacher's buffer was freed (no overlap): {log}"
    assert chunks == 5 and freed


@pytest.mark.parametrize("loss", ["jsd", "forward_kl"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_teacher_gemm_on_the_second_stream_in_order(loss: str, reduction: str, teacher_grad: bool,
                                                    generator: torch.Generator) -> None:
    pair = make_pair(generator, n=13, student_size=STUDENT_H, teacher_size=TEACHER_H, bias=True)
    cfg = DistillationConfig(loss=loss, reduction=reduction, teacher_grad=teacher_grad, hard_label_weight=0.25)
    log: list = []
    beside = _run(pair, cfg, _RecordingKernels(log), True, log)
    plain = _run(pair, cfg, None, False, [])
    assert len(beside) == len(plain) == 1 + (6 if teacher_grad else 3)
    for got, expected in zip(beside, plain, strict=True):
        assert torch.equal(got, expected)
    gemms = [entry for entry in log if entry[0] == "gemm"]
    # forward's 5 chunks, and with reduction "none" backward's 5 again
    assert len(gemms) == 2 * 5 * (2 if reduction == "none" else 1)
    if reduction == "none":
        split = [i for i, entry in enumerate(log) if entry[0] == "run"][5]
        _check_order(log[:split], teacher_grad)
        _check_order(log[split:], teacher_grad)
    else:
        _check_order(log, teacher_grad)


# ---------------------------------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_grads(pair, streams: int, **options: object) -> tuple[torch.Tensor, ...]:
    leaves = pair.detached("cuda")
    with override_params({"logits_streams": streams, "tokens_per_chunk": 256}, backend="cuda"):
        loss = flce.linear_distillation_loss(leaves.student_hidden, leaves.student_weight, leaves.teacher_hidden,
                                             leaves.teacher_weight, leaves.target, backend="cuda", **options)
    grads = torch.autograd.grad(loss.sum(), (leaves.student_hidden, leaves.student_weight))
    return (loss.detach(), *grads)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"loss": "forward_kl"}, {"loss": "reverse_kl", "reduction": "none"}])
def test_cuda_second_stream_gives_the_same_bits(dtype: torch.dtype, options: dict,
                                                generator: torch.Generator) -> None:
    """On the GPU: the plan with the teacher's GEMMs on a second stream (the default) and with one stream give the
    same bits, over 5 chunks."""
    pair = make_pair(generator, n=1100, student_size=64, teacher_size=96, vocab=1000, dtype=dtype)
    record = flce.explain_distillation("cuda", shape=(1100, 64, 96, 1000), dtype=str(dtype).removeprefix("torch."),
                                       **options)
    assert record.plan.teacher_beside
    for got, expected in zip(_cuda_grads(pair, 2, **options), _cuda_grads(pair, 1, **options), strict=True):
        assert torch.equal(got, expected)


@gpu
def test_cuda_second_stream_under_graph_capture(generator: torch.Generator) -> None:
    """The forks and joins are stream waits on events: a call with the teacher's GEMMs beside captures into one CUDA
    graph, and replaying it on new inputs gives the eager call's numbers."""
    pair = make_pair(generator, n=1100, student_size=64, teacher_size=96, vocab=1000, dtype=torch.bfloat16,
                     teacher_requires_grad=False)
    leaves = pair.detached("cuda")
    names = [n for n in NAMES if getattr(leaves, n) is not None]

    def step() -> tuple[torch.Tensor, ...]:
        loss = flce.linear_distillation_loss(leaves.student_hidden, leaves.student_weight, leaves.teacher_hidden,
                                             leaves.teacher_weight, leaves.target, backend="cuda")
        return (loss.detach(), *torch.autograd.grad(loss, (leaves.student_hidden, leaves.student_weight)))

    with override_params({"tokens_per_chunk": 256}, backend="cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile and plan outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        fresh = make_pair(generator, n=1100, student_size=64, teacher_size=96, vocab=1000, dtype=torch.bfloat16)
        for name in names:
            getattr(leaves, name).data.copy_(getattr(fresh, name).detach())
        leaves.target.copy_(fresh.target)
        graph.replay()
        eager = step()
    for got, expected in zip(captured, eager, strict=True):
        assert torch.equal(got, expected)
