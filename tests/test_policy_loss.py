"""flce.linear_policy_loss (the GRPO/PPO family, flce/policy) against the float64 oracle
(flce.testing.policy_oracle, TRL 1.16's _compute_loss restated on materialised logits): every loss type at both
importance-sampling levels with every option at once, option subsets, the packed form, every engine schedule
(gradients in forward by token chunks; statistics first, then kept or recomputed chunks, or vocabulary blocks),
float32, the module form, the CUDA and Ascend kernels under the Triton interpreter, and the input checks."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from policy_cases import (
    LEVELS,
    LOSS_TYPES,
    ORACLE_OPTIONS,
    PolicyCase,
    check_against_oracle,
    full_options,
    packed,
    policy_case,
)

import flce
from flce.engine import run as engine_run
from flce.engine.plans import CUBLAS, AllRows, TokenChunks, VocabBlocks
from flce.testing.policy_oracle import reference_policy_loss

FP64 = dict(rtol=1e-9, atol=1e-11)
# docs/design.md's float32 gradient tolerance; the loss and metrics hold it too.
FP32 = dict(rtol=1e-4, atol=1e-5)
# Rows of 37 float64 logits (296 bytes): chunks of 4 rows, so every call here runs several.
SMALL_BUDGET = 4 * 37 * 8


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_level_matches_the_oracle(loss_type: str, level: str, generator: torch.Generator) -> None:
    """Mask, ignored targets, temperature, delta, the k3 KL, the rollout correction and the entropy bonus at once,
    a bias, several chunks: loss, gradients of hidden, weight and bias, log-probs, entropies and metrics."""
    case = policy_case(generator, bias=True)
    check_against_oracle(case, full_options(loss_type, level), memory_budget=SMALL_BUDGET, **FP64)


OPTION_SUBSETS: dict[str, dict[str, Any]] = {
    "no-old-logprobs": {"tensors": {"old": False}},  # ratio 1: old = logp.detach()
    "no-kl": {"options": {"beta": 0.0}, "tensors": {"ref": False}},
    "no-rollout": {"tensors": {"rollout": False}},
    "no-entropy-term": {"options": {"entropy_weight": 0.0}},
    "entropy-not-returned": {"options": {"entropy_weight": 0.0, "return_entropy": False}},
    "entropy-penalty": {"options": {"entropy_weight": -0.3}},
    "temperature-1": {"options": {"temperature": 1.0}},
    "symmetric-clip-no-delta": {"options": {"epsilon_high": 0.2, "delta": None}},
    "kl-only-reference": {"options": {"beta": 0.0}},  # ref given, no penalty: the KL is still reported
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("subset", sorted(OPTION_SUBSETS))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_option_subsets_match_the_oracle(loss_type: str, subset: str, level: str, generator: torch.Generator) -> None:
    spec = OPTION_SUBSETS[subset]
    case = policy_case(generator)
    options = full_options(loss_type, level, **spec.get("options", {}))
    if loss_type == "cispo":
        options.pop("delta", None)
    out = check_against_oracle(case, options, tensors=case.tensors(**spec.get("tensors", {})),
                               memory_budget=SMALL_BUDGET, **FP64)
    if subset == "entropy-not-returned":
        assert out.entropy is None and out.mean_entropy is None


@pytest.mark.parametrize("level", LEVELS)
def test_per_token_advantages(level: str, generator: torch.Generator) -> None:
    case = policy_case(generator, per_token_advantages=True)
    check_against_oracle(case, full_options("grpo", level), **FP64)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo", "sapo"])
def test_packed_form_matches_the_oracle(loss_type: str, level: str, generator: torch.Generator) -> None:
    """hidden [N, H] with sequence ids, the sequences' rows shuffled together: the same loss as padded."""
    case = packed(policy_case(generator), generator)
    check_against_oracle(case, full_options(loss_type, level), memory_budget=SMALL_BUDGET, **FP64)


@pytest.mark.parametrize("level", LEVELS)
def test_packed_equals_padded(level: str, generator: torch.Generator) -> None:
    padded = policy_case(generator, per_token_advantages=True)
    rows = packed(padded, generator)
    options = full_options("grpo", level)
    a = flce.linear_policy_loss(padded.hidden, padded.weight, padded.target, padded.advantages, **padded.tensors(),
                                **options)
    b = flce.linear_policy_loss(rows.hidden, rows.weight, rows.target, rows.advantages, **rows.tensors(), **options)
    torch.testing.assert_close(a.loss, b.loss, **FP64)
    torch.testing.assert_close(torch.autograd.grad(a.loss, padded.weight)[0],
                               torch.autograd.grad(b.loss, rows.weight)[0], **FP64)


PLANS = {
    "token-chunks": TokenChunks(4),
    "token-chunks-some-kept": TokenChunks(4, saved_rows=8),
    "token-chunks-all-kept": TokenChunks(4, saved_rows=21),
    "token-chunks-statistics-first": TokenChunks(4, stats_first=AllRows(forward_stats=CUBLAS, scan_block=5)),
    "vocab-blocks": VocabBlocks(grad_vocab_block=5, stats=AllRows(forward_stats=CUBLAS, scan_block=5)),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_schedule(plan: str, level: str, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's plan replaced: the same results by token chunks (each chunk's gradient from its own
    statistics, or, at the sequence level, after all rows' from kept and recomputed chunks) and by vocabulary
    blocks."""
    real = engine_run.planned_call
    planned = []

    def with_plan(*args: Any):
        call = real(*args)
        planned.append(call.plan)
        return call.with_plan(PLANS[plan])

    monkeypatch.setattr(engine_run, "planned_call", with_plan)
    case = policy_case(generator, bias=plan != "vocab-blocks")
    check_against_oracle(case, full_options("dapo", level), **FP64)
    assert planned, "the call did not go through the planner"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_float32(loss_type: str, level: str, generator: torch.Generator) -> None:
    case = policy_case(generator, bias=True).to(torch.float32)
    check_against_oracle(case, full_options(loss_type, level), memory_budget=SMALL_BUDGET // 2, **FP32)


def test_without_gradients_the_loss_and_metrics_only(generator: torch.Generator) -> None:
    case = policy_case(generator)
    with torch.no_grad():
        out = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(),
                                      **full_options("dapo", "sequence"))
    assert not out.loss.requires_grad
    want = check_against_oracle(case, full_options("dapo", "sequence"), **FP64)
    torch.testing.assert_close(out.loss, want.loss.detach(), **FP64)


def test_everything_masked_gives_zero(generator: torch.Generator) -> None:
    case = policy_case(generator)
    case.mask = torch.zeros_like(case.mask)
    for loss_type in LOSS_TYPES:
        out = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(),
                                      **full_options(loss_type, "sequence"))
        grads = torch.autograd.grad(out.loss, case.leaves())
        assert out.loss.item() == 0 and all(bool((g == 0).all()) for g in grads), loss_type


def test_device_tensor_item_count(generator: torch.Generator) -> None:
    """num_items_in_batch as a 0-d tensor (TRL passes one) equals the number."""
    case = policy_case(generator)
    options = full_options("dapo", "token")
    a = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(), **options)
    options["num_items_in_batch"] = torch.tensor(options["num_items_in_batch"])
    b = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(), **options)
    torch.testing.assert_close(a.loss, b.loss, **FP64)


def test_module_form(generator: torch.Generator) -> None:
    case = policy_case(generator)
    options = full_options("grpo", "sequence")
    items = options.pop("num_items_in_batch", None)
    cls = flce.get_policy_impl("cpu", backend="reference")
    assert cls is flce.get_policy_impl("cpu", backend="reference")
    module = pickle.loads(pickle.dumps(cls(**options)))
    assert type(module) is cls
    got = module(case.hidden, case.weight, case.target, case.advantages, **case.tensors(), num_items_in_batch=items)
    want = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(),
                                   **options)
    torch.testing.assert_close(got.loss, want.loss, **FP64)
    with pytest.raises(TypeError, match="LinearPolicyLoss\\(\\) got unexpected options \\['epsilon'\\]; valid"):
        cls(epsilon=0.2)


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["cuda", "ascend"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_triton_backends_under_the_interpreter(backend: str, loss_type: str, level: str,
                                               generator: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA and Ascend backends' own kernels (fp32; on CPU tensors through the Triton interpreter)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 16)
    case = policy_case(generator, bias=True, vocab=40).to(torch.float32)
    check_against_oracle(case, full_options(loss_type, level), backend=backend, memory_budget=8 * 40 * 4, **FP32)


@pytest.mark.triton
def test_kept_exponentials_take_the_policy_scale_after_the_statistics(generator: torch.Generator,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Token level without an entropy term: the gradient is a row multiple of softmax - onehot, and the CUDA
    backend's kept exponentials (their row scale known after the statistics) serve it."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    from flce.autotune import override_params
    from flce.backends.cuda import ops

    calls = []
    real = ops.TritonChunkKernels.gemm_exp_grad
    monkeypatch.setattr(ops.TritonChunkKernels, "gemm_exp_grad",
                        lambda self, *args: calls.append(1) or real(self, *args))
    case = policy_case(generator, vocab=40).to(torch.float32)
    options = full_options("dapo", "token", entropy_weight=0.0, return_entropy=False)
    knobs = {"tokens_per_chunk": 8, "grad_schedule": "token_chunks", "chunk_grad": "exponentials"}
    with override_params(knobs, backend="cuda"):
        check_against_oracle(case, options, backend="cuda", **FP32)
    assert len(calls) == 3, f"{len(calls)} chunks took the kept exponentials, expected all 3"


BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown loss type", {"loss_type": "ppo"}, ValueError, "loss_type='ppo'"),
    ("vespo", {"loss_type": "vespo"}, ValueError, "vespo is not implemented"),
    ("unknown level", {"importance_sampling_level": "sequence_token"}, ValueError, "importance_sampling_level"),
    ("kl without reference", {"beta": 0.1, "ref_logprobs": None}, ValueError, "ref_logprobs=None"),
    ("dr_grpo without horizon", {"loss_type": "dr_grpo", "max_completion_length": None}, ValueError,
     "max_completion_length=None"),
    ("negative epsilon", {"epsilon_low": -0.1}, ValueError, "epsilon_low=-0.1"),
    ("negative beta", {"beta": -1.0}, ValueError, "beta=-1.0"),
    ("bad temperature", {"temperature": 0.0}, ValueError, "temperature=0.0"),
    ("unknown option", {"epsilon": 0.2}, TypeError, "epsilon"),
    ("mask shape", {"mask": "short"}, ValueError, "mask: has shape"),
    ("advantage shape", {"advantages": "wrong"}, ValueError, "advantages"),
    ("old log-probs shape", {"old_logprobs": "short"}, ValueError, "old_logprobs: has shape"),
    ("integer old log-probs", {"old_logprobs": "integer"}, TypeError, "old_logprobs: expected a floating"),
    ("old log-probs with grad", {"old_logprobs": "grad"}, ValueError, "old_logprobs requires grad"),
    ("mask not a tensor", {"mask": [1, 0]}, TypeError, "mask: expected a torch.Tensor"),
    ("sequence ids out of range", {"sequence_ids": "large"}, ValueError, "sequence_ids: expected values"),
    ("packed ids on padded target", {"sequence_ids": "padded"}, ValueError, "sequence_ids: has shape"),
]


@pytest.mark.parametrize("name", [c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_before_any_kernel(name: str, generator: torch.Generator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _, change, error, message = next(c for c in BAD_CALLS if c[0] == name)
    case = policy_case(generator)
    if change.get("sequence_ids") == "large":
        case = packed(case, generator)
    monkeypatch.setattr(engine_run, "run_backend", lambda *a: pytest.fail("a kernel ran before the check"))
    kwargs: dict[str, Any] = {**case.tensors(), **full_options("dapo", "token"), "advantages": case.advantages}
    special = {
        "short": lambda: torch.ones(case.target.shape[0], 2),
        "wrong": lambda: torch.randn(case.target.shape[0] + 1, dtype=torch.float64),
        "integer": lambda: torch.ones_like(case.target),
        "grad": lambda: case.old_logprobs.clone().requires_grad_(),
        "large": lambda: case.sequence_ids + case.target.shape[0],
        "padded": lambda: torch.zeros_like(case.target).reshape(-1),
    }
    for key, value in change.items():
        kwargs[key] = special[value]() if isinstance(value, str) and value in special else value
    advantages = kwargs.pop("advantages")
    with pytest.raises(error, match=message):
        flce.linear_policy_loss(case.hidden, case.weight, case.target, advantages, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("budget", [None, 64 << 20], ids=["default", "64MiB"])
def test_gpu_precision_against_the_oracle(level: str, budget: int | None, generator: torch.Generator) -> None:
    """On the CUDA backend: float32 to 1e-4 relative (loss, gradients); bfloat16 within 1.5x of the error eager
    PyTorch's bf16 materialised formula makes against the float64 oracle (docs/design.md's rule), relative norms."""
    case = policy_case(generator, batch=8, length=256, hidden_size=1024, vocab=32000, temperature=0.7)
    options = full_options("dapo", level, memory_budget=budget, max_completion_length=256)
    check_against_oracle(case.to(torch.float32, "cuda"), options, backend="cuda", rtol=1e-4, atol=1e-6)
    oracle_options = {k: v for k, v in options.items() if k in ORACLE_OPTIONS}

    def errors(case_in: PolicyCase, **how: Any) -> list[float]:
        tensors = {k: v for k, v in case_in.tensors().items() if k != "bias"}
        if how:
            out = reference_policy_loss(case_in.hidden, case_in.weight, case_in.target, case_in.advantages,
                                        **tensors, **oracle_options, **how)["loss"]
        else:
            out = flce.linear_policy_loss(case_in.hidden, case_in.weight, case_in.target, case_in.advantages,
                                          **tensors, backend="cuda", **options).loss
        got = [out.detach(), *torch.autograd.grad(out, case_in.leaves())]
        return [float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]

    exact = case.to(torch.bfloat16).to(torch.float64, "cuda")  # the rounded inputs, exactly
    want_loss = reference_policy_loss(exact.hidden, exact.weight, exact.target, exact.advantages,
                                      **{k: v for k, v in exact.tensors().items() if k != "bias"},
                                      **oracle_options)["loss"]
    want = [want_loss.detach(), *torch.autograd.grad(want_loss, exact.leaves())]
    ours = errors(case.to(torch.bfloat16, "cuda"))
    eager = errors(case.to(torch.bfloat16, "cuda"), logits_dtype=torch.bfloat16)
    for name, mine, theirs in zip(("loss", "grad hidden", "grad weight"), ours, eager, strict=True):
        assert mine <= 1.5 * theirs + 1e-6, f"{name}: flce bf16 {mine:.2e} against eager bf16 {theirs:.2e}"
