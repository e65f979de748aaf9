"""The policy loss under torch.compile and in CUDA graphs.

On the CPU: the forward op with a policy's tensors passes ``torch.library.opcheck``; a step that calls
flce.linear_policy_loss (functional or module form, token or sequence level, padded or packed) compiles with
``fullgraph=True`` into one graph whose loss, metrics and gradients equal eager flce's and the float64 oracle's;
the CUDA backend's kernels through the op under the Triton interpreter. On a GPU (marker ``cuda``, run by the
lead): Inductor, a captured CUDA graph replayed on new data, and mode="reduce-overhead".
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (torch._dynamo.testing imports it)

import torch._dynamo.testing
from policy_cases import LEVELS, PolicyCase, check_against_oracle, full_options, packed, policy_case

import flce
from flce.config import primitive_options
from flce.policy.api import policy_config
from flce.policy.options import PolicyOptions, policy_primitives

FP64 = dict(rtol=1e-9, atol=1e-11)
FIELDS = ("loss", "logprobs", "entropy", "mean_entropy", "mean_kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio")


def _run(fn, case: PolicyCase, options: dict) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    leaves = [t.detach().clone().requires_grad_() for t in case.leaves()]
    tensors = dict(case.tensors(), bias=leaves[2] if case.bias is not None else None)
    out = fn(leaves[0], leaves[1], case.target, case.advantages, tensors, options)
    grads = torch.autograd.grad(out.loss, leaves)
    return {name: getattr(out, name).detach() for name in FIELDS if getattr(out, name) is not None}, grads


def _functional(hidden, weight, target, advantages, tensors, options):
    return flce.linear_policy_loss(hidden, weight, target, advantages, **tensors, **options)


def _module_call(options: dict):
    items = options.get("num_items_in_batch")
    module = flce.get_policy_impl("cpu")(**{k: v for k, v in options.items() if k != "num_items_in_batch"})

    def call(hidden, weight, target, advantages, tensors, _options):
        return module(hidden, weight, target, advantages, **tensors, num_items_in_batch=items)

    return call


@pytest.mark.parametrize("form", ["functional", "module"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("level", LEVELS)
def test_compiled_step_matches_eager_and_the_oracle(form: str, layout: str, level: str,
                                                    generator: torch.Generator) -> None:
    case = policy_case(generator, bias=True)
    if layout == "packed":
        case = packed(case, generator)
    options = full_options("dapo", level, memory_budget=4 * 37 * 8)
    fn = _functional if form == "functional" else _module_call(options)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    got, got_grads = _run(compiled, case, options)
    want, want_grads = _run(fn, case, options)
    assert counter.frame_count == 1
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **FP64, msg=lambda m, name=name: f"{name}: {m}")
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **FP64)
    check_against_oracle(case, options, **FP64)  # eager against the oracle, as in test_policy_loss.py


def test_explain_shows_one_graph(generator: torch.Generator) -> None:
    case = policy_case(generator)

    def step(hidden, weight):
        out = flce.linear_policy_loss(hidden, weight, case.target, case.advantages, **case.tensors(),
                                      **full_options("grpo", "sequence"))
        return out.loss + out.clip_ratio

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(case.hidden, case.weight)
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_inductor_compiled_step_matches_eager(generator: torch.Generator) -> None:
    case = policy_case(generator).to(torch.float32)
    options = full_options("grpo", "sequence")
    torch._dynamo.reset()
    compiled = torch.compile(_functional, fullgraph=True)
    got, got_grads = _run(compiled, case, options)
    want, want_grads = _run(_functional, case, options)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_opcheck_forward_with_a_policy(level: str, generator: torch.Generator) -> None:
    """The forward op's schema, fake and autograd registrations with the policy's tensors and options."""
    from flce.policy.semantics import SequenceLayout, aggregation_weights, sequence_shares

    case = policy_case(generator).to(torch.float32)
    n = case.target.numel()
    hidden, target = case.hidden.detach().reshape(n, -1).requires_grad_(), case.target.reshape(-1)
    mask = (case.mask.reshape(-1) & (target != -100)).float()
    layout = SequenceLayout(None, case.target.shape[1])
    weights = aggregation_weights(mask, layout, "seq_mean_token_mean")
    shares = sequence_shares(mask, layout)
    tensors = (case.advantages[:, None].expand(case.target.shape).reshape(-1), weights,
               case.old_logprobs.reshape(-1), case.ref_logprobs.reshape(-1), case.rollout_is_ratio.reshape(-1),
               -0.01 * mask / mask.sum(), None, None, shares if level == "sequence" else None)
    options = PolicyOptions(level=level, ratio_low=0.8, ratio_high=1.28, delta=1.5, beta=0.04)
    cfg = policy_config(temperature=0.7)
    kwargs = dict(backend="reference", variant="full", group_name=None, grad_hidden=True, grad_weight=True,
                  grad_bias=False, **primitive_options(cfg), **policy_primitives(options),
                  policy_sequence_length=case.target.shape[1] if level == "sequence" else None)
    torch.library.opcheck(torch.ops.flce.chunked_forward.default,
                          (hidden, case.weight.detach().requires_grad_(), None, target, None, None, *tensors), kwargs)


@pytest.mark.triton
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_backend_through_the_op_under_the_interpreter(level: str, generator: torch.Generator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's kernels through the compiled op (interpreted on CPU tensors here; on a GPU machine
    they run for real): the same numbers as eager."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 16)
    case = policy_case(generator, vocab=40).to(torch.float32, device)
    options = full_options("dapo", level, backend="cuda", memory_budget=8 * 40 * 4)
    torch._dynamo.reset()
    compiled = torch.compile(_functional, backend="aot_eager", fullgraph=True)
    got, got_grads = _run(compiled, case, options)
    want, want_grads = _run(_functional, case, options)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _gpu_case(generator: torch.Generator, dtype: torch.dtype) -> PolicyCase:
    return policy_case(generator, batch=8, length=128, hidden_size=256, vocab=8192).to(dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("level", LEVELS)
def test_captured_policy_step_replays_with_new_data(level: str, generator: torch.Generator) -> None:
    """Forward + backward of the policy loss on the CUDA backend captured in one CUDA graph, replayed on new data
    copied into the static inputs: each replay equals an eager call on that data (no host synchronisation)."""
    options = full_options("dapo", level, backend="cuda", memory_budget=4 << 20)
    static = _gpu_case(generator, torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def step() -> flce.PolicyLossOutput:
        out = flce.linear_policy_loss(static.hidden, static.weight, static.target, static.advantages,
                                      **static.tensors(), **options)
        out.loss.backward()
        return out

    with torch.cuda.stream(side):
        for _ in range(2):
            static.hidden.grad = static.weight.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static.hidden.grad = static.weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out = step()
    for replay in range(3):
        fresh = _gpu_case(generator, torch.float32)
        with torch.no_grad():
            for name in ("hidden", "weight", "target", "advantages", "mask", "old_logprobs", "ref_logprobs",
                         "rollout_is_ratio"):
                getattr(static, name).copy_(getattr(fresh, name))
        graph.replay()
        torch.cuda.synchronize()
        want, (want_gx, want_gw) = _run(_functional, fresh, options)
        torch.testing.assert_close(static_out.loss.detach(), want["loss"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, r=replay: f"replay {r}: loss: {m}")
        torch.testing.assert_close(static.hidden.grad, want_gx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.weight.grad, want_gw, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("level", LEVELS)
def test_inductor_on_the_gpu_one_graph(level: str, generator: torch.Generator) -> None:
    """torch.compile (Inductor, fullgraph) of the bf16 policy step on the CUDA backend: one frame, the eager
    numbers (the same kernels; reduction order aside)."""
    case = _gpu_case(generator, torch.bfloat16)
    options = full_options("dapo", level, backend="cuda")
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_functional, backend=counter, fullgraph=True)
    got, got_grads = _run(compiled, case, options)
    want, want_grads = _run(_functional, case, options)
    assert counter.frame_count == 1
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-3, atol=1e-4)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g.double() - w.double()).norm() <= 1e-2 * w.double().norm()
