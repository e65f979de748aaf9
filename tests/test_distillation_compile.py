"""Linear distillation under torch.compile, and captured in CUDA graphs.

The custom ops ``flce::distill_forward`` / ``flce::distill_backward`` pass ``torch.library.opcheck``; a step
calling flce (module or functional form) compiles with ``fullgraph=True`` into one graph whose loss and
gradients equal eager flce's and the float64 oracle's. GPU-marked tests capture a training step in a CUDA
graph and replay it on new data, and compile one with ``mode="reduce-overhead"``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch._dynamo.testing
from distillation_helpers import NAMES, assert_matches_oracle, make_pair, relative

import flce
from flce.distillation.config import DistillationConfig, primitive_options

# 13 rows of 2 x 40 fp32 logits: chunks of a few rows (the multi-chunk paths).
SMALL_BUDGET = 1000

OPCHECK_CASES = {
    "jsd-mean-biases": ({"loss": "jsd", "hard_label_weight": 0.3}, True, True, (True,) * 6),
    "forward-kl-none-teacher": ({"loss": "forward_kl", "reduction": "none", "teacher_grad": True,
                                 "memory_budget": SMALL_BUDGET}, True, True, (True,) * 6),
    "reverse-kl-sum-no-target": ({"loss": "reverse_kl", "reduction": "sum", "temperature": 0.7}, False, False,
                                 (True, True, False, False, False, False)),
    "jsd-none-hidden-only": ({"loss": "jsd", "reduction": "none", "beta": 0.2}, True, False,
                             (True, False, False, False, False, False)),
    "no-grad": ({"loss": "jsd"}, True, False, (False,) * 6),
}


def _op_inputs(case: str, generator: torch.Generator):
    options, with_target, bias, _grads = OPCHECK_CASES[case]
    pair = make_pair(generator, bias=bias, target=with_target)
    tensors = tuple(None if t is None else t.detach() for t in pair.leaves)
    return (*tensors, pair.target), options


def _op_kwargs(case: str) -> dict:
    options, _target, bias, grads = OPCHECK_CASES[case]
    flags = dict(zip(("grad_student_hidden", "grad_student_weight", "grad_student_bias", "grad_teacher_hidden",
                      "grad_teacher_weight", "grad_teacher_bias"), grads, strict=True))
    if not bias:
        flags["grad_student_bias"] = flags["grad_teacher_bias"] = False
    return {"backend": "reference", "group_name": None, **flags,
            **primitive_options(DistillationConfig(**options))}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_forward(case: str, generator: torch.Generator) -> None:
    inputs, _ = _op_inputs(case, generator)
    torch.library.opcheck(torch.ops.flce.distill_forward.default, inputs, _op_kwargs(case))


@pytest.mark.parametrize("case", ["forward-kl-none-teacher", "jsd-none-hidden-only"])
def test_opcheck_backward(case: str, generator: torch.Generator) -> None:
    inputs, _ = _op_inputs(case, generator)
    kwargs = _op_kwargs(case)
    outputs = torch.ops.flce.distill_forward(*inputs, **kwargs)
    count, stats = outputs[1], outputs[8]
    assert stats.shape[1] == inputs[0].shape[0], "the deferred schedule must hand its row statistics to backward"
    grad_loss = torch.randn(outputs[0].shape, generator=generator)
    torch.library.opcheck(torch.ops.flce.distill_backward.default, (*inputs, count, stats, grad_loss), kwargs)


STEP_OPTIONS = {
    "jsd-mean": {"loss": "jsd", "beta": 0.3, "hard_label_weight": 0.2, "memory_budget": SMALL_BUDGET},
    "forward-kl-none-teacher": {"loss": "forward_kl", "reduction": "none", "temperature": 1.5, "teacher_grad": True,
                                "memory_budget": SMALL_BUDGET},
    "reverse-kl-sum": {"loss": "reverse_kl", "reduction": "sum", "hard_label_weight": 0.5},
}


def _step(form: str, options: dict, device: str = "cpu", backend: str | None = "reference"):
    if form == "module":
        module = flce.get_distillation_impl(device, backend=backend)(**options)

        def step(pair):
            return module(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight,
                          pair.target, student_bias=pair.student_bias, teacher_bias=pair.teacher_bias)
    else:
        def step(pair):
            return flce.linear_distillation_loss(
                pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight, pair.target,
                student_bias=pair.student_bias, teacher_bias=pair.teacher_bias, backend=backend, **options)
    return step


@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("case", sorted(STEP_OPTIONS))
def test_compiled_step_is_one_graph_and_matches_eager_and_oracle(form: str, case: str,
                                                                 generator: torch.Generator) -> None:
    options = STEP_OPTIONS[case]
    pair = make_pair(generator, bias=True)
    step = _step(form, options)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    assert_matches_oracle(pair, generator, run=lambda p, **_: compiled(p), **options)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    eager_pair, compiled_pair = pair.detached(), pair.detached()
    upstream = torch.rand(step(eager_pair).shape, generator=generator) + 0.5
    (step(eager_pair) * upstream).sum().backward()
    (compiled(compiled_pair) * upstream).sum().backward()
    for name in NAMES:
        a, b = getattr(eager_pair, name), getattr(compiled_pair, name)
        if a is not None and a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        elif a is not None:
            assert b.grad is None, f"{name}: a gradient in the compiled step only"


def test_compiled_call_refuses_targets_outside_the_vocabulary(generator: torch.Generator) -> None:
    """While torch.compile traces, the call cannot read the targets: its op checks them when it runs (CPU targets;
    an accelerator's are asserted on the device), as an eager call checks them before compute."""
    pair = make_pair(generator)
    pair.target[2] = pair.student_weight.shape[0] + 3
    torch._dynamo.reset()
    compiled = torch.compile(_step("functional", STEP_OPTIONS["jsd-mean"]), backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match="outside \\[0, 40\\)"):
        compiled(pair)


def test_inductor_step_matches_eager(generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True)
    step = _step("functional", STEP_OPTIONS["jsd-mean"])
    torch._dynamo.reset()
    assert_matches_oracle(pair, generator, run=lambda p, **_: torch.compile(step, fullgraph=True)(p),
                          **STEP_OPTIONS["jsd-mean"])


# --------------------------------------------------------------------------- CUDA graphs (GPU)

GRAPH_CASES = {
    "jsd-mean": {"loss": "jsd", "hard_label_weight": 0.1, "memory_budget": 4 << 20},
    "forward-kl-none": {"loss": "forward_kl", "reduction": "none", "temperature": 2.0, "memory_budget": 4 << 20},
}


def _cuda_pair(generator: torch.Generator, dtype: torch.dtype):
    return make_pair(generator, n=1024, student_size=256, teacher_size=384, vocab=8192, dtype=dtype,
                     ignore_fraction=0.1, scale=2.0).detached("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_step_captured_in_a_cuda_graph_replays_like_eager(case: str, dtype: torch.dtype,
                                                          generator: torch.Generator) -> None:
    options = GRAPH_CASES[case]
    static = _cuda_pair(generator, dtype)
    step = _step("functional", options, "cuda", backend=None)
    upstream = torch.rand(step(static).shape, generator=generator).cuda() + 0.5

    def train():
        for t in static.leaves:
            if t is not None:
                t.grad = None
        loss = step(static)
        (loss * upstream).sum().backward()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: kernels compiled, the allocator's pools settled
            train()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = train()
    fresh = _cuda_pair(generator, dtype)
    for mine, new in zip(static.leaves, fresh.leaves, strict=True):
        if mine is not None:
            with torch.no_grad():
                mine.copy_(new)
    static.target.copy_(fresh.target)
    graph.replay()
    eager_loss = step(fresh)
    (eager_loss * upstream).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative(captured_loss, eager_loss.detach()) < tolerance
    for name in ("student_hidden", "student_weight"):
        got, want = getattr(static, name).grad, getattr(fresh, name).grad
        assert relative(got, want) < tolerance, f"{name}: {relative(got, want):.2e}"


@pytest.mark.cuda
def test_reduce_overhead_compile_on_cuda(generator: torch.Generator) -> None:
    """torch.compile's own graph capture ("reduce-overhead") around the custom op, one graph, steps on new data."""
    options = {"loss": "jsd", "hard_label_weight": 0.2, "memory_budget": 4 << 20}
    module = flce.get_distillation_impl("cuda")(**options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        pair = _cuda_pair(generator, torch.float32)
        assert_matches_oracle(pair, generator, run=lambda p, **_: compiled(
            p.student_hidden, p.student_weight, p.teacher_hidden, p.teacher_weight, p.target), **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
