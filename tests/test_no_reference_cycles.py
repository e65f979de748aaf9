"""A call's autograd graph is freed by reference counting alone, the moment the last tensor of it goes: no
reference cycle through the autograd Function's context (ctx -> state -> the returned loss -> its grad_fn ->
ctx). Such a cycle keeps the graph, its saved tensors and the leaves' AccumulateGrad nodes alive until
Python's collector runs: memory held past the step, and a CUDA-graph capture of a later step fails on an
AccumulateGrad node bound to the stream of an earlier one (seen on an H200 with a JSD distillation call)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch
from distillation_helpers import make_pair
from policy_cases import full_options, policy_case

import flce


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _cycles_left_by(call: Callable[[], torch.Tensor]) -> list[str]:
    """The types of the objects that only the collector frees after one call whose loss is dropped (after a
    first call, which may fill caches)."""
    call()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        loss = call()
        del loss
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _cross_entropy(generator: torch.Generator, **options) -> Callable[[], torch.Tensor]:
    x = torch.randn(24, 16, generator=generator, requires_grad=True)
    w = torch.randn(96, 16, generator=generator, requires_grad=True)
    t = torch.randint(0, 96, (24,), generator=generator)
    return lambda: flce.linear_cross_entropy(x, w, t, **options)


def _distillation(generator: torch.Generator, **options) -> Callable[[], torch.Tensor]:
    pair = make_pair(generator, n=24, student_size=16, teacher_size=24, vocab=96, bias=True)
    return lambda: flce.linear_distillation_loss(
        pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight, pair.target,
        student_bias=pair.student_bias, teacher_bias=pair.teacher_bias, **options)


def _policy(generator: torch.Generator, level: str) -> Callable[[], torch.Tensor]:
    case = policy_case(generator, dtype=torch.float32)
    options = full_options("dapo", level)
    tensors = {k: v for k, v in case.tensors().items() if k != "bias"}
    return lambda: flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **tensors,
                                           **options).loss


CALLS = {
    "cross-entropy mean": lambda g: _cross_entropy(g),
    "cross-entropy none": lambda g: _cross_entropy(g, reduction="none"),
    "cross-entropy 64MiB": lambda g: _cross_entropy(g, memory_budget=64 << 20),
    "distillation jsd mean": lambda g: _distillation(g, loss="jsd", hard_label_weight=0.1),
    "distillation forward-kl none": lambda g: _distillation(g, loss="forward_kl", reduction="none"),
    "distillation reverse-kl sum": lambda g: _distillation(g, loss="reverse_kl", reduction="sum", temperature=2.0),
    "policy token": lambda g: _policy(g, "token"),
    "policy sequence": lambda g: _policy(g, "sequence"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_dropped_loss_frees_its_graph_without_the_collector(name: str, generator: torch.Generator,
                                                               collector_off: None) -> None:
    assert _cycles_left_by(CALLS[name](generator)) == []
