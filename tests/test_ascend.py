"""The Ascend backend without the hardware: UB tiling, device properties, the chunk plan and its
logits-save decision, registry selection with a faked NPU, and the interpreter contract run.

Nothing here imports triton's kernels into this process: the kernels themselves are run by
tests/test_ascend_contract.py, in a subprocess with TRITON_INTERPRET=1 (see
test_contract_under_the_interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from planning import ascend_plan as ascend_plan_for

import flce
from flce.backends import ascend
from flce.backends.ascend import ops
from flce.backends.ascend import plan as ascend_plan
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.registry import HardwareProbe, candidates_for

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
KiB = 1 << 10
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VOCABS = (1, 2, 15, 16, 17, 300, 4096, 32000, 50257, 128256, 151936, 262144, 1 << 20)
UB_SIZES = (192 * KiB, 256 * KiB, 64 * KiB, 12 * KiB, 4 * KiB)


@pytest.fixture(autouse=True)
def no_ascend_env(monkeypatch):
    for name in (ops.ENV_VECTOR_CORES, ops.ENV_UB_BYTES, ops.ENV_TOTAL_MEMORY):
        monkeypatch.delenv(name, raising=False)


def _meta_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> FlatInputs:
    """Inputs with real shapes and no storage: the planner only reads shapes and dtypes."""
    return FlatInputs(
        hidden=torch.empty(tokens, hidden, dtype=dtype, device="meta"),
        weight=torch.empty(vocab, hidden, dtype=dtype, device="meta"),
        target=torch.empty(tokens, dtype=torch.int64, device="meta"),
        bias=None, token_shape=torch.Size([tokens]),
    )


def _props(*, cores: int = 40, ub: int = 192 * KiB, total: int = 64 * GiB) -> ops.AscendDeviceProperties:
    return ops.AscendDeviceProperties(vector_cores=cores, ub_bytes=ub, total_memory_bytes=total, source="test")


# ----------------------------------------------------------------------------- UB tiling


@pytest.mark.parametrize("kernel", sorted(ops.FOOTPRINTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_never_exceeds_the_ub_share(kernel, dtype):
    per_element = ops.FOOTPRINTS[kernel].bytes_per_element(dtype.itemsize)
    for ub in UB_SIZES:
        usable = int(ub * ops.UB_SAFETY_FRACTION)
        for vocab in VOCABS:
            block = ops.block_size(kernel, dtype, vocab, ub)
            assert block & (block - 1) == 0, (kernel, dtype, vocab, ub, block)
            assert ops.MIN_BLOCK_V <= block <= ops.MAX_BLOCK_V
            assert block * per_element <= usable, (kernel, dtype, vocab, ub, block)
            # No larger than the row needs, and no smaller than the UB allows.
            assert block <= max(ops.MIN_BLOCK_V, ops.next_power_of_2(vocab))
            at_a_cap = block in (ops.MAX_BLOCK_V, max(ops.MIN_BLOCK_V, ops.next_power_of_2(vocab)))
            assert at_a_cap or 2 * block * per_element > usable, (kernel, dtype, vocab, ub, block)


def test_footprint_counts_buffered_tiles_twice():
    footprint = ops.TileFootprint(io_tiles=2, fp32_input_tiles=1, broadcast_tiles=1, fp32_temporaries=3, mask_tiles=2)
    # 2 x (2 tiles x 2 bytes + 1 tile x 4 bytes) + (1 + 3) x 4 + 2 x 1
    assert footprint.bytes_per_element(2) == 16 + 16 + 2
    assert footprint.bytes_per_element(4) == 24 + 16 + 2


def test_blocks_on_a_910b_leave_the_margin():
    # 192 KiB of UB at bf16 and a 128k vocabulary: what the real chip gets.
    for kernel, footprint in ops.FOOTPRINTS.items():
        block = ops.block_size(kernel, torch.bfloat16, 128256, 192 * KiB)
        used = block * footprint.bytes_per_element(2)
        assert used <= 0.75 * 192 * KiB, kernel
        assert block >= 1024, f"{kernel}: block {block} is needlessly small for 192 KiB"


def test_ub_too_small_for_any_block_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=ops.ENV_UB_BYTES) as info:
        ops.block_size("full_grad", torch.float32, 1000, 512)
    assert "512 bytes" in str(info.value)


def test_wide_offsets_only_past_int32():
    def shaped(rows: int, cols: int, stride: int | None = None) -> torch.Tensor:
        return torch.empty_strided((rows, cols), (stride or cols, 1), device="meta")

    assert not ops.needs_wide_offsets(shaped(16384, 131071))  # 2**31 - 16384 elements
    assert ops.needs_wide_offsets(shaped(16384, 131072))  # exactly 2**31
    assert ops.needs_wide_offsets(shaped(2, 10, stride=2**31))  # a padded row stride
    assert not ops.needs_wide_offsets(shaped(0, 10))


def test_grid_is_bound_to_the_vector_cores():
    props = _props(cores=40)
    assert ops.grid_for(1, props) == (1,)
    assert ops.grid_for(40, props) == (40,)
    assert ops.grid_for(100000, props) == (40,)
    assert ops.grid_for(0, props) == (1,)


# ----------------------------------------------------------------------------- device properties


def test_defaults_off_the_npu_are_a_910b():
    props = ops.device_properties(torch.device("cpu"))
    assert (props.vector_cores, props.ub_bytes) == (40, 192 * KiB)
    assert props.total_memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert "910B default" in props.source


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv(ops.ENV_VECTOR_CORES, "48")
    monkeypatch.setenv(ops.ENV_UB_BYTES, "0x40000")
    monkeypatch.setenv(ops.ENV_TOTAL_MEMORY, str(32 * GiB))
    props = ops.device_properties(torch.device("cpu"))
    assert (props.vector_cores, props.ub_bytes, props.total_memory_bytes) == (48, 256 * KiB, 32 * GiB)
    assert ops.ENV_UB_BYTES in props.source


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_bad_override_names_the_variable_and_value(monkeypatch, value):
    monkeypatch.setenv(ops.ENV_VECTOR_CORES, value)
    with pytest.raises(ValueError, match=f"{ops.ENV_VECTOR_CORES}='{value}'"):
        ops.device_properties(torch.device("cpu"))


@pytest.mark.parametrize(("arch", "ub"), [("Ascend910B3", 192 * KiB), ("Ascend910B4-1", 192 * KiB),
                                          ("Ascend910_9391", 192 * KiB), ("Ascend910_9599", 256 * KiB),
                                          ("Ascend310P3", None)])
def test_ub_by_soc_name(arch, ub):
    assert ops.ub_bytes_for_arch(arch) == ub


def test_driver_properties_from_a_faked_torch_npu_and_triton_ascend(monkeypatch):
    """On an NPU the figures come from triton-ascend's driver and torch_npu; faked here."""
    fake_npu = types.SimpleNamespace(
        current_device=lambda: 0,
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=64 * GiB),
    )
    active = types.SimpleNamespace(
        utils=types.SimpleNamespace(get_device_properties=lambda index: {"num_aicore": 24, "num_vectorcore": 48}),
        get_current_target=lambda: types.SimpleNamespace(arch="Ascend910_9579"),
    )
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    runtime = types.SimpleNamespace(driver=types.SimpleNamespace(active=active))
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    ops._driver_properties.cache_clear()
    try:
        npu = types.SimpleNamespace(type="npu", index=1)  # torch.device("npu") needs torch_npu itself
        props = ops.device_properties(npu)
        assert (props.vector_cores, props.ub_bytes, props.total_memory_bytes) == (48, 256 * KiB, 64 * GiB)
        assert props.source.count("from the driver") == 3
        monkeypatch.setenv(ops.ENV_UB_BYTES, str(128 * KiB))  # the environment still wins
        assert ops.device_properties(npu).ub_bytes == 128 * KiB
    finally:
        ops._driver_properties.cache_clear()


# ----------------------------------------------------------------------------- chunk plan


@pytest.mark.parametrize(("total", "limit"), [(4 * GiB, GiB), (8 * GiB, GiB), (16 * GiB, 2 * GiB),
                                              (32 * GiB, 4 * GiB), (64 * GiB, 4 * GiB), (96 * GiB, 4 * GiB)])
def test_logits_save_limit_rule(total, limit):
    from flce.engine.memory import logits_save_limit_for

    assert logits_save_limit_for(total) == limit


def test_logits_saved_exactly_when_they_fit_under_the_limit():
    # 16 GiB NPU: limit 2 GiB. bf16 logits of 8192 x 131072 are exactly 2 GiB; one token more is not.
    props = _props(total=16 * GiB)
    assert ascend_plan_for(_meta_inputs(8192, 1024, 131072), LCEConfig(), props, "full").saved_rows == 8192
    # One token more: the leading whole chunks that fit beside one recomputed chunk are kept.
    plan = ascend_plan_for(_meta_inputs(8193, 1024, 131072), LCEConfig(), props, "full")
    chunk_bytes = plan.tokens_per_chunk * 256 * KiB
    assert plan.saved_rows == (2 * GiB - chunk_bytes) // chunk_bytes * plan.tokens_per_chunk
    assert 0 < plan.saved_rows < 8193 and plan.saved_rows * 256 * KiB + chunk_bytes <= 2 * GiB
    # A 64 GiB NPU keeps up to 4 GiB.
    assert ascend_plan_for(_meta_inputs(16384, 1024, 131072), LCEConfig(), _props(total=64 * GiB),
                           "full").saved_rows == 16384


def test_logits_save_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv(ops.ENV_TOTAL_MEMORY, str(8 * GiB))  # limit 1 GiB
    props = ops.device_properties(torch.device("cpu"))
    assert ascend_plan_for(_meta_inputs(4096, 512, 131072), LCEConfig(), props, "full").saved_rows == 4096
    assert ascend_plan_for(_meta_inputs(4097, 512, 131072), LCEConfig(), props, "full").saved_rows < 4096


def test_default_chunk_and_memory_budget():
    flat = _meta_inputs(100000, 1024, 131072)  # 256 KiB of bf16 logits per row
    plan = ascend_plan_for(flat, LCEConfig(), _props(), "plain")
    assert plan.tokens_per_chunk == ascend_plan.DEFAULT_CHUNK_BUDGET // (256 * KiB)
    # A budget bounds the chunk and what may be kept: 64 rows of logits leave nothing to save.
    plan = ascend_plan_for(_meta_inputs(1000, 1024, 131072), LCEConfig(memory_budget=64 * 256 * KiB),
                                   _props(), "full")
    assert (plan.tokens_per_chunk, plan.saved_rows) == (64, 0)
    # A budget with room for all the logits keeps them (the kernels turn them into the gradient in place).
    budget = 1000 * 256 * KiB
    plan = ascend_plan_for(_meta_inputs(1000, 1024, 131072), LCEConfig(memory_budget=budget), _props(), "full")
    assert (plan.tokens_per_chunk, plan.saved_rows) == (1000, 1000)
    # A budget of 320 rows makes 320-row chunks: no room to keep any beside a recomputed one.
    plan = ascend_plan_for(_meta_inputs(1000, 1024, 131072), LCEConfig(memory_budget=320 * 256 * KiB), _props(),
                           "full")
    assert (plan.tokens_per_chunk, plan.saved_rows) == (320, 0)
    assert ascend_plan_for(_meta_inputs(3, 8, 10), LCEConfig(), _props(), "plain").tokens_per_chunk == 3


def test_autotuned_chunk_and_limit_win():
    from flce.autotune.lookup import override_params

    flat = _meta_inputs(8192, 1024, 131072)  # 2 GiB of logits, over a 16 GiB NPU's limit
    props = _props(total=16 * GiB)
    with override_params({"tokens_per_chunk": 777}, logits_save_limit_bytes=3 * GiB, backend="ascend"):
        plan = ascend_plan_for(flat, LCEConfig(), props, "full")
    assert (plan.tokens_per_chunk, plan.saved_rows) == (777, 8192)
    with override_params({"tokens_per_chunk": 777}, logits_save_limit_bytes=GiB, backend="ascend"):
        # 1 GiB holds 4096 rows: four whole 777-row chunks beside a fifth, recomputed one.
        assert ascend_plan_for(flat, LCEConfig(), props, "full").saved_rows == 4 * 777
        # The budget still bounds a tuned chunk.
        budget_plan = ascend_plan_for(flat, LCEConfig(memory_budget=100 * 256 * KiB), props, "full")
        assert budget_plan.tokens_per_chunk == 100
    # A tuned 64-row chunk within a budget of 320 rows: four kept chunks beside a recomputed one.
    with override_params({"tokens_per_chunk": 64}, backend="ascend"):
        plan = ascend_plan_for(flat, LCEConfig(memory_budget=320 * 256 * KiB), props, "full")
    assert (plan.tokens_per_chunk, plan.saved_rows) == (64, 256)
    # Knobs for another backend, or values the planner cannot use, fall back to the heuristic.
    heuristic = ascend_plan_for(flat, LCEConfig(), props, "full")
    for params, backend in (({"tokens_per_chunk": 777}, "cuda"), ({"tokens_per_chunk": 0}, "ascend"),
                            ({"tokens_per_chunk": "777"}, "ascend"), ({"tokens_per_chunk": True}, "ascend")):
        with override_params(params, backend=backend):
            assert ascend_plan_for(flat, LCEConfig(), props, "full") == heuristic, (params, backend)


# ----------------------------------------------------------------------------- registry


@pytest.fixture
def triton_ascend_installed(monkeypatch):
    monkeypatch.setattr(ascend, "triton_has_ascend_backend", lambda: (True, "triton-ascend (faked)"))
    monkeypatch.setattr(ascend, "bisheng_compiler_found", lambda: (True, "BiSheng (faked)"))


def test_selected_for_npu_tensors_when_torch_npu_and_triton_ascend_work(triton_ascend_installed):
    probe = HardwareProbe.fake(npu=True, triton=True)
    cands = candidates_for("npu", probe=probe)
    assert cands.backends[0].name == "ascend"
    assert [b.name for b in cands.backends] == ["ascend", "reference"]
    assert candidates_for("npu", "ascend", probe=probe).backends[0] is ascend.BACKEND


def test_not_selected_for_cpu_or_cuda_tensors(triton_ascend_installed):
    probe = HardwareProbe.fake(npu=True, triton=True, cuda=True)
    assert "ascend" not in [b.name for b in candidates_for("cpu", probe=probe).backends]
    assert "ascend" not in [b.name for b in candidates_for("cuda", probe=probe).backends]
    with pytest.raises(RuntimeError, match="serves device types"):
        candidates_for("cuda", "ascend", probe=probe)


def test_without_torch_npu_the_reason_is_given():
    probe = HardwareProbe.fake(triton=True)
    ok, reason = ascend.BACKEND.is_available(probe)
    assert not ok and "npu" in reason
    cands = candidates_for("npu", probe=probe)
    assert [b.name for b in cands.backends] == ["reference"]
    assert ("ascend", reason) in cands.passed_over
    with pytest.raises(RuntimeError, match="not available"):
        candidates_for("npu", "ascend", probe=probe)


def test_npu_without_triton_or_with_upstream_triton_is_unavailable(monkeypatch):
    ok, reason = ascend.BACKEND.is_available(HardwareProbe.fake(npu=True))
    assert not ok and "triton" in reason
    # This machine's triton is upstream (CUDA/HIP backends only): the check finds that on disk.
    found, why = ascend.triton_has_ascend_backend()
    assert not found and "triton-ascend" in why
    ok, reason = ascend.BACKEND.is_available(HardwareProbe.fake(npu=True, triton=True))
    assert not ok and reason == why


def test_without_an_npu_the_reason_lists_every_missing_piece(monkeypatch, tmp_path):
    """What `python -m flce info` says on a machine with triton-ascend and no NPU or CANN."""
    monkeypatch.setattr(ascend, "triton_has_ascend_backend", lambda: (True, "triton-ascend 3.2.0"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TRITON_NPU_COMPILER_PATH", raising=False)
    probe = HardwareProbe.fake(npu=False, triton=True)
    ok, reason = ascend.BACKEND.is_available(probe)
    assert not ok
    assert reason.startswith(f"no Ascend NPU: {probe.npu[1]}")
    assert "triton-ascend 3.2.0 is installed" in reason and "bishengir-compile" in reason
    # An NPU and triton-ascend without CANN's compiler on PATH: unavailable, and that is the reason.
    ok, reason = ascend.BACKEND.is_available(HardwareProbe.fake(npu=True, triton=True))
    assert not ok and "bishengir-compile" in reason and "set_env.sh" in reason
    compiler = tmp_path / "bishengir-compile"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    ok, reason = ascend.BACKEND.is_available(HardwareProbe.fake(npu=True, triton=True))
    assert ok and str(compiler) in reason


def test_interpreter_serves_cpu_tensors_only_when_named():
    probe = HardwareProbe.fake(triton=True, triton_interpret=True)
    assert ascend.BACKEND.is_available(probe)[0]
    assert not ascend.BACKEND.serves("cpu")
    assert ascend.BACKEND.serves_when_asked("cpu", probe)
    assert candidates_for("cpu", "ascend", probe=probe).backends == (ascend.BACKEND,)
    assert "ascend" not in [b.name for b in candidates_for("cpu", probe=probe).backends]
    with pytest.raises(RuntimeError, match="not available"):
        candidates_for("cpu", "ascend", probe=HardwareProbe.fake(triton=True))


def test_supports_the_kernel_dtypes_only():
    for dtype in DTYPES:
        assert ascend.BACKEND.supports(LCEConfig(), dtype, 8, 16)[0]
    ok, reason = ascend.BACKEND.supports(LCEConfig(), torch.float64, 8, 16)
    assert not ok and "float64" in reason


def test_importing_the_backend_imports_neither_torch_npu_nor_its_kernels():
    # triton itself is this backend's to import only through kernels.py, on the first launch.
    code = ("import sys, flce, flce.backends.ascend.ops, flce.backends.ascend.plan;"
            "flce.get_impl('cpu'); flce.available_backends();"
            "print(sorted(m for m in ('torch_npu', 'flce.backends.ascend.kernels') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- misuse


def test_logits_passed_as_hidden_warn_once(monkeypatch):
    monkeypatch.setattr(ascend_plan, "_warned_logits_like", False)
    logits_like = _meta_inputs(8, 32000, 32000)
    with pytest.warns(RuntimeWarning, match="cross_entropy"):
        assert ascend_plan.warn_if_logits_like(logits_like)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ascend_plan.warn_if_logits_like(logits_like)  # recognised again, not repeated
        assert not ascend_plan.warn_if_logits_like(_meta_inputs(8, 4096, 32000))
        assert not ascend_plan.warn_if_logits_like(_meta_inputs(8, 64, 64))  # toy models are square too


# ----------------------------------------------------------------------------- the kernels


def test_contract_under_the_interpreter():
    """tests/test_ascend_contract.py with TRITON_INTERPRET=1 in a fresh process: the kernels run
    on CPU tensors through ``flce.get_impl("cpu", backend="ascend")``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLCE_ASCEND_CONTRACT_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "tests/test_ascend_contract.py", "-q", "-x", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


@pytest.mark.npu
def test_contract_on_a_real_npu():
    env = {**os.environ, "FLCE_ASCEND_CONTRACT_DEVICE": "npu"}
    cmd = [sys.executable, "-m", "pytest", "tests/test_ascend_contract.py", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


def test_flce_reports_the_backend():
    names = [row["name"] for row in flce.available_backends()]
    assert "ascend" in names


def test_tuning_space_matches_the_planner():
    """flce-autotune can fill the one knob the Ascend planner reads: its heuristic is the planner's
    own chunk, and a candidate's working memory is its chunk's logits (the kernels work in place)."""
    from flce.autotune import spaces

    space = spaces.tuning_space("ascend")
    shape = spaces.TuneShape(torch.device("cpu"), torch.bfloat16, hidden=1024, vocab=131072, tokens=8192,
                             variant="plain")
    planned = ascend_plan_for(shape.stand_in_inputs(), LCEConfig(), ops.device_properties(shape.device),
                                      "plain").tokens_per_chunk
    assert space.heuristic(shape) == {"tokens_per_chunk": planned}
    candidates = space.candidates(shape, True)
    assert candidates and all(set(c) == {"tokens_per_chunk"} for c in candidates)
    assert space.working_bytes(shape, {"tokens_per_chunk": 512}) == 512 * 131072 * 2
