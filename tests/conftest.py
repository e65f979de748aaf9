"""Test-session setup: hardware probed once, marker-based skips, shared fixtures.

The markers ``cuda``, ``npu``, ``triton`` and ``distributed`` are registered in
pyproject.toml (``[tool.pytest.ini_options]``), not here, so they are declared once.
A test carrying one of them is skipped where that thing is absent, and the skip
message says why (``pytest -rs`` lists them).

Probes here look at the real machine and ignore ``FLCE_PROBE_OVERRIDE``: that variable
fakes hardware for flce's registry, and a test that needs a GPU must not run on a
machine that only pretends to have one.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from functools import lru_cache

import pytest
import torch

# Without a GPU, Triton kernels can only run in the interpreter, and triton reads this variable
# as kernels are decorated: set it here, before any test module or probe imports triton, so
# every Triton backend (cuda, ascend) in this process runs interpreted on CPU tensors. With the
# variable set only by a test module, a kernel module imported earlier in the session kept
# compiled-mode helpers and every interpreter test failed in a full run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SKIP_MARKERS = ("cuda", "npu", "triton", "distributed")
SEED_ENV = "FLCE_TEST_SEED"
_GLOBAL_RNG_OFFSET = 0x9E3779B97F4A7C15

# What a user's shell may export to steer flce (FLCE_BACKEND=reference, a tuned cache of their own,
# faked probes) must not change what the suite tests: tests that want these set them themselves.
# The user cache ($XDG_CACHE_HOME/flce) moves to a directory of this session, so that neither the
# user's tuned entries are read nor the suite's tunes written there.
STEERING_ENV = ("FLCE_BACKEND", "FLCE_PROBE_OVERRIDE", "FLCE_AUTOTUNE_CACHE", "FLCE_DISTRIBUTED_CHECKS")
for _name in STEERING_ENV:
    os.environ.pop(_name, None)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="flce-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# Inductor's compiled code, likewise: its cache under /tmp is shared by every process of the machine's user, and code
# compiled by another checkout of flce (other custom-op schemas under the same names) fails to load here.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["XDG_CACHE_HOME"], "inductor"))


@lru_cache(maxsize=1)
def hardware() -> dict[str, tuple[bool, str]]:
    """marker name -> (present, what was found or why it is absent); probed once per session."""
    return {
        "cuda": _probe_cuda(),
        "npu": _probe_npu(),
        "triton": _probe_triton(),
        "distributed": _probe_distributed(),
    }


def _probe_cuda() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def _probe_npu() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises anything
        return False, f"import torch_npu failed: {exc}"
    if not torch.npu.is_available():
        return False, "torch.npu.is_available() is False"
    return True, f"{torch.npu.device_count()} NPU(s)"


def _probe_triton() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install -e '.[test]')"
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:
        return False, f"import triton failed: {exc}"
    return True, f"triton {triton.__version__}"


def _probe_distributed() -> tuple[bool, str]:
    if not torch.distributed.is_available():
        return False, "torch.distributed is not available in this torch build"
    if not torch.distributed.is_gloo_available():
        return False, "torch.distributed has no gloo backend (needed to run ranks on the CPU)"
    return True, "torch.distributed with gloo"


def pytest_report_header(config: pytest.Config) -> list[str]:
    found = ", ".join(f"{name}={'yes' if ok else 'no'}" for name, (ok, _) in hardware().items())
    return [f"flce hardware: {found}; {SEED_ENV}={os.environ.get(SEED_ENV, '0')}"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in item.iter_markers():
        if marker.name in SKIP_MARKERS:
            present, reason = hardware()[marker.name]
            if not present:
                pytest.skip(f"needs {marker.name}: {reason}")


@pytest.fixture
def device() -> torch.device:
    """The first available device: CUDA, then NPU, then the CPU."""
    if hardware()["cuda"][0]:
        return torch.device("cuda", 0)
    if hardware()["npu"][0]:
        return torch.device("npu", 0)
    return torch.device("cpu")


def _test_seed(request: pytest.FixtureRequest) -> int:
    """The test's seed: from its id and FLCE_TEST_SEED (default 0)."""
    base = int(os.environ.get(SEED_ENV, "0"))
    return (zlib.crc32(request.node.nodeid.encode()) + 1_000_003 * base) % (2**63)


@pytest.fixture
def generator(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id (and FLCE_TEST_SEED, default 0): every test gets
    its own fresh random inputs, reproducible run to run; set FLCE_TEST_SEED to draw others."""
    return torch.Generator().manual_seed(_test_seed(request))


@pytest.fixture(autouse=True)
def seeded_global_rng(request: pytest.FixtureRequest) -> None:
    """torch's global generators (CPU and every GPU) seeded the same way for each test: a test that draws from
    them (helpers.lm_head_inputs) gets the same inputs whichever tests ran before it in its process, so a
    failure under pytest-xdist, whose workers take tests in an order that depends on timing, reproduces. Offset
    from ``generator``'s seed, so that the two do not draw the same numbers."""
    torch.manual_seed((_test_seed(request) + _GLOBAL_RNG_OFFSET) % (2**63))


# Above this much memory reserved by torch's caching allocator after a test, the reserve goes back to the driver.
RELEASE_GPU_MEMORY_ABOVE = 1 << 30


def release_cached_gpu_memory(cuda=torch.cuda) -> bool:
    """Hand the GPU memory a finished test left in torch's cache back to the driver, where it holds more than
    RELEASE_GPU_MEMORY_ABOVE; whether it did. Two pytest-xdist workers share one GPU: one worker kept 46.23 GiB
    reserved after its large tests, and the other worker's tests ran out of memory on an 80 GB H100 (a float64
    oracle's 1.1-4.6 GiB, a Triton launch; two runs of the cuda-marked suite, the same figure in both)."""
    if not (cuda.is_available() and cuda.is_initialized()) or cuda.memory_reserved() <= RELEASE_GPU_MEMORY_ABOVE:
        return False
    gc.collect()  # tensors kept alive only by reference cycles (a failed test's traceback) first
    cuda.empty_cache()
    return True


@pytest.fixture(autouse=True)
def release_gpu_memory_after_test() -> Iterator[None]:
    yield
    release_cached_gpu_memory()


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """Lets a test register fake backends: the registry, its warn-once memory and the cache of
    get_impl classes are restored afterwards."""
    import flce.module
    from flce.registry import selection

    selection.registered_backends()  # load the built-ins first, so they are part of the snapshot
    saved_registry = dict(selection._registry)
    saved_warned = set(selection._warned)
    flce.module._impl_class.cache_clear()
    try:
        yield
    finally:
        selection._registry.clear()
        selection._registry.update(saved_registry)
        selection._warned.clear()
        selection._warned.update(saved_warned)
        flce.module._impl_class.cache_clear()


@pytest.fixture(autouse=True)
def fresh_planner_memos() -> Iterator[None]:
    """The planners memoise their records by call description (a pure function of it in a process); tests
    that patch a planner's constants (block widths, budgets) must not meet a record another test made."""
    from flce.backends import cuda
    from flce.backends.reference import distillation as reference_distillation
    from flce.backends.reference import plan as reference_plan

    cuda._planned.clear()
    cuda._planned_distillations.clear()
    reference_plan._planned.clear()
    reference_distillation._planned.clear()
    yield
