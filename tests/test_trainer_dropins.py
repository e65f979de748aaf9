"""flce's RL-trainer drop-ins (flce.integrations.verl / areal / trl) against each trainer's own code.

What each drop-in is checked against, on the CPU:

- verl 0.9.1: its Triton kernel needs CUDA, so against verl's torch path ``FusedLinearForPPOFunction``
  (``verl/utils/experimental/torch_functional.py``, what verl's models run with its "torch" fused
  backend), same formula and outputs, loaded from the installed file: ``import verl`` needs ray and
  the rest of verl's dependency tree, the file itself only torch. The signature is compared with
  the kernel's ``LinearCrossEntropy.forward`` (same way). Tensor parallelism: the kernel only,
  so against the float64 formula.
- TRL 1.16.0: ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` itself, forward and backward
  (its torch tile path, which TRL runs where Triton cannot). Its backward imports
  ``trl.trainer.utils`` (pandas, accelerate, datasets) for one context manager that gathers DeepSpeed
  ZeRO-3 parameters and returns ``nullcontext()`` without ZeRO-3; the tests provide that nullcontext.
- AReaL: its ``linear_cross_entropy_logprobs_entropy`` lives in its pull request 1322
  (``areal.models.kernel``), not in the 1.0.4 release, and imports ``areal`` (aiohttp, ...), so
  against its documented formula (materialised logits, float64 here), tensor parallelism included.

CI installs the two packages without their dependencies: ``pip install --no-deps verl==0.9.1
trl==1.16.0`` (seconds); without them those tests skip and say so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
import types
import zlib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import leaf_inputs
from test_distributed import Checker, assert_section, run_ranks

from flce.integrations import areal as flce_areal
from flce.integrations import trl as flce_trl
from flce.integrations import verl as flce_verl

# fp32: docs/design.md's 1e-5 for values; the trainers' own code sums in another order, so gradients
# get 1e-5 relative and 1e-5 absolute too (they hold at these sizes). fp64 against the float64
# formula: 1e-10.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP64_TOL = dict(rtol=1e-10, atol=1e-10)
INSTALL_HINT = "pip install --no-deps verl==0.9.1 trl==1.16.0"


# --------------------------------------------------------------------------- the trainers' code

def _installed_file_module(package: str, relative_path: str) -> types.ModuleType:
    """Execute one file of an installed package without importing the package (whose __init__
    pulls in its whole dependency tree); skips when the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed ({INSTALL_HINT})")
    path = Path(next(iter(spec.submodule_search_locations)), relative_path)
    if not path.is_file():
        pytest.skip(f"{package} has no {relative_path} (expected {package}'s version from {INSTALL_HINT})")
    module_spec = importlib.util.spec_from_file_location(f"_trainer_{package}_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@cache
def verl_torch_functional() -> types.ModuleType:
    return _installed_file_module("verl", "utils/experimental/torch_functional.py")


@cache
def verl_kernel_entry() -> types.ModuleType:
    return _installed_file_module("verl", "utils/kernel/linear_cross_entropy.py")


@pytest.fixture
def trl_chunked() -> types.ModuleType:
    """TRL's chunked log-prob module, with the ZeRO-3 gather context its backward imports."""
    module = pytest.importorskip("trl.kernels.chunked_logprob", reason=f"trl is not installed ({INSTALL_HINT})")
    stub = types.ModuleType("trl.trainer.utils")
    stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    saved = sys.modules.get("trl.trainer.utils")
    sys.modules["trl.trainer.utils"] = stub
    try:
        yield module
    finally:
        if saved is None:
            del sys.modules["trl.trainer.utils"]
        else:
            sys.modules["trl.trainer.utils"] = saved


# --------------------------------------------------------------------------- the float64 formula

def formula(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None, *,
            temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0) -> dict[str, Any]:
    """Every quantity the trainers return, from materialised float64 logits
    ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``; differentiable."""
    raw = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().T
    if bias is not None:
        raw = raw + bias.double()
    z = raw * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    flat_targets = targets.reshape(-1)
    return {
        "logprobs": log_p.gather(1, flat_targets[:, None]).squeeze(1),
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1).detach(),
        "mean_logits": z.mean(-1).detach(),
        "max_raw_logits": raw.max(-1).values.detach(),
        "is_top1": z.argmax(-1) == flat_targets,
    }


def trainer_inputs(generator: torch.Generator, shape: tuple[int, ...], hidden_size: int, vocab: int,
                   dtype: torch.dtype, bias: bool = False) -> dict[str, Any]:
    """helpers.leaf_inputs under the trainers' keyword names (labels in [0, V) as "targets")."""
    return leaf_inputs(generator, shape, hidden_size, vocab, dtype, bias, target_key="targets")


def grads(outputs: tuple[torch.Tensor, ...], upstream: tuple[torch.Tensor, ...],
          inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of sum(output * upstream) with respect to ``inputs``."""
    surrogate = sum((out.double() * up).sum() for out, up in zip(outputs, upstream, strict=True))
    return list(torch.autograd.grad(surrogate, inputs))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, **tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{name}: {m}")


def _parameters(fn: Any, skip_first: bool = False) -> list[tuple[str, Any]]:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_first else 0:]
    return [(p.name, p.default) for p in params]


# --------------------------------------------------------------------------- verl

def test_verl_signature_is_verls() -> None:
    kernel_forward = verl_kernel_entry().LinearCrossEntropy.forward
    assert _parameters(flce_verl.linear_cross_entropy) == _parameters(kernel_forward, skip_first=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_verl_matches_verls_torch_path(generator: torch.Generator, dtype: torch.dtype, temperature: float) -> None:
    verl_function = verl_torch_functional().FusedLinearForPPOFunction
    inputs = trainer_inputs(generator, (2, 9), 48, 300, dtype)
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["targets"]
    upstream = (torch.randn(18, generator=generator, dtype=torch.float64),
                torch.randn(18, generator=generator, dtype=torch.float64))

    ours = flce_verl.linear_cross_entropy(hidden, weight, labels, temperature)
    theirs = verl_function.apply(hidden, weight, labels, temperature, 5)  # chunk_size 5: several chunks
    ours_grads = grads(ours, upstream, [hidden, weight])
    theirs_grads = grads(tuple(t.reshape(-1) for t in theirs), upstream, [hidden, weight])
    expected = formula(hidden, weight, labels, temperature=temperature)
    expected_grads = grads((expected["logprobs"], expected["entropy"]), upstream, [hidden, weight])

    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ours[1].dtype == ours[0].dtype
    # verl's torch path softmaxes in float32 whatever the inputs: fp32 agreement with it, and
    # float64 inputs must in addition match the float64 formula.
    for name, a, b in [("logprobs", ours[0], theirs[0].reshape(-1)), ("entropy", ours[1], theirs[1].reshape(-1)),
                       ("grad hidden", ours_grads[0], theirs_grads[0]),
                       ("grad weight", ours_grads[1], theirs_grads[1])]:
        assert_close(a, b, f"{name} vs verl", **FP32_TOL)
    if dtype == torch.float64:
        for name, a, b in [("logprobs", ours[0], expected["logprobs"]), ("entropy", ours[1], expected["entropy"]),
                           ("grad hidden", ours_grads[0], expected_grads[0]),
                           ("grad weight", ours_grads[1], expected_grads[1])]:
            assert_close(a, b, f"{name} vs float64", **FP64_TOL)


@pytest.mark.parametrize("reduction", ["sum", "mean", "MEAN"])
def test_verl_reductions(generator: torch.Generator, reduction: str) -> None:
    verl_function = verl_torch_functional().FusedLinearForPPOFunction
    inputs = trainer_inputs(generator, (14,), 32, 200, torch.float32)
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["targets"]
    upstream = (torch.randn((), generator=generator, dtype=torch.float64),
                torch.randn(14, generator=generator, dtype=torch.float64))
    ours = flce_verl.linear_cross_entropy(hidden, weight, labels, 0.8, reduction)
    per_token, entropy = verl_function.apply(hidden, weight, labels, 0.8, 4)
    reduced = per_token.sum() if reduction == "sum" else per_token.mean()
    assert ours[0].shape == () and ours[1].shape == (14,)
    for name, a, b in zip(["logprob " + reduction, "entropy", "grad hidden", "grad weight"],
                          [*ours, *grads(ours, upstream, [hidden, weight])],
                          [reduced, entropy, *grads((reduced, entropy), upstream, [hidden, weight])], strict=True):
        assert_close(a, b, name, **FP32_TOL)


def test_verl_ignored_labels(generator: torch.Generator) -> None:
    verl_function = verl_torch_functional().FusedLinearForPPOFunction
    inputs = trainer_inputs(generator, (12,), 32, 150, torch.float32)
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["targets"]
    ignored = torch.zeros(12, dtype=torch.bool)
    ignored[[0, 5, 6, 11]] = True
    upstream = (torch.randn(12, generator=generator, dtype=torch.float64),
                torch.randn(12, generator=generator, dtype=torch.float64))
    ours = flce_verl.linear_cross_entropy(hidden, weight, labels.masked_fill(ignored, -100), 0.9)
    grad_hidden, grad_weight = grads(ours, upstream, [hidden, weight])
    assert torch.equal(ours[0][ignored], torch.zeros(4)) and torch.equal(ours[1][ignored], torch.zeros(4))
    assert torch.equal(grad_hidden[ignored], torch.zeros(4, 32)), "ignored tokens got a gradient"
    # The other tokens: exactly verl's results on them alone.
    kept = ~ignored
    theirs = verl_function.apply(hidden[kept], weight, labels[kept], 0.9, 3)
    their_grads = grads(theirs, tuple(u[kept] for u in upstream), [hidden, weight])
    assert_close(ours[0][kept], theirs[0], "logprobs", **FP32_TOL)
    assert_close(ours[1][kept], theirs[1], "entropy", **FP32_TOL)
    assert_close(grad_hidden, their_grads[0], "grad hidden", **FP32_TOL)
    assert_close(grad_weight, their_grads[1], "grad weight", **FP32_TOL)
    with pytest.raises(ValueError, match="target"):
        flce_verl.linear_cross_entropy(hidden, weight, labels.masked_fill(ignored, 150))
    with pytest.raises(ValueError, match="reduction"):
        flce_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "avg")


# --------------------------------------------------------------------------- tensor parallelism (gloo, 2 ranks)

def _rank_generator(name: str) -> torch.Generator:
    """The same seed on every rank: each builds the same full inputs and keeps its shard."""
    base = int(os.environ.get("FLCE_TEST_SEED", "0"))
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * base)


def _sharded_inputs(name: str, shard_sizes: tuple[int, ...], rank: int) -> dict[str, Any]:
    generator = _rank_generator(name)
    full = trainer_inputs(generator, (3, 5), 32, sum(shard_sizes), torch.float32)
    start = sum(shard_sizes[:rank])
    rows = slice(start, start + shard_sizes[rank])
    upstream = (torch.randn(15, generator=generator, dtype=torch.float64),
                torch.randn(15, generator=generator, dtype=torch.float64))
    return dict(full, rows=rows, upstream=upstream,
                shard=full["weight"].detach()[rows].clone().requires_grad_(),
                local_hidden=full["hidden"].detach().clone().requires_grad_())


def section_verl_tp(checker: Checker, rank: int, world_size: int) -> None:
    """verl's kernel semantics: full-vocabulary outputs on every rank, grad weight = this rank's
    rows, grad hidden = an equal share whose sum over the group is the full gradient."""
    group = dist.group.WORLD
    case = _sharded_inputs("verl_tp", (40,) * world_size, rank)
    hidden, shard, labels, upstream = case["local_hidden"], case["shard"], case["targets"], case["upstream"]
    expected = formula(case["hidden"], case["weight"], labels, temperature=0.8)
    expected_grads = grads((expected["logprobs"], expected["entropy"]), upstream, [case["hidden"], case["weight"]])
    with checker.case("verl/forward"):
        logprobs, entropy = flce_verl.linear_cross_entropy(hidden, shard, labels, 0.8, "none", group)
        assert_close(logprobs, expected["logprobs"], "logprobs", **FP32_TOL)
        assert_close(entropy, expected["entropy"], "entropy", **FP32_TOL)
    with checker.case("verl/backward"):
        grad_hidden, grad_shard = grads((logprobs, entropy), upstream, [hidden, shard])
        assert_close(grad_shard, expected_grads[1][case["rows"]], "grad weight shard", **FP32_TOL)
        assert_close(grad_hidden, expected_grads[0] / world_size, "grad hidden share", **FP32_TOL)
        dist.all_reduce(grad_hidden, group=group)
        assert_close(grad_hidden, expected_grads[0], "grad hidden summed over ranks", **FP32_TOL)
    with checker.case("verl/mean"):
        mean, _ = flce_verl.linear_cross_entropy(hidden, shard, labels, 0.8, "mean", group)
        assert_close(mean, expected["logprobs"].mean(), "mean logprob", **FP32_TOL)


def section_areal_tp(checker: Checker, rank: int, world_size: int) -> None:
    """AReaL's kernel semantics, uneven shards: full-vocabulary outputs and raw max logits on
    every rank, grad hidden complete on every rank, grad weight = this rank's rows."""
    group = dist.group.WORLD
    case = _sharded_inputs("areal_tp", tuple(17 + 30 * r for r in range(world_size)), rank)
    hidden, shard, labels, upstream = case["local_hidden"], case["shard"], case["targets"], case["upstream"]
    expected = formula(case["hidden"], case["weight"], labels, temperature=1.4)
    expected_grads = grads((expected["logprobs"], expected["entropy"]), upstream, [case["hidden"], case["weight"]])
    with checker.case("areal/forward"):
        logprobs, entropy, max_logits = flce_areal.linear_cross_entropy_logprobs_entropy(
            hidden, shard, labels, 1.4, group, True)
        for name, got, key in [("logprobs", logprobs, "logprobs"), ("entropy", entropy, "entropy"),
                               ("max logits", max_logits, "max_raw_logits")]:
            assert_close(got, expected[key].reshape(3, 5), name, **FP32_TOL)
    with checker.case("areal/backward"):
        grad_hidden, grad_shard = grads((logprobs.reshape(-1), entropy.reshape(-1)), upstream, [hidden, shard])
        assert_close(grad_shard, expected_grads[1][case["rows"]], "grad weight shard", **FP32_TOL)
        assert_close(grad_hidden, expected_grads[0], "grad hidden", **FP32_TOL)


SECTIONS = {"2": {"verl_tp": section_verl_tp, "areal_tp": section_areal_tp}}


@pytest.fixture(scope="module")
def tp_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(2, tmp_path_factory.mktemp("trainer_tp"), sections_module=__name__, sections_key="2")


@pytest.mark.distributed
@pytest.mark.parametrize("section", ["verl_tp", "areal_tp"])
def test_tensor_parallel(tp_reports: list[dict[str, dict]], section: str) -> None:
    assert_section(tp_reports, section)


# --------------------------------------------------------------------------- AReaL (its documented formula)

def test_areal_signatures() -> None:
    # AReaL PR 1322, areal/models/kernel/functional.py.
    assert _parameters(flce_areal.linear_cross_entropy_logprobs_entropy) == [
        ("hidden", inspect.Parameter.empty), ("weight", inspect.Parameter.empty), ("labels", inspect.Parameter.empty),
        ("temperature", 1.0), ("tp_group", None), ("return_max_logits", False)]
    assert _parameters(flce_areal.linear_cross_entropy_logprobs) == [
        ("hidden", inspect.Parameter.empty), ("weight", inspect.Parameter.empty), ("labels", inspect.Parameter.empty),
        ("temperature", 1.0), ("tp_group", None)]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_areal_matches_formula(generator: torch.Generator, dtype: torch.dtype, temperature: float) -> None:
    inputs = trainer_inputs(generator, (3, 7), 40, 260, dtype)
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["targets"]
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    upstream = (torch.randn(3, 7, generator=generator, dtype=torch.float64),
                torch.randn(3, 7, generator=generator, dtype=torch.float64))
    logprobs, entropy, max_logits = flce_areal.linear_cross_entropy_logprobs_entropy(
        hidden, weight, labels, temperature, None, True)
    expected = formula(hidden, weight, labels, temperature=temperature)
    ours_grads = grads((logprobs, entropy), upstream, [hidden, weight])
    expected_grads = grads((expected["logprobs"].reshape(3, 7), expected["entropy"].reshape(3, 7)), upstream,
                           [hidden, weight])
    assert max_logits.dtype == logprobs.dtype and not max_logits.requires_grad
    for name, a, b in [("logprobs", logprobs, expected["logprobs"].reshape(3, 7)),
                       ("entropy", entropy, expected["entropy"].reshape(3, 7)),
                       ("max logits", max_logits, expected["max_raw_logits"].reshape(3, 7)),
                       ("grad hidden", ours_grads[0], expected_grads[0]),
                       ("grad weight", ours_grads[1], expected_grads[1])]:
        assert_close(a, b, name, **tol)
    pair = flce_areal.linear_cross_entropy_logprobs_entropy(hidden, weight, labels, temperature)
    assert len(pair) == 2
    assert_close(pair[0], logprobs, "logprobs without max logits", **tol)
    only_logprobs = flce_areal.linear_cross_entropy_logprobs(hidden, weight, labels, temperature)
    assert_close(only_logprobs, expected["logprobs"].reshape(3, 7), "logprobs only", **tol)


def test_areal_ignored_labels(generator: torch.Generator) -> None:
    inputs = trainer_inputs(generator, (10,), 24, 90, torch.float32)
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["targets"]
    ignored = torch.arange(10) % 3 == 0
    logprobs, entropy, max_logits = flce_areal.linear_cross_entropy_logprobs_entropy(
        hidden, weight, labels.masked_fill(ignored, -100), 1.3, return_max_logits=True)
    expected = formula(hidden, weight, labels, temperature=1.3)
    zeros = torch.zeros(int(ignored.sum()))
    for name, got, key in [("logprobs", logprobs, "logprobs"), ("entropy", entropy, "entropy"),
                           ("max logits", max_logits, "max_raw_logits")]:
        assert torch.equal(got[ignored].detach(), zeros), f"{name} of ignored tokens is not 0"
        assert_close(got[~ignored], expected[key][~ignored], name, **FP32_TOL)


# --------------------------------------------------------------------------- TRL

def _argmax_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   logit_scale: float) -> torch.Tensor:
    """Each row's most likely token (softcap and temperature > 0 keep the order; the scale's sign flips it)."""
    with torch.no_grad():
        raw = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
        return (raw * logit_scale).argmax(-1)


def test_trl_signature_is_trls(trl_chunked: types.ModuleType) -> None:
    assert _parameters(flce_trl.chunked_logprobs) == _parameters(trl_chunked.ChunkedLogProbFunction.forward,
                                                                 skip_first=True)
    assert flce_trl.OPTIONAL_OUTPUTS == trl_chunked.OPTIONAL_OUTPUTS


TRL_CASES = {
    "plain": dict(temperature=1.0),
    "temperature+bias": dict(temperature=0.7, bias=True),
    "softcap+logit_scale": dict(temperature=0.9, bias=True, softcap=3.0, logit_scale=0.5),
    "negative logit_scale": dict(temperature=1.1, logit_scale=-1.5),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trl_matches_trls_function(trl_chunked: types.ModuleType, generator: torch.Generator, dtype: torch.dtype,
                                   case: str) -> None:
    options = dict(TRL_CASES[case])
    has_bias = options.pop("bias", False)
    softcap, logit_scale = options.pop("softcap", None), options.pop("logit_scale", 1.0)
    temperature = options.pop("temperature")
    inputs = trainer_inputs(generator, (20,), 48, 310, dtype, bias=has_bias)
    hidden, weight, bias, targets = inputs["hidden"], inputs["weight"], inputs["bias"], inputs["targets"]
    targets[:6] = _argmax_tokens(hidden[:6], weight, bias, logit_scale)
    params = [t for t in (hidden, weight, bias) if t is not None]
    outputs = flce_trl.OPTIONAL_OUTPUTS
    args = (hidden, weight, bias, targets, temperature, 64, softcap, logit_scale, outputs)
    ours = flce_trl.chunked_logprobs(*args)
    theirs = trl_chunked.ChunkedLogProbFunction.apply(*args)
    upstream = (torch.randn(20, generator=generator, dtype=torch.float64),
                torch.randn(20, generator=generator, dtype=torch.float64))
    ours_grads = grads(ours[:2], upstream, params)
    theirs_grads = grads(theirs[:2], upstream, params)
    expected = formula(hidden, weight, targets, bias, temperature=temperature, softcap=softcap,
                       logit_scale=logit_scale)
    expected_grads = grads((expected["logprobs"], expected["entropy"]), upstream, params)

    names = ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits")
    for name, mine, their in zip(names, ours, theirs, strict=False):
        if name not in outputs and name != "logprobs":
            assert mine is None and their is None, f"{name}: not asked, expected None"
            continue
        # TRL folds its statistics in float32 whatever the inputs: fp32 agreement with it.
        assert_close(mine, their, f"{name} vs trl", **FP32_TOL)
        if dtype == torch.float64:
            assert_close(mine, expected[name], f"{name} vs float64", **FP64_TOL)
    assert torch.equal(ours[4], theirs[4]) and torch.equal(ours[4], expected["is_top1"]), "is_top1 differs"
    for name, mine, their, exact in zip(["grad hidden", "grad weight", "grad bias"], ours_grads, theirs_grads,
                                        expected_grads, strict=False):
        assert_close(mine, their, f"{name} vs trl", **FP32_TOL)
        if dtype == torch.float64:
            assert_close(mine, exact, f"{name} vs float64", **FP64_TOL)


def test_trl_outputs_and_errors(trl_chunked: types.ModuleType, generator: torch.Generator) -> None:
    inputs = trainer_inputs(generator, (8,), 16, 64, torch.float32)
    hidden, weight, targets = inputs["hidden"], inputs["weight"], inputs["targets"]
    args = (hidden, weight, None, targets, 1.0, 16)
    for outputs in [("log_probs",), ("entropy",), ("is_top1", "log_sum_sq_probs")]:
        ours = flce_trl.ChunkedLogProbFunction.apply(*args, None, 1.0, outputs)
        theirs = trl_chunked.ChunkedLogProbFunction.apply(*args, None, 1.0, outputs)
        assert [t is None for t in ours] == [t is None for t in theirs], f"outputs={outputs}: None pattern differs"
        assert_close(ours[0], theirs[0], f"logprobs, outputs={outputs}", **FP32_TOL)
    with pytest.raises(ValueError, match="entropie"):
        flce_trl.chunked_logprobs(*args, None, 1.0, ("entropie",))
    with pytest.raises(ValueError, match="chunk_size"):
        flce_trl.chunked_logprobs(hidden, weight, None, targets, 1.0, 0)
    # A logit_scale the folding into flce's options cannot carry is named, not the temperature it would make.
    for scale, error, message in ((float("inf"), TypeError, "logit_scale=inf: expected a finite real number"),
                                  (float("nan"), TypeError, "logit_scale=nan"),
                                  (1e-310, ValueError, "logit_scale=1e-310 with temperature=1.0")):
        with pytest.raises(error, match=message):
            flce_trl.chunked_logprobs(*args, None, scale)
    with pytest.raises(ValueError, match=r"^temperature=0.0: expected a value > 0"):
        flce_trl.chunked_logprobs(hidden, weight, None, targets, 0.0, 16)
    softcapped = flce_trl.chunked_logprobs(*args, 3.0, 0.7, ("mean_logits",))
    assert_close(softcapped[3], trl_chunked.ChunkedLogProbFunction.apply(*args, 3.0, 0.7, ("mean_logits",))[3],
                 "mean_logits, soft-capped", **FP32_TOL)
    ignored = flce_trl.chunked_logprobs(hidden, weight, None, targets.masked_fill(targets < 20, -100), 1.0, 16)
    masked = targets < 20
    assert torch.equal(ignored[0][masked].detach(), torch.zeros(int(masked.sum())))
    assert not ignored[4][masked].any(), "an ignored target counted as top-1"
