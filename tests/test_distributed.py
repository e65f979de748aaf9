"""Vocab-parallel flce over gloo on the CPU: 2 and 4 ranks, even and uneven shards.

Every rank builds the same full inputs from the same seed, keeps its vocabulary shard of
weight/bias and calls flce with ``process_group``; the outputs, grad_hidden and the rank's
slice of grad_weight/grad_bias must equal both the unsharded flce op and the float64
materialised oracle (tests/helpers.py). One spawn per world size runs every case; each
pytest test below asserts one section of what the ranks reported, so a failure names its
section and cases without paying for another spawn.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import json
import multiprocessing
import os
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    Upstream,
    assert_close_per_design,
    backward_surrogate,
    flce_grads,
    make_inputs,
    random_class_weight,
    random_upstream,
    reference_grads,
    relative_error,
    skip_unless_interpreter_runs,
)

import flce
from flce.config import LCEConfig
from flce.distributed import (
    DISTRIBUTED_CHECKS_ENV,
    clear_cache,
    payload_bytes_per_step,
    record_collectives,
    token_sharded_mean,
)
from flce.distributed.collectives import key_to_float, order_preserving_key, pack_max_argmax, unpack_max_argmax

SPAWN_TIMEOUT_S = 240
# Imported by the forkserver before it forks the ranks (the registry's built-in backends).
PRELOAD = ("flce.backends.reference", "flce.backends.cuda")
REDUCTIONS = ("mean", "sum", "none")
ALL_EXTRAS = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
                  return_logprobs=True, return_entropy=True)
FULL = dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=4.0, temperature=0.7, token_scaling=True,
            **ALL_EXTRAS)
OPTION_SETS: dict[str, dict[str, Any]] = {
    "plain": {},
    "full+class_weight": dict(FULL, class_weight=True),
    "smoothing+metrics": dict(label_smoothing=0.2, return_token_accuracy=True, return_predicted_tokens=True),
    "entropy+ignore_index=3": dict(return_entropy=True, ignore_index=3),
    "entropy_weight": dict(entropy_weight=0.05, temperature=0.7),
    "detached-extras": dict(entropy_weight=0.05, temperature=0.7, return_logprobs=True, return_entropy=True,
                            detach_extras=True),
}
LAYOUTS = {2: {"even": (16, 16), "uneven": (7, 18)}, 4: {"even": (8, 8, 8, 8), "uneven": (5, 1, 9, 4)}}


# --------------------------------------------------------------------------- the harness

def _rank_main(rank: int, world_size: int, store_dir: str, sections_module: str, sections_key: str) -> None:
    sections = importlib.import_module(sections_module).SECTIONS[sections_key]
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    report: dict[str, dict] = {}
    try:
        for section, run in sections.items():
            checker = Checker()
            try:
                run(checker, rank, world_size)
            except Exception:  # an unexpected error ends the section, not the other sections
                checker.failures.append(f"section aborted:\n{traceback.format_exc()}")
            report[section] = {"checked": checker.checked, "failures": checker.failures}
            dist.barrier()
    finally:
        Path(store_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def run_ranks(world_size: int, tmp_path: Path, sections_module: str = __name__, sections_key: str | None = None,
              preload: tuple[str, ...] = PRELOAD, fresh_env: dict[str, str] | None = None) -> list[dict[str, dict]]:
    """Run ``sections_module.SECTIONS[sections_key or str(world_size)]`` on ``world_size`` gloo ranks;
    returns every rank's report.

    A forkserver imports torch and flce once and forks every rank from there: importing them
    in each rank costs more than all the checks together on a 2-core CI machine. ``fresh_env``
    instead spawns fresh interpreters with those variables set from their first import (for
    TRITON_INTERPRET, which triton reads when it is imported).
    """
    args = (world_size, str(tmp_path), sections_module, sections_key or str(world_size))
    if fresh_env is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__, sections_module, *preload])
        context = mp.start_processes(_rank_main, args=args, nprocs=world_size, join=False, start_method="forkserver")
    else:
        saved = {name: os.environ.get(name) for name in fresh_env}
        os.environ.update(fresh_env)
        try:
            context = mp.start_processes(_rank_main, args=args, nprocs=world_size, join=False, start_method="spawn")
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{world_size} gloo ranks did not finish in {SPAWN_TIMEOUT_S} s")
    except mp.ProcessExitedException as exited:
        # gloo can abort a rank inside destroy_process_group ("terminate called without an active exception",
        # SIGABRT; once in CI), which comes after the rank's last barrier and its report: with every report
        # written, every check ran and the reports decide. A rank that died before writing its report fails here.
        if any(not Path(tmp_path, f"rank{r}.json").exists() for r in range(world_size)):
            raise
        warnings.warn(f"a gloo rank died in its teardown, after its checks ({exited})", stacklevel=1)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, dict]]]:
    """world_size -> every rank's report; each world size is spawned once per module."""
    done: dict[int, list[dict[str, dict]]] = {}

    def get(world_size: int) -> list[dict[str, dict]]:
        if world_size not in done:
            done[world_size] = run_ranks(world_size, tmp_path_factory.mktemp(f"gloo{world_size}"))
        return done[world_size]

    return get


def assert_section(reports: list[dict[str, dict]], section: str) -> None:
    failures = [f"rank {r}: {f}" for r, report in enumerate(reports) for f in report[section]["failures"]]
    assert not failures, f"{len(failures)} failed checks in {section}:\n" + "\n".join(failures)
    for r, report in enumerate(reports):
        assert report[section]["checked"] > 0, f"rank {r} checked nothing in {section}"


@dataclass
class Checker:
    """Runs named checks, keeping going after a failure so one report lists them all."""

    checked: int = 0
    failures: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        self.checked += 1
        try:
            yield
        except AssertionError as exc:
            self.failures.append(f"{name}: {exc}")


def seed_of(name: str) -> torch.Generator:
    base = int(os.environ.get("FLCE_TEST_SEED", "0"))
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * base)


def shard_rows(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def sharded_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                 group: Any, options: dict[str, Any], backend: str | None = None) -> torch.Tensor | flce.LCEOutput:
    """flce with process_group (a class_weight is the global [V] vector)."""
    return flce.linear_cross_entropy(hidden, weight, target, bias, process_group=group, backend=backend, **options)


# --------------------------------------------------------------------------- one equality case

@dataclass(frozen=True)
class Case:
    name: str
    sizes: tuple[int, ...]
    options: dict[str, Any]
    dtype: torch.dtype = torch.float32
    bias: bool = False
    token_shape: tuple[int, ...] = (3, 5)
    hidden_size: int = 16
    ignore_fraction: float = 0.2
    backend: str | None = None  # the sharded call's; the unsharded comparison uses the default


def check_case(checker: Checker, case: Case, rank: int, group: Any) -> None:
    """Sharded outputs and grads vs the unsharded flce op and the float64 oracle."""
    gen = seed_of(case.name)
    vocab = sum(case.sizes)
    options = dict(case.options)
    ignore_index = options.get("ignore_index", -100)
    hidden, weight, target, bias = make_inputs(
        case.token_shape, case.hidden_size, vocab, dtype=case.dtype, bias=case.bias,
        ignore_fraction=case.ignore_fraction, ignore_index=ignore_index, generator=gen,
    )
    if options.get("class_weight") is True:
        options["class_weight"] = random_class_weight(vocab, gen)
    reduction = options.get("reduction", "mean")
    loss_shape = target.shape if reduction == "none" else torch.Size()
    # Upstream gradients reach the differentiable outputs only (detach_extras=True returns the extras detached).
    differentiable_extras = not options.get("detach_extras")
    upstream = random_upstream(loss_shape, target.shape,
                               logprobs=differentiable_extras and bool(options.get("return_logprobs")),
                               entropy=differentiable_extras and bool(options.get("return_entropy")), generator=gen)
    rows = shard_rows(case.sizes, rank)
    w_shard = weight[rows]
    b_shard = None if bias is None else bias[rows]

    with checker.case(case.name):
        got, got_grads = flce_grads(lambda h, w, t, b: sharded_loss(h, w, t, b, group, options, case.backend),
                                    hidden, w_shard, target, b_shard, upstream)
        unsharded, full_grads = flce_grads(lambda h, w, t, b: flce.linear_cross_entropy(h, w, t, b, **options),
                                           hidden, weight, target, bias, upstream)
        oracle, oracle_grads = reference_grads(hidden, weight, target, bias, upstream, **options)
        got_out = got if isinstance(got, flce.LCEOutput) else flce.LCEOutput(loss=got)
        flce_out = unsharded if isinstance(unsharded, flce.LCEOutput) else flce.LCEOutput(loss=unsharded)
        if not differentiable_extras:
            assert not (got_out.logprobs.requires_grad or got_out.entropy.requires_grad), "extras not detached"
        kind = "forward" if options.get("temperature", 1.0) == 1.0 else "temperature"
        for name in flce.LCEOutput._fields:
            value = getattr(got_out, name)
            assert (value is None) == (getattr(flce_out, name) is None), f"{name}: present/absent differs"
            if value is None:
                continue
            if name == "predicted_tokens":
                assert torch.equal(value, flce_out.predicted_tokens), "predicted_tokens differ from unsharded"
                assert torch.equal(value, oracle.predicted_tokens), "predicted_tokens differ from the oracle"
                continue
            assert_close_per_design(value, getattr(flce_out, name).double(), kind=kind, dtype=case.dtype,
                                    name=f"{name} vs unsharded flce")
            assert_close_per_design(value, getattr(oracle, name), kind=kind, dtype=case.dtype,
                                    name=f"{name} vs oracle")
        _check_grads(case, got_grads, full_grads, oracle_grads, rows)
        with torch.no_grad():
            inferred = sharded_loss(hidden, w_shard, target, b_shard, group, options, case.backend)
        inferred = inferred if isinstance(inferred, flce.LCEOutput) else flce.LCEOutput(loss=inferred)
        for name, value in zip(flce.LCEOutput._fields, inferred, strict=True):
            expected = getattr(got_out, name)
            assert (value is None) == (expected is None), f"no_grad: {name} present/absent differs"
            if value is not None:
                torch.testing.assert_close(value, expected.detach(), rtol=1e-6, atol=1e-7,
                                           msg=lambda m, n=name: f"no_grad {n} vs grad mode: {m}")


def _check_grads(case: Case, got: Any, unsharded: Any, oracle: Any, rows: slice) -> None:
    pairs = [("grad_hidden", got.hidden, unsharded.hidden, oracle.hidden),
             ("grad_weight shard", got.weight, unsharded.weight[rows], oracle.weight[rows])]
    if case.bias:
        pairs.append(("grad_bias shard", got.bias, unsharded.bias[rows], oracle.bias[rows]))
    for name, mine, flce_full, exact in pairs:
        assert mine is not None, f"{name}: no gradient"
        if case.dtype in (torch.float32, torch.float64):
            kind = "grad_hidden" if name == "grad_hidden" else "grad_weight"
            assert_close_per_design(mine, flce_full.double(), kind=kind, dtype=case.dtype, name=f"{name} vs unsharded")
            assert_close_per_design(mine, exact, kind=kind, dtype=case.dtype, name=f"{name} vs oracle")
        else:
            # Low precision: within 2x of what the unsharded op achieves against the oracle.
            mine_err, full_err = relative_error(mine, exact), relative_error(flce_full, exact)
            assert mine_err <= 2.0 * full_err + 1e-3, \
                f"{name}: relative error {mine_err:.2e} vs unsharded {full_err:.2e}"


def equality_cases(world_size: int) -> list[Case]:
    """Every option set x reduction x layout at 2 ranks; at 4 ranks (twice the processes on the
    same cores) the uneven layout only, and fewer float64 / edge cases."""
    layouts = LAYOUTS[world_size]
    grid_layouts = layouts if world_size == 2 else {"uneven": layouts["uneven"]}
    edge_reductions = REDUCTIONS if world_size == 2 else ("mean",)
    cases = []
    for layout, sizes in grid_layouts.items():
        for set_name, options in OPTION_SETS.items():
            for reduction in REDUCTIONS:
                cases.append(Case(f"w{world_size}/{layout}/{set_name}/{reduction}", sizes,
                                  dict(options, reduction=reduction), bias=reduction == "sum"))
    uneven = layouts["uneven"]
    # A budget of a few rows per chunk: several chunks, each with its own combine, and the
    # deferred schedule recomputes the logits instead of saving them.
    row_bytes = max(uneven) * 12
    for set_name in ("plain", "full+class_weight"):
        for reduction in REDUCTIONS:
            options = dict(OPTION_SETS[set_name], reduction=reduction, memory_budget=4 * row_bytes)
            cases.append(Case(f"w{world_size}/chunks/{set_name}/{reduction}", uneven, options, bias=True))
    for reduction in edge_reductions:
        cases.append(Case(f"w{world_size}/float64/full/{reduction}", uneven, dict(FULL, reduction=reduction),
                          dtype=torch.float64, bias=True))
    cases.append(Case(f"w{world_size}/bfloat16/plain", uneven, dict(accum_dtype=torch.float32),
                      dtype=torch.bfloat16, token_shape=(4, 8), hidden_size=32))
    for reduction in ("mean", "none") if world_size == 2 else ("mean",):
        cases.append(Case(f"w{world_size}/all-ignored/{reduction}", uneven,
                          dict(FULL, reduction=reduction), ignore_fraction=1.0))
    cases.append(Case(f"w{world_size}/empty", uneven, dict(ALL_EXTRAS), token_shape=(0,)))
    return cases


# --------------------------------------------------------------------------- sections

def section_matches_unsharded(checker: Checker, rank: int, world_size: int) -> None:
    for case in equality_cases(world_size):
        check_case(checker, case, rank, dist.group.WORLD)


def section_cuda_kernels_interpreted(checker: Checker, rank: int, world_size: int) -> None:
    """The CUDA backend's Triton kernels (vocab_offset, shard slice of class_weight, global argmax)
    under the Triton interpreter on CPU tensors, float32 (the interpreter's bf16 dot is wrong)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "test setup: the ranks must start with TRITON_INTERPRET=1"
    sizes = LAYOUTS[world_size]["uneven"]
    for set_name, reduction in (("plain", "mean"), ("full+class_weight", "none"), ("smoothing+metrics", "sum")):
        case = Case(f"w{world_size}/cuda-interpreted/{set_name}/{reduction}", sizes,
                    dict(OPTION_SETS[set_name], reduction=reduction), bias=True, backend="cuda")
        check_case(checker, case, rank, dist.group.WORLD)


def section_argmax_ties(checker: Checker, rank: int, world_size: int) -> None:
    """Exact ties across shard boundaries: the first global index wins, as in torch.argmax.

    Integer-valued inputs make every logit exact whatever the GEMM's summation order, so the
    ties are real ties on every rank.
    """
    sizes = LAYOUTS[world_size]["uneven"]
    vocab = sum(sizes)
    gen = seed_of(f"ties{world_size}")
    hidden = torch.randint(-2, 3, (12, 8), generator=gen).float()
    weight = torch.randint(-2, 3, (vocab, 8), generator=gen).float()
    # The same row in the last class of shard 0 and in several later shards, large enough to be the max.
    first = sizes[0] - 1
    twins = [first] + [sum(sizes[:r]) + sizes[r] // 2 for r in range(1, world_size)]
    weight[twins] = torch.randint(3, 5, (8,), generator=gen).float()
    hidden[:6] = hidden[:6].abs() + 1.0  # positive rows: the twins' logit is the row max
    target = torch.randint(0, vocab, (12,), generator=gen)
    target[0] = twins[-1]  # a tie won by an earlier index: not a correct prediction
    target[1] = first
    with checker.case(f"w{world_size}/ties"):
        out = sharded_loss(hidden, weight[shard_rows(sizes, rank)], target, None, dist.group.WORLD,
                           dict(return_predicted_tokens=True, return_token_accuracy=True, reduction="none"))
        expected = (hidden.double() @ weight.double().T).argmax(dim=1)
        assert torch.equal(expected[:6], torch.full((6,), first)), "test setup: the twins are not the row max"
        assert torch.equal(out.predicted_tokens, expected), f"{out.predicted_tokens} != {expected}"
        assert torch.equal(out.token_accuracy, (expected == target).float()), "token accuracy differs"


def section_single_rank_groups(checker: Checker, rank: int, world_size: int) -> None:
    """A group of one rank behaves exactly like no group: bitwise the same results."""
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    mine = groups[rank]
    for set_name, reduction in (("plain", "mean"), ("full+class_weight", "none"), ("smoothing+metrics", "sum")):
        name = f"world-1 group/{set_name}/{reduction}"
        gen = seed_of(name)
        hidden, weight, target, bias = make_inputs((2, 7), 16, 29, bias=True, generator=gen)
        options = dict(OPTION_SETS[set_name], reduction=reduction)
        if options.get("class_weight") is True:
            options["class_weight"] = random_class_weight(29, gen)
        upstream = random_upstream(target.shape if reduction == "none" else torch.Size(), target.shape,
                                   logprobs="return_logprobs" in options, entropy="return_entropy" in options,
                                   generator=gen)
        with checker.case(name):
            got, got_grads = flce_grads(functools.partial(flce.linear_cross_entropy, process_group=mine, **options),
                                        hidden, weight, target, bias, upstream)
            want, want_grads = flce_grads(functools.partial(flce.linear_cross_entropy, **options),
                                          hidden, weight, target, bias, upstream)
            got_t = got if isinstance(got, tuple) else (got,)
            want_t = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got_t, want_t, strict=True):
                assert (a is None and b is None) or torch.equal(a, b), "outputs differ from the no-group call"
            for a, b in zip(vars(got_grads).values(), vars(want_grads).values(), strict=True):
                assert torch.equal(a, b), "gradients differ from the no-group call"
    with checker.case("world-1 group/target range"):
        hidden, weight, target, _ = make_inputs((5,), 8, 11, generator=seed_of("w1 range"))
        target[2] = 11
        _expect_error(lambda: flce.linear_cross_entropy(hidden, weight, target, process_group=mine),
                      ValueError, "outside")


def section_subgroups(checker: Checker, rank: int, world_size: int) -> None:
    """Two independent 2-rank groups: shard offsets come from the rank within the group."""
    subgroup, _ = dist.new_subgroups(group_size=2)
    group_rank = dist.get_rank(subgroup)
    for set_name, reduction in (("full+class_weight", "mean"), ("plain", "none")):
        case = Case(f"subgroup/{set_name}/{reduction}/{rank // 2}", LAYOUTS[2]["uneven"],
                    dict(OPTION_SETS[set_name], reduction=reduction), bias=True)
        check_case(checker, case, group_rank, subgroup)


def section_errors(checker: Checker, rank: int, world_size: int) -> None:
    world = dist.group.WORLD
    sizes = LAYOUTS[world_size]["uneven"]
    vocab = sum(sizes)
    rows = shard_rows(sizes, rank)
    hidden, weight, target, _ = make_inputs((9,), 8, vocab, generator=seed_of("errors"))
    w_shard = weight[rows]

    with checker.case("target beyond the global vocabulary"):
        bad = target.clone()
        bad[4] = vocab
        _expect_error(lambda: sharded_loss(hidden, w_shard, bad, None, world, {}), ValueError,
                      f"outside the global vocabulary [0, {vocab})")
    with checker.case("targets held by other shards are valid"):
        other = torch.full_like(target, vocab - 1 if rank == 0 else 0)
        loss = sharded_loss(hidden, w_shard, other, None, world, {})
        assert torch.isfinite(loss), f"loss {loss}"
    with checker.case("class_weight of the shard's size"):
        shard_weight = torch.ones(w_shard.shape[0])
        _expect_error(lambda: sharded_loss(hidden, w_shard, target, None, world, {"class_weight": shard_weight}),
                      ValueError, f"expected the global weight vector of shape [V={vocab}]")
    with checker.case("hidden sizes differ across ranks"):
        clear_cache()  # every rank exchanges its layout again
        h2, w2, t2, _ = make_inputs((4,), 8 + 4 * rank, vocab, generator=seed_of("mismatch"))
        _expect_error(lambda: sharded_loss(h2, w2[rows], t2, None, world, {}), ValueError, "hidden sizes differ")
    with checker.case("debug mode: token counts differ across ranks"):
        h3, w3, t3, _ = make_inputs((6 + rank,), 8, vocab, generator=seed_of("tokens"))
        with _env(DISTRIBUTED_CHECKS_ENV, "1"):
            _expect_error(lambda: sharded_loss(h3, w3[rows], t3, None, world, {}), ValueError, "tokens differs")
    with checker.case("debug mode: options differ across ranks"):
        with _env(DISTRIBUTED_CHECKS_ENV, "1"):
            _expect_error(lambda: sharded_loss(hidden, w_shard, target, None, world,
                                               {"label_smoothing": 0.1 * rank}), ValueError, "options checksum")
    with checker.case("debug mode: agreeing ranks pass, one extra all_gather"):
        want = sharded_loss(hidden, w_shard, target, None, world, {})
        with _env(DISTRIBUTED_CHECKS_ENV, "1"), record_collectives() as records:
            got = sharded_loss(hidden, w_shard, target, None, world, {})
        assert torch.equal(got, want), "debug mode changed the loss"
        assert [r.kind for r in records].count("all_gather") == 1, [r.kind for r in records]
    with checker.case("second backward of the in-forward schedule"):
        h = hidden.clone().requires_grad_()
        loss = sharded_loss(h, w_shard, target, None, world, {})
        first = torch.autograd.grad(loss, h, retain_graph=True)[0]
        second = torch.autograd.grad(loss, h)[0]
        assert torch.equal(first, second), "a retained graph's second backward differs from its first"
        _expect_error(lambda: loss.backward(), RuntimeError, "a second time")
    for reduction in ("mean", "none"):  # gradients in forward, deferred
        with checker.case(f"second derivatives are refused ({reduction})"):
            def loss_of(h: torch.Tensor, reduction: str = reduction) -> torch.Tensor:
                return sharded_loss(h, w_shard.double(), target, None, world, {"reduction": reduction}).sum()

            h = hidden.double().requires_grad_()
            _expect_error(lambda h=h, f=loss_of: torch.autograd.functional.hessian(f, h), RuntimeError,
                          "first-order only")
            (grad,) = torch.autograd.grad(loss_of(h), h, create_graph=True)
            _expect_error(lambda h=h, g=grad: torch.autograd.grad(g, h, torch.ones_like(g), allow_unused=True),
                          RuntimeError, "first-order only")
    with checker.case("batched gradients are refused"):
        h = hidden.clone().requires_grad_()
        loss = sharded_loss(h, w_shard, target, None, world, {})
        _expect_error(lambda: torch.autograd.grad(loss, h, torch.ones(2), is_grads_batched=True), RuntimeError,
                      "vocab-parallel call are not supported")


def section_communication(checker: Checker, rank: int, world_size: int) -> None:
    """Bytes per step are O(tokens), independent of V; one grad_hidden all-reduce per call."""
    world = dist.group.WORLD
    tokens, hidden_size = 10, 8
    for set_name, reduction in (("plain", "mean"), ("full+class_weight", "sum"), ("entropy+ignore_index=3", "none")):
        payloads = []
        for vocab_per_rank in (6, 24):
            name = f"bytes/{set_name}/{reduction}/V={vocab_per_rank * world_size}"
            sizes = (vocab_per_rank,) * world_size
            gen = seed_of(name)
            options = dict(OPTION_SETS[set_name], reduction=reduction)
            hidden, weight, target, _ = make_inputs((tokens,), hidden_size, sum(sizes), generator=gen,
                                                    ignore_index=options.get("ignore_index", -100))
            if options.get("class_weight") is True:
                options["class_weight"] = random_class_weight(sum(sizes), gen)
            upstream = random_upstream(target.shape if reduction == "none" else torch.Size(), target.shape,
                                       logprobs=False, entropy="return_entropy" in options, generator=gen)
            with checker.case(name):
                clear_cache()
                h = hidden.clone().requires_grad_()
                with record_collectives() as first:
                    out = sharded_loss(h, weight[shard_rows(sizes, rank)], target, None, world, options)
                    backward_surrogate(out, Upstream(upstream.loss, None, upstream.entropy)).backward()
                with record_collectives() as second:
                    sharded_loss(h, weight[shard_rows(sizes, rank)], target, None, world, options)
                kinds = [r.kind for r in first]
                assert kinds[0] == "all_gather" and kinds.count("all_gather") == 1, f"layout exchange: {kinds}"
                assert "all_gather" not in [r.kind for r in second], "the layout was exchanged again"
                grad_reduces = [r for r in first if r.numel == tokens * hidden_size]
                assert len(grad_reduces) == 1 and grad_reduces[0].kind == "all_reduce(SUM)", \
                    f"expected exactly one grad_hidden all-reduce, got {kinds}"
                payload = sum(r.bytes for r in first[1:])
                cfg = LCEConfig(**options)
                expected = payload_bytes_per_step(cfg, tokens, hidden_size, torch.float32)
                assert payload == expected, f"payload {payload} B != formula {expected} B ({kinds})"
                payloads.append(payload)
        with checker.case(f"bytes/{set_name}/{reduction}: independent of V"):
            assert payloads[0] == payloads[1], f"payload changed with V: {payloads}"


TOKEN_SHARDED_OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "z-loss+smoothing": dict(lse_square_scale=1e-2, label_smoothing=0.1),
    "class_weight+smoothing": dict(label_smoothing=0.1, class_weight=True),
    # Weights whose sum over the counted targets is negative, zero or NaN: torch's weighted mean divides by it.
    "negative class_weight": dict(class_weight="negative"),
    "zero class_weight": dict(class_weight="zero"),
    "NaN class_weight on a counted class": dict(class_weight="nan"),
}


def _token_sharded_class_weight(kind: Any, target: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    if kind is None:
        return None
    weight = random_class_weight(13, gen)
    if kind == "negative":
        return -weight
    if kind == "zero":
        return torch.zeros_like(weight)
    if kind == "nan":
        counted = target[target != -100]
        weight[int(counted[0]) if counted.numel() else 0] = float("nan")
    return weight


def section_token_sharded(checker: Checker, rank: int, world_size: int) -> None:
    """Tokens split unevenly across the ranks (one rank's all ignored in one case), the whole weight on
    each: token_sharded_mean of each rank's summed loss equals the unsharded mean over all tokens, the
    rank's grad_hidden rows equal the unsharded ones, and the ranks' weight gradients add up to the
    unsharded one ("sum") or average to it ("mean")."""
    world = dist.group.WORLD
    counts = [3 + 4 * r for r in range(world_size)]  # uneven token counts
    for name, options in TOKEN_SHARDED_OPTIONS.items():
        for layout in ("mixed", "one rank all ignored", "all ignored"):
            case = f"token-sharded/{name}/{layout}"
            gen = seed_of(case)
            hidden, weight, target, _ = make_inputs((sum(counts),), 8, 13, generator=gen, ignore_fraction=0.3)
            mine = shard_rows(tuple(counts), rank)
            if layout == "one rank all ignored":
                target[shard_rows(tuple(counts), world_size - 1)] = -100
            elif layout == "all ignored":
                target[:] = -100
            call = dict(options)
            if "class_weight" in call:
                call["class_weight"] = _token_sharded_class_weight(call["class_weight"], target, gen)
            want_h, want_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            want = flce.linear_cross_entropy(want_h, want_w, target, **call)
            want.backward()
            # Every collective first, on every rank: an assertion that fails on one rank must not
            # leave the others waiting in a collective.
            got = {}
            for reduction in ("sum", "mean"):
                h, w = hidden[mine].clone().requires_grad_(), weight.clone().requires_grad_()
                out = flce.linear_cross_entropy(h, w, target[mine], reduction="sum", return_z_loss=True, **call)
                loss = token_sharded_mean(out.loss, target[mine], world, class_weight=call.get("class_weight"),
                                          z_loss_sum=out.z_loss, gradient_reduction=reduction)
                loss.backward()
                grad_weight = w.grad.clone()
                dist.all_reduce(grad_weight)
                got[reduction] = (loss.detach(), h.grad, grad_weight)
            with checker.case(case):
                for reduction, (loss, grad_hidden, grad_weight) in got.items():
                    scale = world_size if reduction == "mean" else 1
                    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6, equal_nan=True)
                    close(loss, want.detach())
                    # A zero or NaN divisor makes the upstream gradient of the rank's sum call inf or NaN, which
                    # reaches its ignored rows too (flce scales the gradients it formed in forward; torch's sum
                    # skips ignored rows): those rows are compared where the divisor is finite and non-zero.
                    rows = (target[mine] != -100 if call.get("class_weight") is not None
                            and not bool(torch.isfinite(want.detach())) else slice(None))
                    close(grad_hidden[rows], scale * want_h.grad[mine][rows])
                    close(grad_weight / scale, want_w.grad)
    with checker.case("token-sharded: class_weight without z_loss_sum"):
        _expect_error(lambda: token_sharded_mean(torch.zeros(()), torch.zeros(3, dtype=torch.long), world,
                                                 class_weight=torch.ones(4)), ValueError, "z_loss_sum=None")
    with checker.case("token-sharded: class_weight with a z-loss"):
        _expect_error(lambda: token_sharded_mean(torch.ones(()), torch.zeros(3, dtype=torch.long), world,
                                                 class_weight=torch.ones(4), z_loss_sum=torch.ones(())),
                      RuntimeError, "not supported")
    with checker.case("token-sharded: a target outside the class weights"):
        _expect_error(lambda: token_sharded_mean(torch.zeros(()), torch.tensor([0, 4, -100]), world,
                                                 class_weight=torch.ones(4), z_loss_sum=torch.zeros(())),
                      ValueError, "target contains 4, outside [0, 4)")
    with checker.case("token-sharded: a per-token loss"):
        _expect_error(lambda: token_sharded_mean(torch.zeros(3), torch.zeros(3, dtype=torch.long), world),
                      ValueError, "reduction='sum'")


def _expect_error(fn: Callable[[], Any], error: type[Exception], fragment: str) -> None:
    try:
        fn()
    except error as exc:
        assert fragment in str(exc), f"{error.__name__} without {fragment!r}: {exc}"
        return
    raise AssertionError(f"expected {error.__name__} mentioning {fragment!r}, nothing was raised")


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


COMPILED_OPTIONS = {
    "plain-mean": {},  # gradients in forward, scaled and all-reduced in the compiled backward
    "none-logprobs-entropy": dict(reduction="none", return_logprobs=True, return_entropy=True, temperature=0.7),
    "full-class_weight": dict(FULL, class_weight=True, reduction="sum"),
}


def section_compiled(checker: Checker, rank: int, world_size: int) -> None:
    """torch.compile(fullgraph=True) over a vocab-parallel step (module and functional form): one
    graph, the group carried into the custom ops by name; outputs and gradients equal the eager
    sharded call's and the unsharded op's."""
    group = dist.group.WORLD
    sizes = LAYOUTS[world_size]["uneven"]
    rows = shard_rows(sizes, rank)
    for name, options in COMPILED_OPTIONS.items():
        for form in ("functional", "module"):
            gen = seed_of(f"compiled-{name}")
            hidden, weight, target, bias = make_inputs((3, 5), 8, sum(sizes), bias=True, generator=gen)
            options = dict(options)
            if options.get("class_weight") is True:
                options["class_weight"] = random_class_weight(sum(sizes), gen)
            loss_shape = target.shape if options.get("reduction") == "none" else torch.Size()
            upstream = random_upstream(loss_shape, target.shape, logprobs=bool(options.get("return_logprobs")),
                                       entropy=bool(options.get("return_entropy")), generator=gen)
            if form == "module":
                loss_fn = flce.get_impl("cpu")(process_group=group, **options)
            else:
                def loss_fn(h, w, t, b, options=options):
                    return flce.linear_cross_entropy(h, w, t, b, process_group=group, **options)
            torch._dynamo.reset()
            compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
            with checker.case(f"compiled {name} {form}"):
                got, got_grads = flce_grads(compiled, hidden, weight[rows], target, bias[rows], upstream)
                eager, eager_grads = flce_grads(loss_fn, hidden, weight[rows], target, bias[rows], upstream)
                unsharded, full_grads = flce_grads(
                    lambda h, w, t, b: flce.linear_cross_entropy(h, w, t, b, **options),  # noqa: B023
                    hidden, weight, target, bias, upstream)
                pairs = list(zip(_as_output(got), _as_output(eager), _as_output(unsharded), strict=True))
                pairs += [(got_grads.hidden, eager_grads.hidden, full_grads.hidden),
                          (got_grads.weight, eager_grads.weight, full_grads.weight[rows]),
                          (got_grads.bias, eager_grads.bias, full_grads.bias[rows])]
                for mine, same_path, full in pairs:
                    assert (mine is None) == (same_path is None) == (full is None)
                    if mine is not None:
                        torch.testing.assert_close(mine, same_path, rtol=1e-5, atol=1e-6)
                        torch.testing.assert_close(mine, full, rtol=1e-4, atol=1e-5)
    with checker.case("explain: one graph, no break"):
        def step(h, w, t, b):
            out = flce.linear_cross_entropy(h, w, t, b, process_group=group, return_logprobs=True)
            return out.loss + out.logprobs.sum()

        hidden, weight, target, bias = make_inputs((6,), 8, sum(sizes), bias=True, generator=seed_of("explain"))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(step)(hidden, weight[rows], target, bias[rows])
        assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
        assert explanation.graph_count == 1


def _as_output(out: Any) -> flce.LCEOutput:
    return out if isinstance(out, flce.LCEOutput) else flce.LCEOutput(loss=out)


SECTIONS: dict[str, dict[str, Callable[[Checker, int, int], None]]] = {
    "2": {
        "matches_unsharded": section_matches_unsharded,
        "argmax_ties": section_argmax_ties,
        "single_rank_groups": section_single_rank_groups,
        "errors": section_errors,
        "communication": section_communication,
        "compiled": section_compiled,
        "token_sharded": section_token_sharded,
    },
    "2-interpreted": {
        "cuda_kernels_interpreted": section_cuda_kernels_interpreted,
    },
    "4": {
        "matches_unsharded": section_matches_unsharded,
        "argmax_ties": section_argmax_ties,
        "subgroups": section_subgroups,
        "communication": section_communication,
        "token_sharded": section_token_sharded,
    },
}


# --------------------------------------------------------------------------- pytest entry points

@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("section", ["matches_unsharded", "argmax_ties", "communication", "token_sharded"])
def test_vocab_parallel(reports: Callable[[int], list[dict[str, dict]]], world_size: int, section: str) -> None:
    assert_section(reports(world_size), section)


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "section"), [(2, "single_rank_groups"), (2, "errors"), (4, "subgroups"),
                                                     (2, "compiled")])
def test_vocab_parallel_groups_and_errors(reports: Callable[[int], list[dict[str, dict]]], world_size: int,
                                          section: str) -> None:
    assert_section(reports(world_size), section)


@pytest.mark.distributed
@pytest.mark.triton
def test_vocab_parallel_cuda_kernels_interpreted(tmp_path: Path) -> None:
    skip_unless_interpreter_runs()
    reports = run_ranks(2, tmp_path, sections_key="2-interpreted", fresh_env={"TRITON_INTERPRET": "1"})
    assert_section(reports, "cuda_kernels_interpreted")


def test_packed_max_argmax_round_trip() -> None:
    """The int64 key orders like (value, -index) and decodes exactly, signed zeros and infinities included."""
    values = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-38, 2.25, 3e38, float("inf")])
    keys = order_preserving_key(values)
    assert torch.all(keys[1:] >= keys[:-1])
    assert torch.equal(key_to_float(keys).view(torch.int32), values.view(torch.int32))
    row_max = torch.tensor([1.5, 1.5, -2.0, 0.0])
    argmax = torch.tensor([7, 3, 2**32 - 1, 0])
    packed = pack_max_argmax(row_max, argmax)
    assert packed[1] > packed[0], "equal maxima: the smaller index must give the larger key"
    decoded_max, decoded_argmax = unpack_max_argmax(packed)
    assert torch.equal(decoded_max, row_max) and torch.equal(decoded_argmax, argmax)


def test_process_group_without_init_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    hidden, weight, target, _ = make_inputs((3,), 4, 5, generator=torch.Generator().manual_seed(0))
    group = dist.ProcessGroup.__new__(dist.ProcessGroup)  # of the right type, but no init_process_group
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        flce.linear_cross_entropy(hidden, weight, target, process_group=group)


@pytest.mark.parametrize("group", ["foo", object(), 3])
def test_process_group_of_the_wrong_type(group: object) -> None:
    hidden, weight, target, _ = make_inputs((3,), 4, 5, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"process_group=.*expected a torch.distributed ProcessGroup.* or None"):
        flce.linear_cross_entropy(hidden, weight, target, process_group=group)
