"""``python -m flce explain --policy LEVEL``: the record of a policy loss's call (flce.linear_policy_loss), and the
CUDA backend's schedules for it under the Triton interpreter.

Token level: each chunk's gradient formed in the forward from its own statistics (over its logits, or, without an
entropy term, from kept exponentials whose row scale the policy sets once the statistics are known). Sequence
level (statistics first): the rows the budget keeps hold logits or, without an entropy term, exponentials, their
gradient formed once every row's statistics are known; the others recomputed; within a small budget, vocabulary
blocks. The records name real functions, equal what a call plans, and name exactly the kernels that ran; the
kept-exponential schedules' numbers match the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TORCH_GEMMS, count_launches, launched, launches_against_record
from policy_cases import check_against_oracle, full_options, policy_case
from test_explain import _TILES, DEVICES, INTERPRETER_KERNEL_MODULES, _planned, resolve

import flce
from flce.__main__ import main
from flce.engine import run as engine_run

SHAPE = "16384x4096x151936"
POLICY_CALLS = {  # name: (level, options)
    "token": ("token", {"temperature": 0.7}),
    "token-512MiB": ("token", {"temperature": 0.7, "memory_budget": 512 << 20}),
    "token-no-entropy": ("token", {"temperature": 0.7, "return_entropy": False}),
    "sequence": ("sequence", {"temperature": 0.7}),
    "sequence-512MiB": ("sequence", {"temperature": 0.7, "memory_budget": 512 << 20}),
    "sequence-6GiB-no-entropy": ("sequence", {"temperature": 0.7, "memory_budget": 6 << 30, "return_entropy": False}),
}


@pytest.mark.parametrize("call", list(POLICY_CALLS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_policy_records_name_real_functions(device: str, call: str) -> None:
    pytest.importorskip("triton")
    level, options = POLICY_CALLS[call]
    record = flce.explain(**DEVICES[device], shape=SHAPE, dtype="bfloat16", policy=level, **options)
    names = record.kernel_names() | {k for step in record.steps for k in step.fallback}
    assert names and all(step.reason for step in record.steps)
    for name in names:
        assert callable(resolve(name)) or hasattr(resolve(name), "fn"), name
    text = str(record)
    assert ("after every row's statistics" in text) == (level == "sequence"), text


def test_the_h100_plans_the_policy_as_its_targets_need() -> None:
    """On an H100 (bf16, 16 x 1024 tokens x 4096 x 151936): the token level in 512 MiB forms each chunk's gradient
    in the forward (three GEMMs); the sequence level keeps its exponentials where 6 GiB holds them (three GEMMs), and
    in 512 MiB takes statistics first and the gradients by vocabulary blocks (four)."""
    pytest.importorskip("triton")

    def record(call: str):
        level, options = POLICY_CALLS[call]
        return flce.explain("cuda", gpu="NVIDIA H100 80GB HBM3", shape=SHAPE, policy=level, **options)

    token = record("token-512MiB")
    assert token.plan.chunk_grad == "logits" and token.plan.saved_rows == 0 and token.memory.working_bytes < 512 << 20
    assert record("token-no-entropy").plan.chunk_grad == "exponentials"
    kept = record("sequence-6GiB-no-entropy")
    assert kept.plan.chunk_grad == "exponentials" and kept.plan.saved_rows == 16384
    assert "exponentials of all rows kept" in str(kept)
    small = record("sequence-512MiB")
    assert type(small.plan).__name__ == "VocabBlocks" and small.memory.working_bytes <= 512 << 20
    default = record("sequence")
    assert 0 < default.plan.saved_rows < 16384 and default.plan.backward_grad == "fused"


def test_explain_command_with_a_policy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("triton")
    assert main(["explain", "--shape", "4096x1024x32000", "--policy", "sequence", "--temperature", "0.7",
                 "--return_entropy", "false"]) == 0
    assert "after every row's statistics" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "--shape", "8x8x8", "--policy", "sequence", "--label_smoothing", "0.1"])


def _policy_step(case, options: dict, backend: str):
    def step() -> None:
        out = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **case.tensors(),
                                      backend=backend, **options)
        out.loss.backward()

    return step


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_explain_equals_what_a_policy_call_plans(backend: str, level: str, monkeypatch: pytest.MonkeyPatch,
                                                 generator: torch.Generator) -> None:
    if backend == "cuda":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("interpreter test: runs where there is no GPU")
    case = policy_case(generator, vocab=40).to(torch.float32)
    options = full_options("dapo", level, memory_budget=8 * 40 * 4)
    planned = _planned(monkeypatch, _policy_step(case, options, backend))
    explained = flce.explain("cpu", backend=backend, shape=(case.target.numel(), case.hidden.shape[-1], 40),
                             dtype="float32", policy=level, temperature=options["temperature"],
                             memory_budget=options["memory_budget"])
    assert explained == planned


_CHUNKS = {"tokens_per_chunk": 8, "grad_schedule": "token_chunks"}
INTERPRETER_CALLS = {  # name: (level, entropy, autotune knobs, logits-save limit)
    "token-logits": ("token", True, _CHUNKS, None),
    "token-exponentials": ("token", False, dict(_TILES, **_CHUNKS, chunk_grad="exponentials"), None),
    "sequence-kept-logits": ("sequence", True, _CHUNKS, 1 << 30),
    "sequence-kept-exponentials": ("sequence", False, dict(_TILES, **_CHUNKS, chunk_grad="exponentials"), 1 << 30),
    "sequence-some-kept-recomputed-fused": ("sequence", False,
                                            dict(_TILES, **_CHUNKS, chunk_grad="exponentials", backward_grad="fused",
                                                 forward_logits="fused", logits_kernel="triton"), 8 * 40 * 4 * 2),
    "sequence-statistics-first-recomputed": ("sequence", True, dict(_TILES, **_CHUNKS, forward_stats="fused"), 0),
    "sequence-vocab-blocks": ("sequence", True, dict(_TILES, forward_stats="fused", backward_grad="fused",
                                                     grad_schedule="vocab_blocks", grad_vocab_block=16), None),
}


@pytest.mark.parametrize("name", list(INTERPRETER_CALLS))
def test_interpreter_policy_kernels_that_ran_are_the_ones_the_record_named(name: str,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           generator: torch.Generator) -> None:
    """Every Triton kernel and torch GEMM a policy call launched (the CUDA backend in the interpreter) is one its
    record names, and the other way round; and the call's numbers are the float64 oracle's."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs where there is no GPU")
    from flce.autotune import override_params

    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 16)
    level, entropy, knobs, limit = INTERPRETER_CALLS[name]
    case, fresh = (policy_case(generator, vocab=40, length=8).to(torch.float32) for _ in range(2))
    ran = count_launches(monkeypatch, INTERPRETER_KERNEL_MODULES)
    options = full_options("dapo", level, entropy_weight=0.01 if entropy else 0.0, return_entropy=entropy)
    with override_params(knobs, limit, backend="cuda"):
        record = _planned(monkeypatch, _policy_step(case, options, "cuda"))
    named = {k for k in record.kernel_names() if k.startswith("flce.") or k in TORCH_GEMMS}
    assert ran == named, f"ran {sorted(ran)}\n{record}"
    monkeypatch.undo()  # the oracle's own GEMMs uncounted
    monkeypatch.setattr("flce.backends.cuda.plan.MAX_BLOCK_V", 16)
    with override_params(knobs, limit, backend="cuda"):
        check_against_oracle(fresh, options, backend="cuda", rtol=1e-4, atol=1e-5)


GPU_CALLS = {  # name: (level, entropy, memory_budget): bf16 8 x 1024 tokens x 2048 x 32000 on the CUDA backend
    "token": ("token", True, None),
    "token-exponentials": ("token", False, None),
    "sequence-kept-logits": ("sequence", True, 1 << 30),
    "sequence-kept-exponentials": ("sequence", False, 1 << 30),
    "sequence-64MiB": ("sequence", True, 64 << 20),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(GPU_CALLS))
def test_gpu_policy_kernels_that_ran_are_the_ones_explain_named(name: str, monkeypatch: pytest.MonkeyPatch,
                                                               generator: torch.Generator) -> None:
    """tests/test_explain_gpu.py's check for policy calls: flce's kernels that ran (torch.profiler's names) are the
    ones the record names, both ways, and cuBLAS ran where the record names a torch GEMM."""
    level, entropy, budget = GPU_CALLS[name]
    case = policy_case(generator, batch=8, length=1024, hidden_size=2048, vocab=32000).to(torch.bfloat16, "cuda")
    options = full_options("dapo", level, entropy_weight=0.01 if entropy else 0.0, return_entropy=entropy,
                           memory_budget=budget)
    records = []
    real = engine_run.apply_eager
    monkeypatch.setattr(engine_run, "apply_eager", lambda flat, call: records.append(call.choice) or real(flat, call))
    step = _policy_step(case, options, "cuda")
    step()  # compiles the kernels
    names = launched(step)
    record = records[-1]
    ran, named, cublas_ran = launches_against_record(names, record)
    assert ran == named, f"{name}: ran {sorted(ran)}, the record named {sorted(named)}\n{record}"
    assert cublas_ran == bool(record.kernel_names() & TORCH_GEMMS), f"{name}: cuBLAS ran: {cublas_ran}\n{record}"
