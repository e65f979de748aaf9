"""The policy loss under vocabulary (tensor) parallelism, on gloo ranks (tests/test_distributed.py's harness):
each rank holds its vocabulary shard of the LM head; the coefficients need only the all-reduced row statistics,
so the loss, the metrics and grad_hidden equal the unsharded call's on every rank and grad_weight is the rank's
rows of the full gradient. Token and sequence level, every loss type, the packed form, eager and compiled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from policy_cases import LEVELS, LOSS_TYPES, PolicyCase, full_options, packed, policy_case
from test_distributed import Checker, assert_section, run_ranks, seed_of, shard_rows

import flce

SIZES = {2: (17, 23)}  # uneven shards of V = 40
FP64 = dict(rtol=1e-10, atol=1e-12)


def _sharded_and_full(case: PolicyCase, options: dict[str, Any], rows: slice, group: Any,
                      call: Any = flce.linear_policy_loss) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(loss, metrics, grad_hidden, grad_weight shard, grad_bias shard) of the sharded call and of the full one."""
    results = []
    for shard, extra in ((rows, {"process_group": group}), (slice(None), {})):
        hidden = case.hidden.detach().clone().requires_grad_()
        weight = case.weight.detach()[shard].clone().requires_grad_()
        bias = case.bias.detach()[shard].clone().requires_grad_()
        tensors = dict(case.tensors(), bias=bias)
        out = call(hidden, weight, case.target, case.advantages, **tensors, **options, **extra)
        grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
        if shard == slice(None):
            grads = (grads[0], grads[1][rows], grads[2][rows])
        values = [out.loss, out.logprobs, out.entropy, out.mean_entropy, out.mean_kl, out.clip_ratio_low,
                  out.clip_ratio_high, out.clip_ratio]
        results.append([v.detach() for v in values if v is not None] + list(grads))
    return results[0], results[1]


def section_matches_unsharded(checker: Checker, rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    sizes = SIZES[world_size]
    rows = shard_rows(sizes, rank)
    for level in LEVELS:
        for loss_type in LOSS_TYPES:
            for form in ("padded", "packed"):
                if form == "packed" and loss_type not in ("grpo", "dapo"):
                    continue
                name = f"{loss_type} {level} {form}"
                gen = seed_of(name)
                case = policy_case(gen, vocab=sum(sizes), bias=True)
                if form == "packed":
                    case = packed(case, gen)
                with checker.case(name):
                    got, want = _sharded_and_full(case, full_options(loss_type, level), rows, group)
                    for mine, full in zip(got, want, strict=True):
                        torch.testing.assert_close(mine, full, **FP64)


def section_compiled(checker: Checker, rank: int, world_size: int) -> None:
    """torch.compile(fullgraph=True) of the vocab-parallel policy loss: the group travels into the custom op by
    name; the same numbers as the eager sharded call."""
    group = dist.group.WORLD
    sizes = SIZES[world_size]
    rows = shard_rows(sizes, rank)
    for level in LEVELS:
        name = f"compiled {level}"
        case = policy_case(seed_of(name), vocab=sum(sizes), bias=True)
        options = full_options("dapo", level)
        torch._dynamo.reset()
        compiled = torch.compile(flce.linear_policy_loss, backend="aot_eager", fullgraph=True)
        with checker.case(name):
            got, _ = _sharded_and_full(case, options, rows, group, call=compiled)
            want, _ = _sharded_and_full(case, options, rows, group)
            for mine, eager in zip(got, want, strict=True):
                torch.testing.assert_close(mine, eager, **FP64)


SECTIONS = {"2": {"matches_unsharded": section_matches_unsharded, "compiled": section_compiled}}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(2, Path(tmp_path_factory.mktemp("policy_tp")), sections_module=__name__, sections_key="2")


@pytest.mark.distributed
@pytest.mark.parametrize("section", ["matches_unsharded", "compiled"])
def test_vocab_parallel_policy_loss(reports: list[dict[str, dict]], section: str) -> None:
    assert_section(reports, section)
