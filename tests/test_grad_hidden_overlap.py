"""A vocab-parallel call's grad_hidden reduction runs beside the last weight-gradient product: the schedule starts
it once grad_hidden's last rows exist, issues that product, and waits for it before returning grad_hidden
(engine.call.Sharding). One process, a stand-in reduction that records when it starts and when it is waited for
(and doubles grad_hidden, as two ranks with the same shard would), the reference backend's products recorded in
order. That the gradients of real ranks are unchanged: tests/test_distributed.py (gloo, 2 and 4 ranks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from helpers import make_inputs

import flce
from flce.config import LCEConfig
from flce.engine.call import Sharding
from flce.engine.function import apply_eager
from flce.engine.plans import PlanRequest
from flce.engine.schedule import planned_call
from flce.inputs import prepare_inputs
from flce.registry import registered_backends

TOKENS, HIDDEN, VOCAB = 40, 16, 96
BUDGET = 12 * VOCAB * 8  # a few rows a chunk: several chunks
CASES = {
    "in forward": {},
    "in forward, accurate": {"precision": "accurate"},
    "deferred (per-token losses)": {"reduction": "none"},
}


def _recorded_call(options: dict, dtype: torch.dtype, events: list[str]) -> tuple[Callable, torch.Tensor]:
    hidden, weight, target, _ = make_inputs((TOKENS,), HIDDEN, VOCAB, dtype=dtype,
                                            generator=torch.Generator().manual_seed(7))
    hidden.requires_grad_(), weight.requires_grad_()
    cfg = LCEConfig(memory_budget=BUDGET, **options)
    flat = prepare_inputs(hidden, weight, target, None, cfg)
    backend = next(b for b in registered_backends() if b.name == "reference")
    call = planned_call(backend, flat, cfg, "full", PlanRequest(training=True))
    assert call.plan.tokens_per_chunk < TOKENS, call.plan

    def start(grad_hidden: torch.Tensor) -> Callable[[], None]:
        events.append("reduce started")

        def wait() -> None:
            events.append("reduce waited")
            grad_hidden.mul_(2)

        return wait

    kernels = call.kernels
    matmul, accumulate = kernels.matmul_, kernels.accumulate_fp32_

    def product(b: torch.Tensor) -> str:
        return "hidden product" if b is flat.weight else "weight product"

    class Recorded(type(kernels)):
        def matmul_(self, a, b, out, accumulate_into) -> None:
            events.append(product(b))
            matmul(a, b, out, accumulate_into)

        def accumulate_fp32_(self, acc, a, b) -> None:
            events.append(product(b))
            accumulate(acc, a, b)

    sharding = Sharding(vocab_offset=0, global_vocab=VOCAB, combine=lambda partial: partial,
                        start_grad_hidden_reduce=start)
    sharded = replace(call, kernels=Recorded(), sharding=sharding)
    return (lambda: apply_eager(flat, sharded)), hidden


@pytest.mark.parametrize("case", list(CASES))
def test_reduction_starts_before_the_last_weight_product_and_is_waited_for_once(case: str) -> None:
    options = CASES[case]
    dtype = torch.bfloat16 if options.get("precision") == "accurate" else torch.float32
    events: list[str] = []
    run, hidden = _recorded_call(options, dtype, events)
    out = run()
    loss = out if isinstance(out, torch.Tensor) else out.loss
    (grad_hidden,) = torch.autograd.grad(loss.sum(), hidden)
    assert events.count("reduce started") == events.count("reduce waited") == 1, events
    started, waited = events.index("reduce started"), events.index("reduce waited")
    last_hidden = max(i for i, e in enumerate(events) if e == "hidden product")
    last_weight = max(i for i, e in enumerate(events) if e == "weight product")
    assert last_hidden < started < last_weight < waited, events
    # The wait completed grad_hidden before the call returned it: twice the unsharded one.
    plain = hidden.detach().clone().requires_grad_()
    want_loss = flce.linear_cross_entropy(plain, *_inputs_after(hidden), backend="reference", variant="full",
                                          memory_budget=BUDGET, **options)
    (want,) = torch.autograd.grad(want_loss.sum(), plain)
    torch.testing.assert_close(grad_hidden, 2 * want, rtol=0, atol=0)


def _inputs_after(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, weight, target, _ = make_inputs((TOKENS,), HIDDEN, VOCAB, dtype=hidden.dtype,
                                       generator=torch.Generator().manual_seed(7))
    return weight, target
