"""Vocab-parallel linear distillation over gloo on the CPU, 2 ranks, even and uneven shards.

Every rank builds the same full inputs from the same seed, keeps its vocabulary shard of both heads'
weights and biases and calls flce with ``process_group``: the loss, the student's (and, where asked, the
teacher's) grad_hidden, and the rank's slice of each grad_weight / grad_bias must equal the float64 oracle;
each chunk's statistics travel in one all-reduce (JSD's second pass in a second one), and a compiled
sharded step is one graph. One spawn runs every case (tests/test_distributed.py's harness); a second, in fresh
interpreters under TRITON_INTERPRET=1, runs cases on the CUDA backend's pair kernels.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distillation_helpers import NAMES, Pair, flce_loss, gradients, make_pair, oracle, relative
from helpers import skip_unless_interpreter_runs
from test_distributed import Checker, assert_section, run_ranks, seed_of, shard_rows

import flce
from flce.autotune import override_params
from flce.distributed import record_collectives
from flce.testing.distillation import reference_student_entropy

pytestmark = pytest.mark.distributed

LAYOUTS = {"even": (20, 20), "uneven": (9, 31)}
CASES: dict[str, dict[str, Any]] = {
    "jsd-mean": {"loss": "jsd", "beta": 0.3},
    "jsd-hard-teacher-none": {"loss": "jsd", "hard_label_weight": 0.4, "temperature": 0.8, "teacher_grad": True,
                              "reduction": "none"},
    "forward-kl-sum-hard": {"loss": "forward_kl", "reduction": "sum", "hard_label_weight": 0.25, "temperature": 1.7},
    "forward-kl-mean-hard-t1": {"loss": "forward_kl", "hard_label_weight": 0.25},
    "reverse-kl-mean-teacher-chunks": {"loss": "reverse_kl", "teacher_grad": True, "memory_budget": 700},
    "reverse-kl-no-target": {"loss": "reverse_kl", "reduction": "none", "target": False},
    # the student's entropy: its sum merged across the shards in the statistics' one all-reduce
    "jsd-entropy": {"loss": "jsd", "temperature": 0.8, "return_entropy": True},
    "reverse-kl-entropy-none-chunks": {"loss": "reverse_kl", "reduction": "none", "return_entropy": True,
                                       "memory_budget": 700},
}


def _shard(pair: Pair, rows: slice) -> Pair:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach()[rows].clone().requires_grad_(t.requires_grad)

    return Pair(pair.student_hidden.detach().clone().requires_grad_(), part(pair.student_weight),
                part(pair.student_bias), pair.teacher_hidden.detach().clone().requires_grad_(),
                part(pair.teacher_weight), part(pair.teacher_bias), pair.target)


def _check_case(checker: Checker, name: str, layout: str, rank: int, group: Any, backend: str = "reference",
                forward_exchanges: int | None = None) -> None:
    """``forward_exchanges``: the all-reduces of forward's statistics (default: one, and JSD's second pass)."""
    options = dict(CASES[name])
    with_target = options.pop("target", True)
    with_entropy = options.pop("return_entropy", False)
    sizes = LAYOUTS[layout]
    gen = seed_of(f"{name}/{layout}")
    pair = make_pair(gen, n=11, vocab=sum(sizes), bias=True, target=with_target)
    rows = shard_rows(sizes, rank)
    mine = _shard(pair, rows)
    with checker.case(f"{name} {layout} {backend}"), record_collectives() as records:
        got = flce.linear_distillation_loss(
            mine.student_hidden, mine.student_weight, mine.teacher_hidden, mine.teacher_weight, mine.target,
            student_bias=mine.student_bias, teacher_bias=mine.teacher_bias, process_group=group, backend=backend,
            return_entropy=with_entropy, **options)
        if with_entropy:
            got, entropy = got
            want_entropy = reference_student_entropy(pair.student_hidden, pair.student_weight, pair.target,
                                                     temperature=options.get("temperature", 1.0),
                                                     student_bias=pair.student_bias)
            error = relative(entropy, want_entropy)
            assert error <= 1e-5, f"entropy: relative error {error:.2e}"
        expected = oracle(pair, **options)
        assert relative(got, expected) <= 1e-5, f"loss: relative error {relative(got, expected):.2e}"
        upstream = torch.rand(expected.shape, generator=gen, dtype=torch.float64) + 0.5
        got_grads = gradients(got, upstream, mine)
        want = gradients(expected, upstream, pair)
        for field, g, w in zip(NAMES, got_grads, want, strict=True):
            if getattr(pair, field) is None:
                continue
            if field.startswith("teacher") and not options.get("teacher_grad"):
                assert g is None, f"{field}: a gradient without teacher_grad"
                continue
            w = w[rows] if field.endswith(("weight", "bias")) else w
            assert relative(g, w) <= 1e-4, f"{field}: relative error {relative(g, w):.2e}"
        if "memory_budget" not in options:
            # One chunk: one all-reduce of both softmaxes' statistics (and JSD's second-pass sums), then one of
            # each grad_hidden in backward.
            summed = [r for r in records if r.kind == "all_reduce(SUM)"]
            passes = forward_exchanges or (2 if options["loss"] == "jsd" else 1)
            assert len(summed) == passes + 1 + bool(options.get("teacher_grad")), [(r.kind, r.numel) for r in records]
            assert all(r.kind in ("all_reduce(SUM)", "all_gather") for r in records), records

def _section(checker: Checker, rank: int, world_size: int) -> None:
    group = torch.distributed.group.WORLD
    for name in CASES:
        for layout in LAYOUTS:
            _check_case(checker, name, layout, rank, group)


def _single_rank_group(checker: Checker, rank: int, world_size: int) -> None:
    """A group of one rank is the unsharded call: the same loss and gradients bitwise, and an empty vocabulary
    refused before compute as it is without a group."""
    groups = [torch.distributed.new_group([r]) for r in range(world_size)]  # every rank creates every group
    options = {"loss": "jsd", "hard_label_weight": 0.3, "temperature": 1.4, "backend": "reference"}
    pair = make_pair(seed_of("single-rank group"), n=7, vocab=24, bias=True)
    alone = pair.detached()
    with checker.case("single-rank group: the unsharded call"):
        got = flce_loss(pair, process_group=groups[rank], **options)
        want = flce_loss(alone, **options)
        got.backward()
        want.backward()
        assert torch.equal(got, want)
        for name in NAMES[:3]:
            assert torch.equal(getattr(pair, name).grad, getattr(alone, name).grad), name
    empty = make_pair(seed_of("single-rank group, no classes"), vocab=0, target=False)
    with checker.case("single-rank group: an empty vocabulary refused"):
        with pytest.raises(ValueError, match="student_weight: has no classes"):
            flce_loss(empty, process_group=groups[rank], backend="reference")


def _batched_refused(checker: Checker, rank: int, world_size: int) -> None:
    """Batched gradients of a sharded call are refused with a reason: its backward all-reduces grad_hidden in place,
    and the collectives have no batching rule (the unsharded call's: test_distillation_autograd.py)."""
    sizes = LAYOUTS["even"]
    pair = make_pair(seed_of("batched gradients"), n=5, vocab=sum(sizes))
    mine = _shard(pair, shard_rows(sizes, rank))
    for reduction in ("mean", "none"):  # gradients in forward, deferred
        with checker.case(f"batched gradients are refused ({reduction})"):
            loss = flce_loss(mine, process_group=torch.distributed.group.WORLD, reduction=reduction,
                             backend="reference")
            with pytest.raises(RuntimeError, match="vocab-parallel call are not supported"):
                torch.autograd.grad(loss, mine.student_hidden, torch.ones(2, *loss.shape), is_grads_batched=True)


def _dtensor_heads(checker: Checker, rank: int, world_size: int) -> None:
    """Weights as training frameworks hold them: both heads' weights and biases vocabulary-sharded DTensors (tensor
    parallelism) or replicated ones, and FSDP2-sharded heads used outside their forward. The loss and the student's
    gradients equal the float64 oracle's, each weight's gradient in the weight's own placements (FSDP2's: the mean
    over the data-parallel ranks, as FSDP2 reduces it); the teacher takes none."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    options = {"loss": "jsd", "hard_label_weight": 0.3, "temperature": 1.3, "backend": "reference"}
    for placement in (Shard(0), Replicate()):
        with checker.case(f"both heads {placement}"):
            pair = make_pair(seed_of(f"dtensor heads {placement}"), n=11, vocab=31, bias=True)  # alike on every rank

            def as_dtensor(t: torch.Tensor, grad: bool, placement=placement) -> torch.nn.Parameter:
                return torch.nn.Parameter(distribute_tensor(t.detach(), mesh, [placement]), requires_grad=grad)

            weight, bias = as_dtensor(pair.student_weight, True), as_dtensor(pair.student_bias, True)
            teacher_weight, teacher_bias = as_dtensor(pair.teacher_weight, False), as_dtensor(pair.teacher_bias, False)
            hidden = pair.student_hidden.detach().clone().requires_grad_()
            got = flce.linear_distillation_loss(hidden, weight, pair.teacher_hidden.detach(), teacher_weight,
                                                pair.target, student_bias=bias, teacher_bias=teacher_bias, **options)
            got.backward()
            want = oracle(pair, **options)
            want.backward()
            assert relative(got, want) <= 1e-5, f"loss {got.item()} != {want.item()}"
            assert relative(hidden.grad, pair.student_hidden.grad) <= 1e-4
            for name, param, leaf in (("weight", weight, pair.student_weight), ("bias", bias, pair.student_bias)):
                assert isinstance(param.grad, DTensor) and param.grad.placements == (placement,), f"{name}.grad"
                assert relative(param.grad.full_tensor(), leaf.grad) <= 1e-4, name
    with checker.case("FSDP2-sharded heads outside their forward"):
        dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        heads = make_pair(seed_of("fsdp2 heads"), n=1, vocab=21, bias=True)  # the heads, alike on every rank

        def fsdp2_head(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
            module = torch.nn.Linear(weight.shape[1], weight.shape[0])
            with torch.no_grad():
                module.weight.copy_(weight)
                module.bias.copy_(bias)
            fully_shard(module, mesh=dp)
            return module

        student_head = fsdp2_head(heads.student_weight.detach(), heads.student_bias.detach())
        teacher_head = fsdp2_head(heads.teacher_weight.detach(), heads.teacher_bias.detach())
        assert isinstance(student_head.weight, DTensor), "test setup: the weight is not sharded"

        def rank_case(r: int) -> Pair:  # each rank its own tokens
            tokens = make_pair(seed_of(f"fsdp2 tokens {r}"), n=9, vocab=21)
            return Pair(tokens.student_hidden.detach(), *(t.detach().clone().requires_grad_() for t in
                                                          (heads.student_weight, heads.student_bias)),
                        tokens.teacher_hidden.detach(), heads.teacher_weight.detach(), heads.teacher_bias.detach(),
                        tokens.target)

        mine = rank_case(rank)
        got = flce.linear_distillation_loss(mine.student_hidden, student_head.weight, mine.teacher_hidden,
                                            teacher_head.weight, mine.target, student_bias=student_head.bias,
                                            teacher_bias=teacher_head.bias, **options)
        got.backward()
        cases = [rank_case(r) for r in range(world_size)]
        for case in cases:
            oracle(case, **options).backward()
        assert relative(got, oracle(mine, **options)) <= 1e-5
        for name in ("weight", "bias"):
            param = getattr(student_head, name)
            mean = sum(getattr(case, f"student_{name}").grad for case in cases) / world_size
            assert isinstance(param.grad, DTensor) and param.grad.placements == (Shard(0),), f"{name}.grad"
            assert relative(param.grad.full_tensor(), mean) <= 1e-4, name
        assert teacher_head.weight.grad is None and teacher_head.bias.grad is None, "the teacher took a gradient"
    pair = make_pair(seed_of("dtensor errors"), n=5, vocab=20)
    sharded = distribute_tensor(pair.student_weight.detach(), mesh, [Shard(0)])
    with checker.case("heads sharded differently are refused"):
        with pytest.raises(ValueError, match="student_weight: ranks .* teacher_weight: not vocabulary-sharded"):
            flce.linear_distillation_loss(pair.student_hidden, sharded, pair.teacher_hidden, pair.teacher_weight,
                                          pair.target, backend="reference")
    with checker.case("a DTensor head with process_group is refused, naming the head"):
        with pytest.raises(ValueError, match="the teacher's head .*pass process_group=None"):
            teacher = distribute_tensor(pair.teacher_weight.detach(), mesh, [Shard(0)])
            flce.linear_distillation_loss(pair.student_hidden, pair.student_weight, pair.teacher_hidden, teacher,
                                          pair.target, process_group=torch.distributed.group.WORLD,
                                          backend="reference")


def _cuda_interpreted(checker: Checker, rank: int, world_size: int) -> None:
    """The CUDA backend's pair kernels (their vocab_offset, one kernel a pass) in the Triton interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "test setup: the ranks must start with TRITON_INTERPRET=1"
    group = torch.distributed.group.WORLD
    for name, layout in (("jsd-hard-teacher-none", "uneven"), ("forward-kl-sum-hard", "even"),
                         ("reverse-kl-mean-teacher-chunks", "uneven"), ("reverse-kl-entropy-none-chunks", "even")):
        _check_case(checker, name, layout, rank, group, backend="cuda")
    # Each shard's statistics from its logits GEMMs' epilogue (the Triton statistics GEMM), combined as the pair
    # kernel's are.
    with override_params({"forward_logits": "fused", "logits_kernel": "triton"}, backend="cuda"):
        with checker.case("jsd: a shard's statistics from its logits GEMMs"):
            record = flce.explain_distillation("cpu", backend="cuda", shape=(11, 8, 12, 31), dtype="float32",
                                               sharded=True, loss="jsd")
            assert record.plan.stats_in_gemm and not record.plan.fused_passes
        _check_case(checker, "jsd-mean", "uneven", rank, group, backend="cuda")
        _check_case(checker, "jsd-entropy", "uneven", rank, group, backend="cuda")
        # forward KL's E_p[t - s] from the gradient's sweep, each shard's part summed in a second all-reduce
        with checker.case("forward_kl: a shard's statistics from its logits GEMMs"):
            record = flce.explain_distillation("cpu", backend="cuda", shape=(11, 8, 12, 31), dtype="float32",
                                               sharded=True, **CASES["forward-kl-mean-hard-t1"])
            assert record.plan.stats_in_gemm and not record.plan.fused_passes
            assert "E_p[t - s]" in str(record) and "_pair_stats_kernel" not in str(record)
        _check_case(checker, "forward-kl-mean-hard-t1", "uneven", rank, group, backend="cuda", forward_exchanges=2)
        # reverse KL's E_q[s - t] from each shard's student GEMM, which reads that shard's teacher logits
        with checker.case("reverse_kl: a shard's statistics from its logits GEMMs"):
            record = flce.explain_distillation("cpu", backend="cuda", shape=(11, 8, 12, 31), dtype="float32",
                                               sharded=True, **CASES["reverse-kl-mean-teacher-chunks"])
            assert record.plan.stats_in_gemm and not record.plan.fused_passes
            assert "E_q[s - t], its epilogue reading the teacher's logits" in str(record)
            assert "_pair_stats_kernel" not in str(record)
        _check_case(checker, "reverse-kl-mean-teacher-chunks", "uneven", rank, group, backend="cuda")


def _compiled(checker: Checker, rank: int, world_size: int) -> None:
    import torch._dynamo.testing

    group = torch.distributed.group.WORLD
    sizes = LAYOUTS["uneven"]
    gen = seed_of("compiled")
    pair = make_pair(gen, n=11, vocab=sum(sizes), bias=False)
    mine = _shard(pair, shard_rows(sizes, rank))
    options = {"loss": "jsd", "hard_label_weight": 0.3}

    def step(xs, ws, xt, wt, target):
        return flce.linear_distillation_loss(xs, ws, xt, wt, target, process_group=group, backend="reference",
                                             **options)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with checker.case("compiled sharded step"):
        got = compiled(mine.student_hidden, mine.student_weight, mine.teacher_hidden, mine.teacher_weight, mine.target)
        got.backward()
        expected = oracle(pair, **options)
        expected.backward()
        assert counter.frame_count == 1, f"{counter.frame_count} graphs"
        assert relative(got, expected) <= 1e-5
        assert relative(mine.student_hidden.grad, pair.student_hidden.grad) <= 1e-4
        assert relative(mine.student_weight.grad, pair.student_weight.grad[shard_rows(sizes, rank)]) <= 1e-4
    _compiled_dtensor_and_single_rank(checker, rank, world_size, options)


def _compiled_dtensor_and_single_rank(checker: Checker, rank: int, world_size: int, options: dict) -> None:
    """A compiled step whose heads are vocabulary-sharded DTensors, and one over a group of one rank (the unsharded
    call, whose target check waits for the op to run): one graph each, the oracle's loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    groups = [torch.distributed.new_group([r]) for r in range(world_size)]  # every rank creates every group
    pair = make_pair(seed_of("compiled dtensor"), n=11, vocab=31, bias=False)
    for case, group in (("compiled DTensor heads", None), ("compiled single-rank group", groups[rank])):
        with checker.case(case):
            if group is None:
                weight = torch.nn.Parameter(distribute_tensor(pair.student_weight.detach(), mesh, [Shard(0)]))
                teacher_weight = distribute_tensor(pair.teacher_weight.detach(), mesh, [Shard(0)])
            else:
                weight = pair.student_weight.detach().clone().requires_grad_()
                teacher_weight = pair.teacher_weight.detach()
            hidden = pair.student_hidden.detach().clone().requires_grad_()

            def step(xs, ws, xt, wt, target, group=group):
                return flce.linear_distillation_loss(xs, ws, xt, wt, target, process_group=group, backend="reference",
                                                     **options)

            torch._dynamo.reset()
            counter = torch._dynamo.testing.CompileCounter()
            got = torch.compile(step, backend=counter, fullgraph=True)(hidden, weight, pair.teacher_hidden.detach(),
                                                                       teacher_weight, pair.target)
            got.backward()
            want = oracle(pair, **options)
            want.backward()
            assert counter.frame_count == 1, f"{counter.frame_count} graphs"
            assert relative(got, want) <= 1e-5
            assert relative(hidden.grad, pair.student_hidden.grad) <= 1e-4
            grad = weight.grad.full_tensor() if isinstance(weight.grad, DTensor) else weight.grad
            assert relative(grad, pair.student_weight.grad) <= 1e-4
            pair.student_hidden.grad = pair.student_weight.grad = None


SECTIONS = {"2": {"cases": _section, "compiled": _compiled, "single_rank_group": _single_rank_group,
                  "batched_refused": _batched_refused, "dtensor_heads": _dtensor_heads},
            "2-interpreted": {"cuda_interpreted": _cuda_interpreted}}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(2, tmp_path_factory.mktemp("distill-gloo"), sections_module=__name__, sections_key="2")


@pytest.mark.parametrize("section", sorted(SECTIONS["2"]))
def test_two_ranks(section: str, reports: list[dict[str, dict]]) -> None:
    assert_section(reports, section)


@pytest.mark.triton
def test_two_ranks_cuda_kernels_interpreted(tmp_path: Path) -> None:
    skip_unless_interpreter_runs()
    reports = run_ranks(2, tmp_path, sections_module=__name__, sections_key="2-interpreted",
                        fresh_env={"TRITON_INTERPRET": "1"})
    assert_section(reports, "cuda_interpreted")
